"""The run's data by identity: held-out files are never training files (by path, link or content), one file
is never trained twice an epoch through a link, only regular files are read, the decode cache follows a
file's content, and a checkpoint records its training data so that a resume whose data changed is refused
by name, or starts a new epoch over the new data that sees each sample once. All before any actor starts."""

import dataclasses
import os
import shutil
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain import checkpoint, data, train
from raytrain.config import load_config
from raytrain.config.mesh import Mesh
from raytrain.control.crew import Reservation
from raytrain.control.coordinator import Coordinator
from raytrain.control.saving import save_checkpoint
from raytrain.data import identity, order, shards
from raytrain.driver.prepare import prepare
from raytrain.reports import ShardReport
from tests.helpers import FakeWorkerGroup, fake_config, fake_prepared

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


def save_as_the_coordinator_does(plan, step: int) -> str:
    """A checkpoint of ``plan``'s run at ``step``, published by control.saving with the run's data record."""
    class OneSaver:  # the worker group's save, in this process
        def save(self, members, ckpt_dir):
            shard = {"model": {"0.w": torch.ones(4)}, "optim": {}}
            return [ShardReport(checkpoint.save_shard(ckpt_dir, 0, shard), finite=True)]

    return save_checkpoint(OneSaver(), [None], step, plan.cfg, Mesh(), [[[0]]], plan.data_identity)


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


# --- a checkpoint records its data; a resume compares -----------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_the_coordinator_records_the_runs_data_in_every_manifest(tmp_path, async_save):
    cfg = fake_config(tmp_path, "parallel.dp=2", "checkpoint.every=3", f"checkpoint.async_save={async_save}".lower())
    record = {"num_samples": 1000, "files": [{"path": "a.parquet", "bytes": 10, "samples": 1000, "fingerprint": "f"}]}
    prepared = dataclasses.replace(fake_prepared(cfg), data_identity=record)
    Coordinator(prepared, Reservation(None, 0, ()), worker_group=FakeWorkerGroup(1, initial=2)).run(store=None)
    saved = checkpoint.list_checkpoints(cfg.checkpoint.dir)
    assert [s for s, _ in saved] == [3, 6]
    assert all(checkpoint.read_manifest(d)["data"] == record for _, d in saved)


def _change(where, case: str) -> str:
    """Change the corpus under ``where`` as ``case`` says; the file it names."""
    path = os.path.join(where, "part-2.parquet" if case == "added" else "part-1.parquet")
    if case == "removed":
        os.remove(path)
    elif case == "resized":
        write_windows(path, 13, seed=1)
    else:  # added, or rewritten: the same size and modification time, other rows
        mtime = None if case == "added" else os.stat(path).st_mtime_ns
        write_windows(path, 10, seed=5)
        if mtime is not None:
            os.utime(path, ns=(mtime, mtime))
    return path


@pytest.mark.parametrize("case, said", [("added", "was added"), ("removed", "was removed"),
                                        ("resized", "was resized"), ("rewritten", "was rewritten (the same size")])
def test_a_resume_whose_data_changed_is_refused_naming_the_file(tmp_path, case, said):
    corpus(tmp_path / "corpus")
    ckpt = save_as_the_coordinator_does(prepare(config(tmp_path)), step=3)
    path = _change(tmp_path / "corpus", case)
    message = refusal(config(tmp_path, f"checkpoint.resume={ckpt}"))
    assert f"{path!r} {said}" in message, message
    assert message.startswith(f"checkpoint.resume='{ckpt}'") and "the training data changed" in message
    assert "restore the data, or set data.new_epoch_on_change=true to train on the new data from step 3" in message


def test_with_new_epoch_on_change_the_resume_restarts_the_order_and_later_resumes_keep_it(tmp_path):
    corpus(tmp_path / "corpus")  # 20 samples: step 3 of batch 4 is in epoch 0
    ckpt = save_as_the_coordinator_does(prepare(config(tmp_path)), step=3)
    _change(tmp_path / "corpus", "added")
    resumed = prepare(config(tmp_path, f"checkpoint.resume={ckpt}", "data.new_epoch_on_change=true"))
    assert resumed.num_samples == 30 and resumed.cfg.data.order_origin == [3 * B, 1]
    later = save_as_the_coordinator_does(resumed, step=5)
    assert checkpoint.read_manifest(later)["data"]["num_samples"] == 30
    again = prepare(config(tmp_path, f"checkpoint.resume={later}"))  # the same data: its origin goes on
    assert again.cfg.data.order_origin == [3 * B, 1]
    fresh = prepare(config(tmp_path, "data.order_origin=[7, 7]", f"checkpoint.dir={tmp_path / 'other'}"))
    assert fresh.cfg.data.order_origin == [0, 0]  # raytrain sets it: a fresh run's order starts at 0


