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
    checkpoint.prune(base, keep=2, lineage=None)
    assert [s for s, _ in checkpoint.list_checkpoints(base)] == [3, 4]


def test_resume_from_missing_checkpoint_fails_before_any_actor(make_config, tmp_path):
    from raytrain.api import prepare

    with pytest.raises(ValueError, match="checkpoint.resume.*no published checkpoint"):
        prepare(make_config(f"checkpoint.resume={tmp_path / 'nothing'}"))


def test_row_pieces_must_tile_the_rows_and_match_the_models_size():
    import torch

    from raytrain.checkpoint import Assembler, CheckpointError, new_tensors

    def shard(rows, start, stop, total):
        return {"model": {"w": rows}, "optim": {}, "rows": {"w": (start, stop, total)}}

    full = torch.arange(6.0)
    into = torch.zeros(4)
    ok = Assembler({"w": (1, 5, 6)}, lambda name, key, shape, dtype: into)
    for start, stop in ((0, 3), (3, 6)):
        ok.add(shard(full[start:stop], start, stop, 6))
    ok.check("ckpt")
    assert torch.equal(into, full[1:5])
    twice = Assembler(None, new_tensors())
    for _ in range(2):
        twice.add(shard(full[0:3], 0, 3, 6))
    with pytest.raises(CheckpointError, match="do not cover"):
        twice.check("ckpt")
    with pytest.raises(CheckpointError, match="6 rows in the checkpoint and 4 in this model"):
        Assembler({"w": (0, 2, 4)}, new_tensors()).add(shard(full[0:3], 0, 3, 6))


def test_column_slices_assemble_into_whole_tensors_and_into_row_slices():
    """A tensor-parallel shard holds a box of each tensor (``slices``: [start, stop, total] per dim); any
    reader, whole or row-sliced, gets exactly its part of the whole."""
    import torch

    from raytrain.checkpoint import Assembler, CheckpointError, new_tensors

    full = torch.arange(24.0).reshape(4, 6)
    exp_avg = full * 10

    def column_shard(lo, hi):
        return {"model": {"w": full[:, lo:hi].clone()},
                "optim": {"w": {"exp_avg": exp_avg[:, lo:hi].clone(), "step": torch.tensor(3.0)}},
                "slices": {"w": [[0, 4, 4], [lo, hi, 6]]}}

    whole = Assembler(None, new_tensors())
    for lo, hi in ((0, 2), (2, 6)):
        whole.add(column_shard(lo, hi))
    whole.check("ckpt")
    state = whole.tensors()
    assert torch.equal(state["model"]["w"], full)
    assert torch.equal(state["optim"]["w"]["exp_avg"], exp_avg)
    assert float(state["optim"]["w"]["step"]) == 3.0
    rows = Assembler({"w": (1, 3, 4)}, new_tensors())
    for lo, hi in ((0, 2), (2, 6)):
        rows.add(column_shard(lo, hi))
    rows.check("ckpt")
    assert torch.equal(rows.tensors()["model"]["w"], full[1:3])
    missing = Assembler(None, new_tensors())
    missing.add(column_shard(0, 2))
    with pytest.raises(CheckpointError, match=r"do not cover \[0, 4\), \[0, 6\)"):
        missing.check("ckpt")


def test_stacked_boxes_of_a_fused_weight_reassemble_and_load_into_any_readers_boxes():
    """A tp rank's part of a fused colwise weight (q, k, v in one) is several boxes stacked along dim 0
    (``slices``: a list of boxes); the pieces of two ranks tile the whole for a plain reader, a reader of
    rows gets its rows, and a tp reader of another cut (or the same) gets exactly its own boxes."""
    import torch

    from raytrain.checkpoint import Assembler, Boxes, CheckpointError, new_tensors, slice_boxes, slices_entry

    full = torch.arange(48.0).reshape(12, 4)  # three parts of 4 rows each

    def boxes(rank, tp):
        width = 4 // tp
        return [((p * 4 + rank * width, p * 4 + (rank + 1) * width), (0, 4)) for p in range(3)]

    def tp_shard(rank):
        mine = boxes(rank, 2)
        local = torch.cat([full[a:b] for (a, b), _ in mine])
        return {"model": {"w": local}, "optim": {"w": {"exp_avg": local * 10, "step": torch.tensor(2.0)}},
                "slices": {"w": slices_entry(mine, (12, 4))}}

    assert slice_boxes(slices_entry(boxes(1, 2), (12, 4))) == Boxes(tuple(boxes(1, 2)), (12, 4))
    readers = {"whole": (None, full), "rows": ((3, 9, 12), full[3:9]),
               "tp4": (Boxes(tuple(boxes(3, 4)), (12, 4)), full[[3, 7, 11]]),
               "tp2": (Boxes(tuple(boxes(0, 2)), (12, 4)), full[[0, 1, 4, 5, 8, 9]])}
    for name, (wanted, expected) in readers.items():
        pieces = Assembler(None if wanted is None else {"w": wanted}, new_tensors())
        for rank in (0, 1):
            pieces.add(tp_shard(rank))
        pieces.check("ckpt")
        state = pieces.tensors()
        assert torch.equal(state["model"]["w"], expected), name
        assert torch.equal(state["optim"]["w"]["exp_avg"], expected * 10) and float(state["optim"]["w"]["step"]) == 2.0
    half = Assembler(None, new_tensors())
    half.add(tp_shard(0))
    with pytest.raises(CheckpointError, match="do not cover"):
        half.check("ckpt")
    damaged = {**tp_shard(0), "slices": {"w": slices_entry(boxes(0, 4), (12, 4))}}  # boxes of 3 rows, a piece of 6
    with pytest.raises(CheckpointError, match="the shard is damaged"):
        Assembler(None, new_tensors()).add(damaged)
    other = Assembler({"w": Boxes(tuple(boxes(0, 2)), (12, 8))}, new_tensors())
    with pytest.raises(CheckpointError, match="another model config"):
        other.add(tp_shard(0))


