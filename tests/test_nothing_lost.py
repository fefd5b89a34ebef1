"""Nothing committed is lost: non-finite steps, immutable checkpoints, one run per checkpoint
directory, saves that lose a worker, a checkpoint.dir checked before training, worker errors."""

import json
import re
import os
import subprocess
import sys
import time

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.api import prepare
from raytrain.control.coordinator import CapacityLost, NonFiniteLoss, StepFailed
from raytrain.driver.lease import EXPIRY_S, LEASE_FILE, DirectoryBusy, Lease, read_holder
from tests.helpers import assert_replicas_identical, assert_same_params, reference_state, stage_worker_pids
def _metric_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _publish(base, step, finite=True):
    d = checkpoint.new_step_dir(base, step)
    entry = checkpoint.save_shard(d, 0, {"model": {"0.w": torch.full((2,), float(step))}, "optim": {}})
    checkpoint.publish(d, {"step": step, "finite": finite, "shards": [entry]})
    return d


# --- 1. a non-finite loss is never committed --------------------------------------------------


def test_nonfinite_steps_are_skipped_then_the_run_stops_naming_the_last_good_checkpoint(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "train.steps=6", "checkpoint.every=2", "train.lr=1e6",
                      "train.skip_nonfinite=2", "run.record_samples=true")
    with pytest.raises(NonFiniteLoss) as err:
        train(cfg)
    run_dir = os.path.join(cfg.run.dir, os.listdir(cfg.run.dir)[0])
    rows = _metric_rows(run_dir)
    steps = [r for r in rows if "step" in r and "event" not in r]
    # step 1 trains (finite); steps 2 and 3 are skipped; step 4 is the third non-finite one: stop
    assert [r["step"] for r in steps] == [1, 2, 3] and [bool(r.get("skipped")) for r in steps] == [False, True, True]
    assert all(len(r["sample_ids"]) == 8 for r in steps)
    # the workers saved the three committed steps (two of them skipped) before stopping, beside step 2's save
    good = os.path.join(run_dir, "checkpoints", "step_00000003")
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step_00000002"))
    assert "step 4" in str(err.value) and good in str(err.value) and "train.skip_nonfinite" in str(err.value)
    assert [r["event"] for r in rows if "event" in r][-1] == "failed"  # the rows up to the failure are kept
    # the checkpoint holds step 1's finite parameters: nothing of a skipped step was applied
    params = checkpoint.load_state_dict(good)
    assert all(torch.isfinite(t).all() for t in params.values())
    assert_same_params(params, reference_state(cfg, steps=1))
    assert checkpoint.read_manifest(good)["finite"] is True


def test_cli_exits_5_on_a_nonfinite_loss(ray_session, make_config, tmp_path, capsys, data_cache):
    from raytrain.cli import main

    code = main(["train", "--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.n_head=2",
                 "--set", "model.seq_len=8", "--set", "train.steps=4", "--set", "train.lr=1e6",
                 "--set", f"data.cache_dir={data_cache}", "--set", "data.max_bytes=100000",
                 "--set", f"run.dir={tmp_path}", "--set", "run.trace_steps=0"])
    assert code == 5
    err = capsys.readouterr().err
    assert re.search(r"^raytrain: non-finite loss: step \d+: the loss \(nan\)", err, re.M), err
    assert "Traceback" not in err and err.count("not finite") == 1


def test_pruning_never_removes_the_newest_finite_checkpoint(tmp_path):
    base = str(tmp_path)
    _publish(base, 2)
    _publish(base, 4, finite=False)
    _publish(base, 6, finite=False)
    checkpoint.prune(base, keep=2, lineage=None)
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [2, 4, 6]
    _publish(base, 8)
    checkpoint.prune(base, keep=2, lineage=None)
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [6, 8]


# --- 2. a published checkpoint is immutable ---------------------------------------------------


def test_a_second_save_of_a_step_gets_a_new_directory_and_latest_is_the_last_published(tmp_path):
    base = str(tmp_path)
    first = _publish(base, 4)
    os.makedirs(os.path.join(base, "step_00000004.1"))  # a save of step 4 that died before publishing
    again = _publish(base, 4)
    assert first.endswith("step_00000004") and again.endswith("step_00000004.2")
    assert checkpoint.latest(base) == again
    _publish(base, 6)
    older = _publish(base, 2)  # a run resumed from an older step publishes last: it is the latest
    assert checkpoint.latest(base) == older
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [4, 4, 6, 2]
    checkpoint.prune(base, keep=2, lineage=None)
    assert sorted(os.listdir(base)) == ["step_00000002", "step_00000006"]  # the unpublished leftover is gone


def test_resumed_run_with_a_torn_save_never_touches_the_published_checkpoint(ray_session, make_config, tmp_path):
    ckpt = str(tmp_path / "ckpts")
    first = train(make_config("parallel.dp=2", "train.steps=4", "checkpoint.every=2", f"checkpoint.dir={ckpt}"))
    published = checkpoint.step_dir(ckpt, 4)
    before = {name: open(os.path.join(published, name), "rb").read() for name in os.listdir(published)}
    # resume from step 2 into the same directory; replica 0 dies half-way through writing step 4's shard
    resumed = train(make_config("parallel.dp=2", "train.steps=4", "checkpoint.every=2", f"checkpoint.dir={ckpt}",
                                f"checkpoint.resume={checkpoint.step_dir(ckpt, 2)}", "checkpoint.keep=5",
                                "elastic.faults=['0:0@4:checkpoint']", "run.record_samples=true"))
    assert resumed.failures == 1
    assert_replicas_identical(resumed, replicas=2)
    after = {name: open(os.path.join(published, name), "rb").read() for name in os.listdir(published)}
    assert after == before, "the published step_00000004 was modified"
    assert checkpoint.latest(ckpt) == resumed.checkpoint and resumed.checkpoint.endswith("step_00000004.2")
    for _, uri in checkpoint.list_checkpoints(ckpt):
        checkpoint.load_shards(uri)  # every published checkpoint loads
    assert_same_params(checkpoint.load_state_dict(resumed.checkpoint), checkpoint.load_state_dict(first.checkpoint))


