"""Text data: tokenised with a local tokenizer, packed into rows of seq_len + 1, cached once per machine,
and refused before any actor starts when the input is wrong (raytrain.data.text)."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain import data
from raytrain.config import load_config
from raytrain.data import text as text_data
from raytrain.driver.prepare import prepare

tokenizers = pytest.importorskip("tokenizers")

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every jolly boxer café naïve 東京 data parallel pipeline stage worker").split()
EOT = "<|endoftext|>"
VOCAB = 300
SEQ_LEN = 16


def make_documents(count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))) + rng.choice([".", "!", "?\n"])
            for _ in range(count)]


def train_tokenizer(out_dir: Path, special_tokens=(EOT,), vocab_size: int = VOCAB, docs=None):
    """A byte-level BPE tokenizer saved as out_dir/tokenizer.json; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs or make_documents(), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok


def write_parquet(path: Path, docs, column: str = "text") -> str:
    pq.write_table(pa.table({column: pa.array(docs, type=pa.string()), "n": list(range(len(docs)))}), str(path),
                   row_group_size=97)  # several row groups, not a multiple of the read batch
    return str(path)


def write_jsonl(path: Path, docs, key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, key: doc}) + "\n")
            if i % 50 == 0:
                f.write("\n")  # blank lines are skipped
    return str(path)


def stream_length(tok, docs, separator: bool = True) -> int:
    """Tokens in the packed stream, counted independently of the packing code."""
    ids = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
    return ids + (len(docs) - 1 if separator else 0)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return str(out)


@pytest.fixture
def text_config(tmp_path, tokenizer_dir):
    def build(path: str, *overrides: str):
        return load_config(None, [
            f"data.path={path}", "data.text_column=text", f"data.tokenizer={tokenizer_dir}",
            f"data.cache_dir={tmp_path / 'cache'}", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ_LEN}",
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.global_batch=8",
            f"run.dir={tmp_path / 'runs'}", *overrides])
    return build


# --- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_packed_rows_decode_back_to_the_documents(tmp_path, tokenizer_dir, kind):
    docs = make_documents()
    write = write_parquet if kind == "parquet" else write_jsonl
    path = write(tmp_path / f"docs.{kind}", docs)
    width = SEQ_LEN + 1
    rows = text_data.packed_rows(path, "text", tokenizer_dir, width, str(tmp_path / "cache"))
    tok = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    assert rows.shape == (stream_length(tok, docs) // width, width)  # the trailing partial row is dropped
    decoded = tok.decode(rows.reshape(-1).tolist(), skip_special_tokens=False)
    joined = EOT.join(docs)
    assert joined.startswith(decoded) and len(joined) - len(decoded) < 4 * width  # at most a part row lost
    assert int((rows == tok.token_to_id(EOT)).sum()) == decoded.count(EOT) > 100


def test_parquet_and_json_lines_pack_the_same_rows(tmp_path, tokenizer_dir):
    docs = make_documents(seed=1)
    cache = str(tmp_path / "cache")
    a = text_data.packed_rows(write_parquet(tmp_path / "d.parquet", docs), "text", tokenizer_dir, 9, cache)
    b = text_data.packed_rows(write_jsonl(tmp_path / "d.jsonl", docs), "text", tokenizer_dir, 9, cache)
    assert a.shape[1] == 9 and np.array_equal(a, b)


@pytest.mark.parametrize("specials, separator", [
    ((EOT,), EOT), (("<s>", "</s>"), "</s>"), (("[CLS]", "[SEP]"), "[SEP]"), ((), ""),
])
def test_documents_are_joined_by_the_end_of_text_token(tmp_path, specials, separator):
    docs = make_documents(80, seed=2)
    tok = train_tokenizer(tmp_path / "tok", specials)
    if "[SEP]" in specials:  # a BERT-style tokenizer: its per-sequence tokens and truncation must not apply
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
            ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
        tok.enable_truncation(max_length=4)
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    rows = text_data.packed_rows(write_jsonl(tmp_path / "d.jsonl", docs), "text", str(tmp_path / "tok"), 5,
                                 str(tmp_path / "cache"))
    tok.no_truncation()
    decoded = tok.decode(rows.reshape(-1).tolist(), skip_special_tokens=False)
    joined = separator.join(docs)
    assert joined.startswith(decoded) and len(joined) - len(decoded) < 40
    assert rows.shape[0] == stream_length(tok, docs, separator=bool(separator)) // 5


def test_packed_rows_feed_the_run_as_token_rows(tmp_path, text_config):
    cfg = text_config(write_jsonl(tmp_path / "d.jsonl", make_documents()))
    prepared = prepare(cfg)
    (path,) = prepared.source.train.paths
    dataset = data.open_dataset(path, prepared.cfg)
    assert prepared.num_samples == len(dataset) == len(text_data.packed_rows(
        path, "text", cfg.data.tokenizer, SEQ_LEN + 1, cfg.data.cache_dir))
    x, y = dataset.batch([0, 3, prepared.num_samples - 1])
    assert x.shape == y.shape == (3, SEQ_LEN) and bool((x[:, 1:] == y[:, :-1]).all())
    assert int(dataset.rows.max()) < VOCAB and str(x.dtype) == "torch.int64"


# --- the cache ----------------------------------------------------------------------------------


def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, monkeypatch):
    docs = make_documents()
    tok_dir, cache = tmp_path / "tok", str(tmp_path / "cache")
    train_tokenizer(tok_dir)
    source = write_parquet(tmp_path / "d.parquet", docs)
    first = text_data.packed_rows(source, "text", str(tok_dir), 17, cache)
    built = text_data.packed_path(source, "text", str(tok_dir), 17, cache)
    assert os.path.exists(built) and sorted(os.listdir(os.path.dirname(built))) == sorted(
        [os.path.basename(built), os.path.basename(built) + ".lock"])  # no temporary file left behind

    real_build = text_data.build_packed
    builds = []
    monkeypatch.setattr(text_data, "build_packed", lambda *a: builds.append(a[-1]) or real_build(*a))
    again = text_data.packed_rows(source, "text", str(tok_dir), 17, cache)
    assert builds == [] and np.array_equal(first, again)  # reused: no tokenising on the second open

    text_data.packed_rows(source, "text", str(tok_dir), 9, cache)  # another width
    train_tokenizer(tok_dir, vocab_size=280)  # the same directory, a different tokenizer.json
    changed = text_data.packed_rows(source, "text", str(tok_dir), 17, cache)
    assert len(builds) == 2 and built not in builds and len(set(builds)) == 2
    assert not np.array_equal(first[: len(changed)], changed[: len(first)])
    assert int(changed.max()) < 280


