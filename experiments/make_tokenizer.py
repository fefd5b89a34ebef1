"""Train a byte-level BPE tokenizer on your text and save it as OUT/tokenizer.json, for data.tokenizer.

    python experiments/make_tokenizer.py --out tok --vocab-size 4096 corpus.txt more.txt
    python experiments/make_tokenizer.py --out tok --text-column text docs.jsonl docs.parquet

Plain files are read line by line; ``.jsonl``/``.json`` and ``.parquet`` files give the text under
--text-column, read as a run reads them (raytrain.data.text). The tokenizer is byte-level (any text
encodes, none is unknown, decoding gives the text back) and has ``<|endoftext|>``, which a run puts
between documents. Then train with, e.g.:

    --set data.path=docs.jsonl --set data.text_column=text --set data.tokenizer=tok --set model.vocab_size=4096

Needs the tokenizers library: pip install -e '.[hf]'.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterable, Iterator, Optional

END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> str:
    """Train the tokenizer on ``texts`` and save it; returns the path of its tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tokenizer.save(path)
    return path


def read_texts(paths: list[str], text_column: Optional[str]) -> Iterator[str]:
    """Lines of plain files; documents of JSON lines and Parquet files (under ``text_column``)."""
    from raytrain.data import text as text_data

    for path in paths:
        if text_data.is_json_lines(path) or path.endswith(".parquet"):
            if text_column is None:
                raise SystemExit(f"{path}: give --text-column, the key or column holding the text")
            for batch in text_data.documents(path, text_column):
                yield from batch
        else:
            with open(path, encoding="utf-8") as f:
                yield from f


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="text, .jsonl/.json or .parquet files")
    parser.add_argument("--out", required=True, help="directory to write tokenizer.json into")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokens, <|endoftext|> and the 256 bytes included")
    parser.add_argument("--text-column", help="key (JSON lines) or column (Parquet) holding the text")
    args = parser.parse_args(argv)
    path = train_bpe(read_texts(args.files, args.text_column), args.vocab_size, args.out)
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    print(f"wrote {path}: {size} tokens; set data.tokenizer={args.out} and model.vocab_size >= {size}")


if __name__ == "__main__":
    main()