# --- 3. one run per checkpoint directory ------------------------------------------------------


def test_lease_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    base = str(tmp_path / "ckpts")
    os.makedirs(base)
    first = Lease(base, "/runs/first").acquire()
    with pytest.raises(DirectoryBusy, match=f"checkpoint.dir={base} is in use .*pid {os.getpid()}.*/runs/first"):
        Lease(base, "/runs/second").acquire()
    first.release()
    assert not os.path.exists(os.path.join(base, LEASE_FILE))
    # a holder on this host whose process is gone (a SIGKILLed driver) is stale at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(base, LEASE_FILE), "w") as f:
        json.dump({"token": "x", "host": os.uname().nodename, "pid": dead.pid, "heartbeat": time.time()}, f)
    second = Lease(base, "/runs/second").acquire()
    assert read_holder(os.path.join(base, LEASE_FILE))["run_dir"] == "/runs/second"
    second.release()
    # a holder elsewhere whose heartbeat expired is stale; one that beat recently is not
    for age, busy in ((EXPIRY_S + 5, False), (1.0, True)):
        with open(os.path.join(base, LEASE_FILE), "w") as f:
            json.dump({"token": "y", "host": "another-host", "pid": 1, "heartbeat": time.time() - age}, f)
        if busy:
            with pytest.raises(DirectoryBusy, match="another-host"):
                Lease(base, "/runs/third").acquire()
        else:
            Lease(base, "/runs/third").acquire().release()


def test_a_second_run_on_a_held_directory_is_refused_before_any_actor(ray_session, make_config, tmp_path):
    ckpt = str(tmp_path / "ckpts")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.makedirs(ckpt)
        with open(os.path.join(ckpt, LEASE_FILE), "w") as f:
            json.dump({"token": "z", "host": os.uname().nodename, "pid": holder.pid, "run_dir": "/runs/other",
                       "heartbeat": time.time()}, f)
        workers = stage_worker_pids()
        with pytest.raises(ValueError, match=f"checkpoint.dir={ckpt} is in use by another run .*pid {holder.pid}"):
            train(make_config(f"checkpoint.dir={ckpt}"))
        assert stage_worker_pids() == workers
    finally:
        holder.kill()
        holder.wait()


# --- 4. max_failures=0, and a save that loses a stage's last copy -----------------------------


def test_a_dp1_save_failure_reloads(ray_session, make_config):
    cfg = make_config("train.steps=6", "checkpoint.every=2", "checkpoint.keep=5", "elastic.faults=['0:0@4:checkpoint']")
    result = train(cfg)
    reload = [e for e in result.events if e["event"] == "reload"]
    assert result.failures == 1 and len(reload) == 1 and reload[0]["step"] == 2
    assert result.committed_steps == list(range(6))
    assert [s for s, _ in checkpoint.list_checkpoints(os.path.dirname(result.checkpoint))] == [2, 4, 6]
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_max_failures_0_still_writes_checkpoints_and_a_run_that_gives_up_saves_the_survivors_committed_steps(
        ray_session, make_config):
    """elastic.max_failures=0 turns no checkpoint off: step 2's is published. No checkpoint is due after
    step 3, which the surviving replica holds: it is saved before the run ends, not dropped."""
    cfg = make_config("parallel.dp=2", "train.steps=6", "checkpoint.every=2", "elastic.max_failures=0",
                      "elastic.faults=['1:0@3:backward']")
    with pytest.raises(CapacityLost, match="the survivors saved every committed step to .*step_00000003"):
        train(cfg)
    base = os.path.join(str(cfg.run.dir), os.listdir(cfg.run.dir)[0], "checkpoints")
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [2, 3]
    saved = checkpoint.latest(base)
    assert checkpoint.read_manifest(saved)["step"] == 3
    assert_same_params(checkpoint.load_state_dict(saved), reference_state(cfg, steps=3))


# --- 5. checkpoint.dir is checked before training ---------------------------------------------


@pytest.mark.parametrize("where", ["nosuchscheme://bucket/run", "{tmp}/a-file/checkpoints"])
def test_unusable_checkpoint_dir_fails_in_prepare(make_config, tmp_path, where):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match="checkpoint.dir=.*cannot write checkpoints"):
        prepare(make_config(f"checkpoint.dir={where.format(tmp=tmp_path)}"))


# --- 10. a worker's own error is a StepFailed, surfaced once ----------------------------------


@pytest.mark.parametrize("factory, message", [
    ("forward_raises", "boom in forward"),
    ("raises_in_workers", "failed to start: ValueError: boom while building the model in a worker"),
])
def test_a_worker_error_is_a_step_failed_with_its_message_not_a_lost_coordinator(ray_session, make_config, factory,
                                                                                   message):
    cfg = make_config(f"model.factory=tests.factories:{factory}", "train.steps=3")
    started = time.monotonic()
    with pytest.raises(StepFailed, match=message):
        train(cfg)
    assert time.monotonic() - started < 60
    run_dir = os.path.join(cfg.run.dir, os.listdir(cfg.run.dir)[0])
    events = [r["event"] for r in _metric_rows(run_dir) if "event" in r]
    assert "coordinator_restarted" not in events and events[-1] == "failed"