def test_boxes_of_a_mixtures_packed_experts_stack_along_dim_1_and_load_into_any_readers_boxes():
    """A tp rank's part of an (experts, gate + up, in) weight is its gate and its up features of every
    expert: two boxes that differ in dim 1, stacked along it; an fsdp shard of that part holds some
    experts (dim 0) of both boxes."""
    import torch

    from raytrain.checkpoint import Assembler, Boxes, new_tensors, slices_entry
    from raytrain.models.tensor_plan import EXPERT_COLWISE, local_boxes, rows_of_stack
    from raytrain.worker.tensor_parallel import local_part

    full = torch.arange(48.0).reshape(2, 8, 3)  # 2 experts, gate and up of 4 features each, 3 inputs
    plan = {"experts.gate_up_proj": (EXPERT_COLWISE, 2)}

    def mine(rank):
        return local_boxes(plan, "experts.gate_up_proj", (2, 8, 3), 2, rank)

    assert mine(1) == [((0, 2), (2, 4), (0, 3)), ((0, 2), (6, 8), (0, 3))]
    assert torch.equal(local_part(full, mine(1)), full[:, [2, 3, 6, 7]])
    assert rows_of_stack(mine(1), 1, 2) == [((1, 2), (2, 4), (0, 3)), ((1, 2), (6, 8), (0, 3))]
    assert rows_of_stack(mine(1), 2, 2) == [((2, 2), (2, 4), (0, 3)), ((2, 2), (6, 8), (0, 3))]  # owns none
    shards = []
    for rank in (0, 1):
        for expert in (0, 1):  # fsdp=2 over each tp part: one expert each
            boxes = rows_of_stack(mine(rank), expert, expert + 1)
            local = local_part(full, mine(rank))[expert:expert + 1]
            shards.append({"model": {"w": local}, "optim": {}, "slices": {"w": slices_entry(boxes, (2, 8, 3))}})
    readers = {"whole": (None, full), "rows": ((1, 2, 2), full[1:2]),
               "tp2": (Boxes(tuple(mine(0)), (2, 8, 3)), full[:, [0, 1, 4, 5]])}
    for name, (wanted, expected) in readers.items():
        pieces = Assembler(None if wanted is None else {"w": wanted}, new_tensors())
        for shard in shards:
            pieces.add(shard)
        pieces.check("ckpt")
        assert torch.equal(pieces.tensors()["model"]["w"], expected), name


def test_a_save_and_a_load_hold_at_most_one_tensor_beyond_the_workers_state(tmp_path):
    """The bound on a save's and a load's memory: a save streams the live tensors (no snapshot of the state) and a load copies the
    memory-mapped pieces straight into the parameters and moments, whole or by rows, from a local disk or
    an object store (staged to a local file as it is hashed)."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "peak_save_load.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    bound = got["largest_tensor_bytes"] + SLACK_BYTES
    assert got["state_bytes"] > 5 * bound, got  # a copy of the state could not hide under the bound
    for what in ("save_extra", "load_extra", "load_rows_extra", "load_object_store_extra"):
        assert got[what] <= bound, (what, got)


SLACK_BYTES = 4 << 20
"""Beyond the largest tensor: the pickle, the zip writer's buffers, malloc's arenas (measured: under 0.1 MB)."""


def test_a_background_save_publishes_the_bytes_of_a_synchronous_one_and_a_kill_mid_write_publishes_nothing(
        ray_session, make_config, tmp_path):
    """checkpoint.async_save: step 2's shards, written while step 3 ran, are byte for byte the synchronous
    save's; replica 0's saver is killed half-way through writing step 4's shard in the background, so step 4
    is never published (step 2 stays the latest), the run repairs and ends at the synchronous run's parameters."""
    common = ("parallel.dp=2", "train.steps=6", "checkpoint.every=2")
    sync = train(make_config(*common, f"checkpoint.dir={tmp_path / 'sync'}"))
    background = train(make_config(*common, f"checkpoint.dir={tmp_path / 'async'}", "checkpoint.async_save=true",
                                   "elastic.faults=['0:0@4:checkpoint']"))
    saves = [(e["step"], e["async"]) for e in background.events if e["event"] == "checkpoint"]
    assert saves == [(2, True), (6, False)]
    abandoned = [e for e in background.events if e["event"] == "checkpoint_abandoned"]
    assert [(e["step"], e["latest"]) for e in abandoned] == [(4, checkpoint.step_dir(str(tmp_path / "async"), 2))]
    assert not os.path.exists(os.path.join(checkpoint.step_dir(str(tmp_path / "async"), 4), checkpoint.MANIFEST))
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "async"))] == [2, 6]
    assert background.failures == 1

    def shards(base, step):
        return checkpoint.read_manifest(checkpoint.step_dir(str(base), step))["shards"]

    assert shards(tmp_path / "async", 2) == shards(tmp_path / "sync", 2)  # names, sizes and sha256 alike
    assert_same_params(checkpoint.load_state_dict(background.checkpoint), checkpoint.load_state_dict(sync.checkpoint))
