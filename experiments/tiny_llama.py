"""Train the small Llama of experiments/configs/tiny_llama.yaml on English text, in one command:

    python experiments/tiny_llama.py [--set key=value ...]

The text is the standard library's docstrings (written once to ~/.cache/raytrain/tiny_llama/
docstrings.jsonl), the tokenizer a 2048-token byte-level BPE trained on them; then the run starts,
printing its progress, and writes loss.png (training and held-out loss) in its run directory.
Needs the hf extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tokenizer import train_bpe  # noqa: E402

from raytrain import train  # noqa: E402
from raytrain.config import load_config  # noqa: E402
from raytrain.data.atomic import atomic_path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs", "tiny_llama.yaml")
WORK = os.path.expanduser("~/.cache/raytrain/tiny_llama")
MAX_TEXT_BYTES = 6_000_000


def docstrings() -> Iterator[str]:
    """Module, class and function docstrings of the standard library, in file order."""
    root = sysconfig.get_paths()["stdlib"]
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node)
                    if text and len(text) > 80:
                        yield text


def build_text(path: str) -> None:
    """Write the docstrings as JSON lines ``{"text": ...}``, up to MAX_TEXT_BYTES of text."""
    total = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for text in docstrings():
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= MAX_TEXT_BYTES:
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    text_path, tokenizer_dir = os.path.join(WORK, "docstrings.jsonl"), os.path.join(WORK, "tokenizer")
    if not os.path.exists(text_path):
        build_text(text_path)
    if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        with open(text_path, encoding="utf-8") as f:
            train_bpe((json.loads(line)["text"] for line in f), 2048, tokenizer_dir)
    os.chdir(os.path.dirname(HERE))  # model.hf in the config is relative to the repository root
    result = train(load_config(CONFIG, args.overrides))
    print(json.dumps(result.summary()))


if __name__ == "__main__":
    main()
