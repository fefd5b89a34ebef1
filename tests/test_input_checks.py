"""Bad input (a config file that is not YAML or cannot be read, a bad --set value, an unwritable cache
directory, a factory that returns the wrong type, a broken sweep file) ends in one line naming the file or
key and the fix, with exit 2, before any actor starts, never in a traceback or silently; and token rows
longer than model.seq_len + 1 train as all their windows, none cut."""

import io
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain import data, train
from raytrain.config import load_config
from raytrain.driver.prepare import prepare


def _cli(*args: str, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain", "train", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def _one_line_exit_2(proc: subprocess.CompletedProcess, *must_mention: str) -> str:
    """The run ended with exit 2 and one line on stderr naming what it must, no traceback, no Ray."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    for text in must_mention:
        assert text in lines[0], f"{text!r} missing from: {lines[0]}"
    return lines[0]


# --- --config: a YAML syntax error, a directory ----------------------------------------------------


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: 2\n train: [\n")
    line = _one_line_exit_2(_cli("--config", str(bad)), str(bad), "line 3", "YAML")
    assert "fix" in line


def test_a_bad_set_value_names_the_override(tmp_path):
    line = _one_line_exit_2(_cli("--set", "parallel.split_points=[2,"), "--set", "parallel.split_points=[2,")
    assert "YAML" in line


def test_a_sweep_file_given_to_train_names_the_sweep_command():
    _one_line_exit_2(_cli("--config", "experiments/configs/sweep_tiny.yaml"), "sweep_tiny.yaml is a sweep",
                     "python -m raytrain sweep --config")


def test_config_pointing_at_a_directory_is_named(tmp_path):
    _one_line_exit_2(_cli("--config", str(tmp_path)), str(tmp_path), "is a directory", "--config")


def test_an_unreadable_config_file_is_named(tmp_path):
    raw = tmp_path / "latin1.yaml"
    raw.write_bytes(b"run:\n  name: caf\xe9\n")  # not UTF-8
    with pytest.raises(ValueError, match="latin1.yaml.*UTF-8"):
        load_config(str(raw))


# --- data.cache_dir that cannot be written ----------------------------------------------------------


def _cache_under_a_file(tmp_path) -> str:
    """A cache_dir no one can create, root included (root ignores mode bits, not a file in the path)."""
    (tmp_path / "afile").write_text("a regular file")
    return str(tmp_path / "afile" / "sub")


def _cache_is_a_file(tmp_path) -> str:
    (tmp_path / "cachefile").write_text("a regular file")
    return str(tmp_path / "cachefile")


def _cache_read_only(tmp_path) -> str:
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o500)
    return str(path)


@pytest.mark.parametrize("where", [
    _cache_under_a_file, _cache_is_a_file,
    pytest.param(_cache_read_only, marks=pytest.mark.skipif(os.geteuid() == 0, reason="root ignores mode bits")),
])
def test_an_unwritable_cache_dir_is_named_before_anything_starts(tmp_path, where):
    cache = where(tmp_path)
    _one_line_exit_2(_cli("--set", f"data.cache_dir={cache}", "--set", f"run.dir={tmp_path / 'runs'}"),
                     f"data.cache_dir={cache!r}", "writable directory")


# --- model.factory returning the wrong type -----------------------------------------------------------

BAD_FACTORIES = '''
from torch import nn

def number(cfg):
    return 42

def text(cfg):
    return "layers"

def nothing(cfg):
    return None

def a_dict(cfg):
    return {"embed": nn.Embedding(cfg.vocab_size, 8)}

def one_module(cfg):
    return nn.Linear(8, 8)

def empty(cfg):
    return []

def not_all_modules(cfg):
    return [nn.Embedding(cfg.vocab_size, 8), "head"]

def triple(cfg):
    return [nn.Embedding(cfg.vocab_size, 8)], None, None

def two_modules(cfg):
    return nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size)

def loss_not_callable(cfg):
    return [nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size)], 3.0

def good(cfg):
    return [nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size)]
'''


@pytest.fixture(scope="module")
def factory_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("factories")
    (where / "ic_bad_factories.py").write_text(BAD_FACTORIES)
    return where


@pytest.mark.parametrize("name, returned", [
    ("number", "int"), ("text", "str"), ("nothing", "None"), ("a_dict", "dict"), ("one_module", "Linear"),
    ("empty", "an empty list"), ("not_all_modules", "str at index 1"), ("triple", "a tuple of 3"),
    ("loss_not_callable", "float as its loss function"), ("two_modules", "pair whose layers are Embedding"),
])
def test_a_factory_of_the_wrong_type_is_named(factory_dir, monkeypatch, tmp_path, data_cache, name, returned):
    monkeypatch.syspath_prepend(str(factory_dir))
    cfg = load_config(None, [f"model.factory=ic_bad_factories:{name}", f"data.cache_dir={data_cache}",
                             "data.max_bytes=200000", f"run.dir={tmp_path / 'runs'}"])
    with pytest.raises(ValueError) as err:
        prepare(cfg)
    message = str(err.value)
    assert f"model.factory='ic_bad_factories:{name}'" in message and returned in message, message
    assert "nn.Sequential" in message and "(layers, loss_fn)" in message, message
    good = load_config(None, ["model.factory=ic_bad_factories:good", f"data.cache_dir={data_cache}",
                              "data.max_bytes=200000", f"run.dir={tmp_path / 'runs'}"])
    assert prepare(good).layout.num_layers == 2


def test_cli_names_a_factory_of_the_wrong_type(factory_dir, tmp_path, data_cache):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(factory_dir), os.environ.get("PYTHONPATH", "")])}
    proc = _cli("--set", "model.factory=ic_bad_factories:number", "--set", f"data.cache_dir={data_cache}",
                "--set", "data.max_bytes=200000", "--set", f"run.dir={tmp_path / 'runs'}", env=env)
    _one_line_exit_2(proc, "model.factory='ic_bad_factories:number'", "returned int", "nn.Sequential")


# --- token rows longer than model.seq_len + 1: every window, none cut -----------------------------------


def _rows_of(lengths, start=0) -> list[list[int]]:
    """Rows of consecutive distinct ids (row i's continue where row i-1's stopped)."""
    out, at = [], start
    for n in lengths:
        out.append(list(range(at, at + n)))
        at += n
    return out


def _windows(rows, width) -> np.ndarray:
    """What the run must train on: each row cut into consecutive windows of ``width``, its tail dropped."""
    return np.array([r[k * width:(k + 1) * width] for r in rows for k in range(len(r) // width)])


def _columns(rows) -> dict:
    """The same byte-valued rows as every token column type raytrain reads."""
    equal = len({len(r) for r in rows}) == 1
    kinds = {"list": pa.array(rows, type=pa.list_(pa.int64())),
             "large_list": pa.array(rows, type=pa.large_list(pa.uint16())),
             "binary": pa.array([bytes(r) for r in rows], type=pa.binary())}
    if equal:
        kinds["fixed_list"] = pa.array(rows, type=pa.list_(pa.int32(), len(rows[0])))
        kinds["fixed_binary"] = pa.array([bytes(r) for r in rows], type=pa.binary(len(rows[0])))
    return kinds


@pytest.mark.parametrize("lengths", [[65] * 6, [27, 9, 30, 18, 45]], ids=["equal", "ragged"])
def test_long_rows_become_all_their_windows(tmp_path, lengths):
    width = 9  # seq_len 8
    rows = [[v % 256 for v in r] for r in _rows_of(lengths)]
    want = _windows(rows, width)
    for kind, column in _columns(rows).items():
        for stats in (True, False):
            path = str(tmp_path / f"{kind}-{stats}.parquet")
            pq.write_table(pa.table({"tokens": column}), path, write_statistics=stats, row_group_size=2)
            assert data.check_dataset(path, "tokens", seq_len=8, global_batch=4, vocab_size=256) == len(want), kind
            direct = data.TokenDataset(path, "tokens", seq_len=8)
            cached = data.TokenDataset(path, "tokens", seq_len=8, cache_dir=str(tmp_path / "cache"))
            for ds in (direct, cached):
                assert len(ds) == len(want) and np.asarray(ds.rows).tolist() == want.tolist(), kind
            x, y = cached.batch([len(want) - 1, 0])
            assert x.tolist() == want[[-1, 0], :-1].tolist() and y.tolist() == want[[-1, 0], 1:].tolist()


def test_windows_count_against_the_global_batch_and_short_rows_still_fail(tmp_path):
    path = str(tmp_path / "two.parquet")
    data.write_token_parquet(path, np.arange(2 * 90).reshape(2, 90) % 256)  # 2 rows, 10 windows of 9 each
    assert data.check_dataset(path, "tokens", seq_len=8, global_batch=16, vocab_size=256) == 20
    with pytest.raises(ValueError, match=r"2 rows of .* hold 20 samples .*fewer than train.global_batch=32"):
        data.check_dataset(path, "tokens", seq_len=8, global_batch=32, vocab_size=256)
    short = str(tmp_path / "short.parquet")
    pq.write_table(pa.table({"tokens": pa.array(_rows_of([20, 5, 30]), type=pa.list_(pa.int64()))}), short)
    with pytest.raises(ValueError, match=r"data.eval_path='.*short.parquet'.*row 1 has 5.*lower model.seq_len"):
        data.check_dataset(short, "tokens", seq_len=8, global_batch=0, vocab_size=256, key="data.eval_path")


def test_the_cache_of_cut_rows_is_not_reused(tmp_path):
    # A cache built by a version that cut long rows has the same source, column and width: its key must differ.
    from raytrain.data import token_cache

    path = str(tmp_path / "long.parquet")
    data.write_token_parquet(path, np.arange(3 * 27).reshape(3, 27) % 256)
    old_key = f"{os.path.abspath(path)}|{os.stat(path).st_size}|{os.stat(path).st_mtime_ns}|tokens|9"
    import hashlib
    old = os.path.join(str(tmp_path / "cache"), "decoded",
                       f"long.parquet-{hashlib.sha1(old_key.encode()).hexdigest()[:16]}.npy")
    assert token_cache.cache_path(path, "tokens", 9, str(tmp_path / "cache")) != old


def test_prepare_counts_windows_for_training_and_held_out_rows(tmp_path, data_cache):
    train_path, eval_path = str(tmp_path / "train.parquet"), str(tmp_path / "eval.parquet")
    data.write_token_parquet(train_path, np.arange(4 * 170).reshape(4, 170) % 256)  # 4 rows x 10 windows of 17
    data.write_token_parquet(eval_path, np.arange(2 * 40).reshape(2, 40) % 256)  # 2 rows x 2 windows
    base = ["model.seq_len=16", "train.global_batch=4", f"data.cache_dir={data_cache}", f"run.dir={tmp_path / 'r'}",
            f"data.path={train_path}"]
    assert prepare(load_config(None, base)).num_samples == 40
    prepared = prepare(load_config(None, base + ["data.eval_fraction=0.25"]))
    assert (prepared.num_samples, prepared.held_out) == (30, 10)
    prepared = prepare(load_config(None, base + [f"data.eval_path={eval_path}"]))
    assert (prepared.num_samples, prepared.held_out) == (40, 4)


def test_long_rows_train_every_window_exactly_once_per_epoch(ray_session, make_config, tmp_path):
    # Rows of up to 1,700 ids at seq_len 16 are 265 windows of 17 (the tails of 8, 14 and 10 ids left over),
    # not 5 samples; each id is distinct, so the ids seen say which tokens were trained on.
    lengths, width, B = [1300, 1000, 1700, 520, 17], 17, 32
    rows = _rows_of(lengths)
    path = str(tmp_path / "long.parquet")
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), path)
    windows = _windows(rows, width)
    assert len(windows) == 265
    steps = len(windows) // B + 2  # past the end of the first epoch
    cfg = make_config(f"data.path={path}", f"model.vocab_size={sum(lengths)}", f"train.global_batch={B}",
                      f"train.steps={steps}", "run.record_samples=true", "parallel.dp=2")
    assert prepare(cfg).num_samples == len(windows)
    log = io.StringIO()
    result = train(cfg, stream=log)
    assert re.search(rf"\b{len(windows)} samples\b", log.getvalue()), log.getvalue()
    consumed = [i for row in result.metrics for i in row["sample_ids"]]
    assert len(consumed) == steps * B
    first_epoch = consumed[:len(windows)]
    assert sorted(first_epoch) == list(range(len(windows)))
    seen = np.sort(data.TokenDataset(path, "tokens", seq_len=16).rows[first_epoch].reshape(-1))
    assert seen.tolist() == np.sort(windows.reshape(-1)).tolist()  # every window's tokens, once each


@pytest.mark.parametrize("text, needle", [
    ("space: {train.lr: [0.1]\n", "not valid YAML"),
    ("train: {steps: 2}\nspace: {train.lr: [0.1, 0.2]}\ntrain: {steps: 3}\n", "key 'train' appears twice"),
])
def test_a_broken_sweep_file_is_one_line_naming_it(tmp_path, text, needle):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "raytrain", "sweep", "--config", str(path)], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "sweep.yaml" in lines[0] and needle in lines[0] and "Traceback" not in out.stderr, lines


def test_a_damaged_page_inside_a_directory_is_named_by_its_file(make_config, tmp_path):
    """The footer reads, a data page does not: one line naming the file, before any actor."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.parquet", "b.parquet"):  # rows of different lengths: the check reads every page
        rows = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(40, 80, size=200)]
        pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int64()))}), corpus / name,
                       compression="none", write_statistics=False)
    damaged = corpus / "b.parquet"
    raw = bytearray(damaged.read_bytes())
    raw[8:len(raw) // 2] = b"\xff" * (len(raw) // 2 - 8)  # the pages, not the footer at the end
    damaged.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"b.parquet' cannot be read past its footer .*: the file is damaged"):
        prepare(make_config(f"data.path={corpus}"))