def test_a_failed_build_leaves_no_cache(tmp_path, tokenizer_dir):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, make_documents(40))
    with open(path, "a") as f:
        f.write('{"text": "fine"}\n{"text": 7}\n')
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"line 43: data.text_column='text' holds int, not text"):
        text_data.packed_rows(str(path), "text", tokenizer_dir, 17, str(cache))
    left = [p.name for p in (cache / "decoded").iterdir()]
    assert all(name.endswith(".lock") for name in left), left


# --- bad input, refused by prepare before any actor ------------------------------------------------


def _refused(text_config, path, *overrides) -> str:
    with pytest.raises(ValueError) as err:
        prepare(text_config(path, *overrides))
    return str(err.value)


def _text_parquet(tmp_path, **columns):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table(columns), path)
    return path


BAD_TEXT_INPUT = [  # (what, overrides, fragments the message must hold)
    ("text without tokenizer", ["data.tokenizer=null"], ["data.text_column='text'", "set data.tokenizer"]),
    ("tokenizer without text", ["data.text_column=null"], ["data.tokenizer=", "set data.text_column"]),
    ("no tokenizer directory", ["data.tokenizer=/nonexistent/tok"], ["data.tokenizer='/nonexistent/tok'",
                                                                     "no such directory"]),
    ("no tokenizer.json", ["data.tokenizer={empty}"], ["data.tokenizer=", "holds no tokenizer.json"]),
    ("unreadable tokenizer.json", ["data.tokenizer={garbage}"], ["data.tokenizer", "not a tokenizer file"]),
    ("missing column", ["data.text_column=body"], ["data.text_column='body'", "'text'"]),
    ("tokenizer too large", ["model.vocab_size=256"], ["data.tokenizer=", "model.vocab_size=256",
                                                       f"model.vocab_size >= {VOCAB}"]),
    ("too few rows", ["train.global_batch=4096"], ["train.global_batch=4096", "fewer than", "model.seq_len"]),
    ("text on the built-in corpus", ["data.path=null"], ["data.text_column", "data.path"]),
]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.parametrize("what, overrides, fragments", BAD_TEXT_INPUT, ids=[b[0] for b in BAD_TEXT_INPUT])
def test_bad_text_input_is_refused_naming_the_key(tmp_path, text_config, kind, what, overrides, fragments):
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("{not json")
    docs = make_documents()
    path = write_parquet(tmp_path / "d.parquet", docs) if kind == "parquet" else write_jsonl(tmp_path / "d.jsonl", docs)
    overrides = [o.format(empty=tmp_path / "empty", garbage=tmp_path / "garbage") for o in overrides]
    message = _refused(text_config, path, *overrides)
    assert all(f in message for f in fragments), message


