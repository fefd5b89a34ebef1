"""Checkpoints: atomic, layout-independent, and a resume continues the exact trajectory."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.models.layers import full_model
from tests.helpers import assert_same_params, reference_state
def test_resume_continues_the_same_trajectory(ray_session, make_config, dp2_run):
    straight = train(make_config("parallel.dp=2", "train.steps=10", "run.record_samples=true"))
    _, first = dp2_run  # the same config for 5 steps (resume=latest of a checkpoint.dir: tests/test_recipe.py)
    assert first.checkpoint.endswith("step_00000005")
    resumed = train(make_config("parallel.dp=2", "train.steps=10", f"checkpoint.resume={first.checkpoint}",
                                "run.record_samples=true"))
    assert [r["step"] for r in resumed.metrics] == [6, 7, 8, 9, 10]
    assert [r["sample_ids"] for r in resumed.metrics] == [r["sample_ids"] for r in straight.metrics[5:]]
    assert [r["loss"] for r in resumed.metrics] == pytest.approx([r["loss"] for r in straight.metrics[5:]], rel=1e-6)
    assert_same_params(checkpoint.load_state_dict(resumed.checkpoint),
                       checkpoint.load_state_dict(straight.checkpoint), rtol=1e-6)
    # optimizer state travels too: AdamW step counts are 10 after the resumed run
    optim = checkpoint.merged_state(resumed.checkpoint)["optim"]
    assert all(float(st["step"]) == 10 for st in optim.values())


def test_resume_latest_finds_the_last_run_and_traces_its_own_first_steps(ray_session, make_config):
    first = train(make_config("train.steps=3"))  # default checkpoint.dir: <run dir>/checkpoints
    resumed = train(make_config("train.steps=5", "checkpoint.resume=latest", "run.trace_steps=2"))
    assert resumed.run_dir != first.run_dir
    assert next(e for e in resumed.events if e["event"] == "resumed")["from"] == first.checkpoint
    assert [r["step"] for r in resumed.metrics] == [4, 5]
    for picture in ("trace.json", "timeline.png", "loss.png"):
        assert os.path.getsize(os.path.join(resumed.run_dir, picture)) > 0, picture


def test_dp2_checkpoint_loads_into_a_single_process(dp2_run):
    cfg, result = dp2_run
    model = full_model(cfg.model, cfg.train.seed)
    model.load_state_dict(checkpoint.load_state_dict(os.path.dirname(result.checkpoint)), strict=True)
    assert_same_params(dict(model.state_dict()), reference_state(cfg))
    logits = model(torch.zeros(1, cfg.model.seq_len, dtype=torch.long))
    assert logits.shape == (1, cfg.model.seq_len, cfg.model.vocab_size)


_WRITER = r"""
import sys, torch
from raytrain import checkpoint
base = sys.argv[1]
d = checkpoint.step_dir(base, 1)
entry = checkpoint.save_shard(d, 0, {"model": {"0.w": torch.ones(3)}, "optim": {}, "rng": torch.get_rng_state()})
checkpoint.publish(d, {"step": 1, "shards": [entry]})
print("published", flush=True)
d = checkpoint.step_dir(base, 2)
big = {"model": {"0.w": torch.zeros(64, 1024, 1024)}, "optim": {}}  # 256 MiB: slow enough to kill mid-write
print("writing", flush=True)
entry = checkpoint.save_shard(d, 0, big)
checkpoint.publish(d, {"step": 2, "shards": [entry]})
print("done", flush=True)
"""


def test_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    base = str(tmp_path / "ckpts")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, base], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published"
        assert proc.stdout.readline().strip() == "writing"
        shard = os.path.join(checkpoint.step_dir(base, 2), "stage-0.pt")
        deadline = time.monotonic() + 60
        while not (os.path.exists(shard) and os.path.getsize(shard) > 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(shard), "the kill should have hit mid-write"
    assert checkpoint.latest(base).endswith("step_00000001")
    assert torch.equal(checkpoint.load_state_dict(base)["0.w"], torch.ones(3))
    with pytest.raises(checkpoint.CheckpointError, match="no published checkpoint"):
        checkpoint.resolve(checkpoint.step_dir(base, 2))


def test_truncated_or_corrupt_shard_is_reported_by_file(tmp_path):
    d = checkpoint.step_dir(str(tmp_path), 3)
    entry = checkpoint.save_shard(d, 0, {"model": {"0.w": torch.ones(1000)}, "optim": {}})
    checkpoint.publish(d, {"step": 3, "shards": [entry]})
    size = entry["bytes"]
    shard = os.path.join(d, "stage-0.pt")
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(checkpoint.CheckpointError, match="stage-0.pt has .* bytes"):
        checkpoint.load_state_dict(d)
    with open(shard, "wb") as f:
        f.write(b"x" * size)
    with pytest.raises(checkpoint.CheckpointError, match="stage-0.pt does not match the sha256"):
        checkpoint.load_state_dict(d)
    os.remove(shard)
    with pytest.raises(checkpoint.CheckpointError, match="stage-0.pt"):
        checkpoint.load_state_dict(d)


def test_pruning_keeps_the_newest(tmp_path):
    base = str(tmp_path)
    for step in (1, 2, 3, 4):
        d = checkpoint.step_dir(base, step)
        checkpoint.publish(d, {"step": step, "shards": [checkpoint.save_shard(d, 0, {"model": {}, "optim": {}})]})
    checkpoint.prune(base, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [3, 4]


def test_resume_from_missing_checkpoint_fails_before_any_actor(make_config, tmp_path):
    from raytrain.api import prepare

    with pytest.raises(ValueError, match="checkpoint.resume.*no published checkpoint"):
        prepare(make_config(f"checkpoint.resume={tmp_path / 'nothing'}"))


def test_row_pieces_must_tile_the_rows_and_match_the_models_size():
    import torch

    from raytrain.checkpoint import CheckpointError, RowAssembler

    def shard(rows, start, stop, total):
        return {"model": {"w": rows}, "optim": {}, "rows": {"w": (start, stop, total)}}

    full = torch.arange(6.0)
    ok = RowAssembler({"w": (1, 5, 6)})
    for start, stop in ((0, 3), (3, 6)):
        ok.add(shard(full[start:stop], start, stop, 6))
    assert torch.equal(ok.result("ckpt")["model"]["w"], full[1:5])
    twice = RowAssembler(None)
    for _ in range(2):
        twice.add(shard(full[0:3], 0, 3, 6))
    with pytest.raises(CheckpointError, match="do not cover"):
        twice.result("ckpt")
    with pytest.raises(CheckpointError, match="6 rows in the checkpoint and 4 in this model"):
        RowAssembler({"w": (0, 2, 4)}).add(shard(full[0:3], 0, 3, 6))
