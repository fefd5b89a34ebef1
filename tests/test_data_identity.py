"""The run's files by identity: held-out files are never training files (by path, link or content), one file
is never trained twice an epoch through a link, only regular files are read (all before any actor starts),
and the decode cache follows a file's content."""

import os
import shutil
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain import data
from raytrain.config import load_config
from raytrain.data import identity
from raytrain.driver.plan import prepare

SEQ_LEN = 8
WIDTH = SEQ_LEN + 1
B = 4


def write_windows(path, rows: int, seed: int) -> str:
    """``rows`` token windows as one fixed-width bytes column, uncompressed: any other ``seed`` gives a file of
    the same size (and the same footer layout), so a rewrite can keep the size and the modification time."""
    tokens = np.random.default_rng(seed).integers(0, 256, size=rows * WIDTH, dtype=np.uint8)
    column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(WIDTH), rows, [None, pa.py_buffer(tokens.tobytes())])
    pq.write_table(pa.table({"tokens": column}), str(path), compression="none", use_dictionary=False,
                   write_statistics=False)
    return str(path)


def corpus(where, files: int = 2, rows: int = 10) -> list[str]:
    os.makedirs(where, exist_ok=True)
    return [write_windows(os.path.join(where, f"part-{i}.parquet"), rows, seed=i) for i in range(files)]


def config(tmp_path, *overrides: str):
    """A small GPT on ``tmp_path``/corpus; ``overrides`` (--set strings) replace these settings or add to them."""
    settings = dict(s.split("=", 1) for s in [
        f"data.path={tmp_path / 'corpus'}", f"model.seq_len={SEQ_LEN}", "model.n_layer=2", "model.d_model=32",
        "model.n_head=2", f"train.global_batch={B}", "train.steps=10", f"data.cache_dir={tmp_path / 'cache'}",
        f"run.dir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ckpts'}", *overrides])
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


def refusal(cfg) -> str:
    with pytest.raises(ValueError) as e:
        prepare(cfg)
    return str(e.value)


# --- held-out files apart from the training files ----------------------------------------------------


def test_an_eval_path_inside_the_data_directory_is_refused_before_anything_is_read(tmp_path):
    paths = corpus(tmp_path / "corpus", files=3)
    message = refusal(config(tmp_path, f"data.eval_path={paths[1]}"))
    assert f"data.eval_path file {paths[1]!r} is data.path's {paths[1]!r} (the same file)" in message
    assert "point data.eval_path at files outside data.path" in message
    assert not os.path.exists(tmp_path / "cache" / "checked")  # refused from the listings: no file was read


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_one_file_reached_by_a_link_is_refused_in_data_path_and_as_held_out(tmp_path, link):
    paths = corpus(tmp_path / "corpus")
    link(paths[0], tmp_path / "corpus" / "part-9.parquet")  # the directory now reaches part-0 twice
    message = refusal(config(tmp_path))
    assert "reaches one file by two paths" in message and "twice an epoch" in message
    assert repr(paths[0]) in message and repr(str(tmp_path / "corpus" / "part-9.parquet")) in message
    os.remove(tmp_path / "corpus" / "part-9.parquet")
    link(paths[1], tmp_path / "held.parquet")
    message = refusal(config(tmp_path, f"data.eval_path={tmp_path / 'held.parquet'}"))
    assert f"is data.path's {paths[1]!r} (the same file)" in message


def test_a_held_out_copy_of_a_training_file_is_refused(tmp_path):
    paths = corpus(tmp_path / "corpus")
    shutil.copy(paths[0], tmp_path / "held.parquet")
    message = refusal(config(tmp_path, f"data.eval_path={tmp_path / 'held.parquet'}"))
    assert f"has the content of data.path's {paths[0]!r} (a copy" in message
    write_windows(tmp_path / "held.parquet", 10, seed=7)  # other rows of the same size: held out as they should be
    assert prepare(config(tmp_path, f"data.eval_path={tmp_path / 'held.parquet'}")).held_out == 10


# --- only regular files --------------------------------------------------------------------------------


def _prepare_within(cfg, fifo: str, seconds: float) -> BaseException:
    """What prepare raises, run in a thread; fails the test when it is still running after ``seconds`` (it
    waits in open() for a writer), after unblocking it by opening the FIFO for writing."""
    raised: list = []
    worker = threading.Thread(target=lambda: raised.append(_raised(lambda: prepare(cfg))), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees an empty file and returns
        worker.join(30)
        pytest.fail(f"prepare still ran after {seconds} s: it opened the FIFO {fifo}")
    return raised[0]


def _raised(call) -> BaseException:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 -- returned for the test to inspect
        return e
    return AssertionError("prepare accepted a FIFO")


@pytest.mark.parametrize("where", ["data.path", "inside data.path", "data.eval_path"])
def test_a_fifo_is_refused_by_name_within_seconds(tmp_path, where):
    corpus(tmp_path / "corpus")
    fifo = str(tmp_path / ("corpus" if where == "inside data.path" else "") / "pipe.parquet")
    os.mkfifo(fifo)
    overrides = {"data.path": [f"data.path={fifo}"], "inside data.path": [],
                 "data.eval_path": [f"data.eval_path={fifo}"]}[where]
    t0 = time.monotonic()
    error = _prepare_within(config(tmp_path, *overrides), fifo, seconds=20)
    assert time.monotonic() - t0 < 20
    assert isinstance(error, ValueError), repr(error)
    assert f"{fifo!r} is a FIFO (named pipe), not a regular file" in str(error)
    assert ("data.eval_path" if where == "data.eval_path" else "data.path") in str(error)


# --- the decode cache follows the content -----------------------------------------------------------------


def test_a_same_size_rewrite_with_the_old_mtime_gets_a_new_decode_cache(tmp_path):
    path, cache = write_windows(tmp_path / "w.parquet", 12, seed=1), str(tmp_path / "cache")
    old = data.TokenDataset(path, "tokens", SEQ_LEN, cache_dir=cache).batch([0, 11])
    before = os.stat(path)
    write_windows(path, 12, seed=2)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # what the old key saw
    cached = data.TokenDataset(path, "tokens", SEQ_LEN, cache_dir=cache).batch([0, 11])
    direct = data.TokenDataset(path, "tokens", SEQ_LEN).batch([0, 11])  # decoded in this process, no cache
    assert all(torch.equal(c, d) for c, d in zip(cached, direct))
    assert not torch.equal(cached[0], old[0])
    assert len([n for n in os.listdir(os.path.join(cache, "decoded")) if n.endswith(".npy")]) == 2


def test_a_fingerprint_ignores_the_mtime_and_sees_a_rewrite_of_either_end_of_a_large_file(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "EDGE_BYTES", 64)  # a "large" file: its middle is not hashed
    path = tmp_path / "rows.jsonl"
    body = bytearray(b"x" * 1000)
    path.write_bytes(body)
    first = identity.fingerprint(str(path))
    os.utime(path, (1, 1))
    assert identity.fingerprint(str(path)) == first
    for at, caught in ((10, True), (990, True), (500, False)):  # a change in the middle is what it misses
        changed = bytearray(body)
        changed[at] = ord("y")
        path.write_bytes(changed)
        assert (identity.fingerprint(str(path)) != first) is caught, at