def test_a_column_that_is_not_text_is_refused(tmp_path, text_config):
    message = _refused(text_config, _text_parquet(tmp_path, text=[[1, 2, 3]] * 10))
    assert "data.text_column='text'" in message and "not text" in message and "data.column" in message
    message = _refused(text_config, _text_parquet(tmp_path, text=make_documents(8)[:7] + [None]))
    assert "row 7 of data.text_column='text' is null" in message


def test_bad_json_lines_are_refused_naming_the_line(tmp_path, text_config):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "a"}\n')
    assert "line 1 has no key data.text_column='text' (its keys: ['body'])" in _refused(text_config, str(path))
    path.write_text('{"text": ["a", "b"]}\n')
    assert "line 1: data.text_column='text' holds list, not text" in _refused(text_config, str(path))
    path.write_text('[{"text": "a"},\n{"text": "b"}]\n')
    assert "line 1 is not JSON" in _refused(text_config, str(path))
    path.write_text('{"text": "fine"}\n' * 3 + "{broken\n")
    assert "line 4 is not JSON" in _refused(text_config, str(path))  # found while tokenising, still in prepare
    path.write_bytes(b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    assert "is not UTF-8 text" in _refused(text_config, str(path))


def test_json_lines_without_text_column_are_refused(tmp_path, text_config):
    message = _refused(text_config, write_jsonl(tmp_path / "d.jsonl", ["a"]), "data.text_column=null",
                       "data.tokenizer=null")
    assert "set data.text_column" in message and "data.tokenizer" in message


def test_a_missing_tokenizers_library_names_the_extra(tmp_path, text_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    message = _refused(text_config, write_jsonl(tmp_path / "d.jsonl", make_documents()))
    assert "data.tokenizer=" in message and "pip install -e '.[hf]'" in message


# --- the helper that makes a tokenizer ----------------------------------------------------------------


def test_make_tokenizer_writes_a_tokenizer_a_run_accepts(tmp_path, text_config):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, make_documents())
    script = Path(__file__).resolve().parents[1] / "experiments" / "make_tokenizer.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "tok"), "--vocab-size", "290",
                           "--text-column", "text", str(corpus)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.get_vocab_size() == 290 and tok.token_to_id(EOT) is not None
    prepared = prepare(text_config(str(corpus), f"data.tokenizer={tmp_path / 'tok'}", "model.vocab_size=290"))
    assert prepared.num_samples == stream_length(tok, make_documents()) // (SEQ_LEN + 1)


# --- end to end ------------------------------------------------------------------------------------


def test_dp2_trains_on_text(ray_session, make_config, tmp_path, tokenizer_dir):
    from raytrain import train
    from raytrain.testing.reference import train_reference

    path = write_jsonl(tmp_path / "d.jsonl", make_documents())
    cfg = make_config("parallel.dp=2", "train.steps=2", f"data.path={path}", "data.text_column=text",
                      f"data.tokenizer={tokenizer_dir}", f"model.vocab_size={VOCAB}")
    result = train(cfg)
    losses = [r["loss"] for r in result.metrics]
    assert result.steps == 2 and len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(train_reference(cfg)[1], rel=1e-5)  # the workers read the driver's rows


def test_the_tiny_llama_example_trains_on_text_and_its_held_out_loss_falls(ray_session, tmp_path, tokenizer_dir):
    """experiments/configs/tiny_llama.yaml as written, on a small text and tokenizer: a Hugging Face
    Llama from the shipped config.json, pp=2, warm-up + cosine, eval every few steps."""
    pytest.importorskip("transformers")
    from raytrain import load_config, train

    repo = Path(__file__).resolve().parents[1]
    path = write_jsonl(tmp_path / "d.jsonl", make_documents(count=1500))
    cfg = load_config(str(repo / "experiments" / "configs" / "tiny_llama.yaml"), [
        f"model.hf={repo / 'experiments' / 'configs' / 'tiny_llama'}", f"data.path={path}",
        f"data.tokenizer={tokenizer_dir}", "model.seq_len=32", "train.steps=12", "train.warmup_steps=3",
        "eval.every=4", "eval.batches=2", "data.eval_fraction=0.1", "checkpoint.every=0",
        f"run.dir={tmp_path / 'runs'}", "run.trace_steps=0"])
    result = train(cfg)
    evals = [r["eval_loss"] for r in result.metrics if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] and result.eval_loss == evals[-1]
    assert [round(r["lr"], 8) for r in result.metrics][:3] == [1e-3, 2e-3, 3e-3]  # warm-up to train.lr=3e-3