def test_a_checkpoint_without_a_data_record_or_of_moved_files_resumes_as_before(tmp_path):
    paths = corpus(tmp_path / "corpus")
    plan = prepare(config(tmp_path))
    legacy = save_as_the_coordinator_does(dataclasses.replace(plan, data_identity=None), step=3)
    assert "data" not in checkpoint.read_manifest(legacy)
    _change(tmp_path / "corpus", "added")
    assert prepare(config(tmp_path, f"checkpoint.resume={legacy}")).cfg.data.order_origin == [0, 0]
    os.remove(tmp_path / "corpus" / "part-2.parquet")
    recorded = save_as_the_coordinator_does(plan, step=4)
    shutil.move(tmp_path / "corpus", tmp_path / "moved")  # the same files elsewhere are the same data
    moved = prepare(config(tmp_path, f"data.path={tmp_path / 'moved'}", f"checkpoint.resume={recorded}"))
    assert moved.cfg.data.order_origin == [0, 0] and moved.source.train.paths != tuple(paths)


def test_a_change_of_the_held_out_share_or_of_the_kind_of_data_is_a_change_of_the_numbering():
    files = [{"path": "a", "bytes": 9, "samples": 100, "fingerprint": f"{identity.SCHEME}:1"}]
    then, now = {"num_samples": 100, "files": files}, {"num_samples": 90, "files": files}
    assert identity.change(then, now) == ("the checkpoint's run trained on 100 samples, this one on 90 "
                                          "(data.eval_fraction holds out the rest)")
    older_scheme = {"num_samples": 100, "files": [{**files[0], "fingerprint": "other-v0:2"}]}
    assert identity.change(older_scheme, then) is None  # another scheme's digest: only sizes and counts compared
    objects = {"num_samples": 50, "objects": "torch Dataset", "samples": 50}
    assert identity.change(objects, {**objects, "samples": 60, "num_samples": 60}) == (
        "the dataset holds 60 samples, the checkpoint's held 50")
    assert identity.change(then, objects) == "the checkpoint's run trained on files, this one on a torch Dataset"


# --- the order after a restart -------------------------------------------------------------------------------


def test_a_restarted_order_sees_each_new_sample_once_in_its_first_epoch():
    seed, old, new, step = 3, 800, 960, 37  # 800 samples, then 160 added; resumed at step 37 of batch 16
    seen_before = order.sample_ids(seed, old, 0, step * 16)
    start = step * 16
    origin = (start, order.next_epoch(order.NO_RESTART, old, start))
    assert origin == (592, 1)
    restarted = order.sample_ids(seed, new, start, start + new, origin)
    assert sorted(restarted) == list(range(new))  # every sample of the new data exactly once
    assert order.sample_ids(seed, new, start + new, start + 2 * new, origin) != restarted  # the next epoch reshuffles
    assert set(order.position_epochs(new, start, start + new + 1, origin)) == {1, 2}
    continued = order.sample_ids(seed, new, start, new)  # going on with epoch 0 over the new data instead
    assert set(continued) & set(seen_before)  # repeats samples already seen this epoch: what the restart avoids
    assert order.next_epoch((592, 1), 960, 592 + 960) == 2 and order.next_epoch((592, 1), 960, 600) == 2


# --- end to end ---------------------------------------------------------------------------------------------


def test_a_resume_over_added_files_trains_each_sample_once_in_its_new_epoch(ray_session, tmp_path):
    """A real run's checkpoint records its files; after a file is added, a resume is refused, and with
    data.new_epoch_on_change the workers read a new epoch from the resumed step: every sample of the new data
    once, the new file's included."""
    corpus(tmp_path / "corpus")  # 20 samples, 5 steps an epoch
    common = ["train.steps=3", "checkpoint.every=3", "run.record_samples=true", "parallel.dp=2",
              "resources.placement_wait_s=20", "resources.step_timeout_s=60", "run.trace_steps=0"]
    first = train(config(tmp_path, *common))
    assert [f["samples"] for f in checkpoint.read_manifest(first.checkpoint)["data"]["files"]] == [10, 10]
    added = _change(tmp_path / "corpus", "added")
    resume = [f"checkpoint.resume={first.checkpoint}", "train.steps=10"]
    assert repr(added) in refusal(config(tmp_path, *common, *resume))
    second = train(config(tmp_path, *common, *resume, "data.new_epoch_on_change=true"))
    seen = [i for row in second.metrics if "sample_ids" in row for i in row["sample_ids"]]
    assert len(seen) == 7 * B and len(set(seen)) == len(seen)  # steps 3..9: 28 of the new epoch's 30, none twice
    assert set(seen) <= set(range(30)) and any(i >= 20 for i in seen)
    assert seen == order.sample_ids(config(tmp_path).train.seed, 30, 3 * B, 10 * B, (3 * B, 1))
