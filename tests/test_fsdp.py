"""Sharded data parallelism (parallel.fsdp: FSDP2, HSDP with dp > 1): the same math as one process,
checkpoints that any layout loads, and replicas repaired as units."""

import json
import os
import signal
import time

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.testing.reference import train_reference
from raytrain.config.mesh import Mesh
from raytrain.worker.sharded import schedule_has_weight_halves, shard_rows
from tests.forked_stages import run_stages
from tests.helpers import (LONG_RUN_LR, WhenPaused, assert_replicas_identical, assert_same_params, hold_until_a_new_worker_starts,
                           reference_state, stopped)


def test_shard_rows_cut_like_torch_chunk():
    for rows in (1, 5, 8, 30, 96):
        for fsdp in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(fsdp)
            cuts = [shard_rows(rows, fsdp, f) for f in range(fsdp)]
            got = [torch.arange(rows)[a:b] for a, b in cuts]
            want = list(chunks) + [torch.arange(0)] * (fsdp - len(chunks))
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (rows, fsdp, cuts)


@pytest.mark.parametrize("settings, gathered", [
    (("parallel.pp=2", "parallel.split_backward=true"), [False, True]),  # stage 0 sends no input gradient
    (("parallel.pp=2", "parallel.schedule=gpipe", "parallel.split_backward=true"), [False, True]),
    (("parallel.split_backward=true",), [False]),  # no pipeline: whole backwards
    (("parallel.pp=2", "parallel.virtual_stages=2", "parallel.schedule=zbv", "parallel.microbatches=4"), [True, True]),
    (("parallel.pp=2", "parallel.microbatches=4"), [False, False]),
])
def test_sharded_layers_stay_gathered_only_on_workers_whose_plan_splits_a_backward(make_config, settings, gathered):
    cfg = make_config("parallel.fsdp=2", *settings)
    mesh = Mesh(dp=1, fsdp=2, tp=1, pp=cfg.parallel.pp)
    assert [schedule_has_weight_halves(cfg, mesh, mesh.rank(replica=0, shard=0, stage=s, tp=0))
            for s in range(cfg.parallel.pp)] == gathered


def test_fsdp2_pp2_on_actors_matches_single_process(ray_session, make_config):
    # four workers: shard s of stage 0 feeds shard s of stage 1; each shard of each stage saves its rows
    cfg = make_config("parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=2", "train.steps=3",
                      "run.record_samples=true")
    result = train(cfg)
    assert sorted(result.state_digests) == ["0:0:0", "0:0:1", "0:1:0", "0:1:1"]
    files = [s["file"] for s in checkpoint.read_manifest(result.checkpoint)["shards"]]
    assert sorted(files) == [f"stage-{s}-shard-{f}.pt" for s in (0, 1) for f in (0, 1)]
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


@pytest.mark.parametrize("layout", [
    ("parallel.dp=2", "parallel.fsdp=2"),  # HSDP: shard in a replica, all-reduce across replicas
    ("parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=1f1b"),
    ("parallel.fsdp=2", "parallel.microbatches=2", "train.activation_checkpointing=true"),
    ("parallel.fsdp=4", "model.d_model=30", "model.n_head=2"),  # uneven rows: 8, 8, 8, 6
], ids=["dp2-fsdp2", "fsdp2-pp2-1f1b", "fsdp2-m2-recompute", "fsdp4-uneven"])
def test_sharded_layouts_match_single_process(make_config, tmp_path, layout):
    cfg = make_config(*layout, "train.steps=4")
    model, _ = run_stages(cfg, str(tmp_path))
    assert_same_params(model, reference_state(cfg))


@pytest.mark.parametrize("family, tied", [("llama", False), ("gpt2", True)], ids=["llama-by-layer", "gpt2-tied-whole"])
def test_a_hugging_face_model_shards_with_its_buffers(make_config, tmp_path, family, tied):
    # Llama's rotary tables are buffers: not sharded, kept across the meta-device wrapping, and built a
    # layer at a time; a tied GPT-2 stage is built whole (its embedding and head share a parameter)
    pytest.importorskip("transformers")
    from tests.hf_models import assert_same_hf_params, write_hf_model

    path = write_hf_model(tmp_path / family, family, tied=tied)
    cfg = make_config(f"model.hf={path}", "parallel.fsdp=2", "train.steps=3", LONG_RUN_LR)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_hf_params(model, reference_state(cfg))


def test_checkpoint_of_dp2_fsdp2_resumes_in_any_layout(ray_session, make_config, tmp_path):
    ckpt_dir = str(tmp_path / "ckpts")
    first = train(make_config("parallel.dp=2", "parallel.fsdp=2", "train.steps=3", f"checkpoint.dir={ckpt_dir}"))
    want = reference_state(make_config("train.steps=6"))
    # on actors as dp=1 (whole stages load the reassembled rows) ...
    resumed = train(make_config("train.steps=6", f"checkpoint.resume={first.checkpoint}"))
    assert_same_params(checkpoint.load_state_dict(resumed.checkpoint), want)
    # ... in forked stage workers as fsdp=4 and as fsdp=2 x pp=2 (each shard reads its own rows) ...
    for layout in (["parallel.fsdp=4"], ["parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=2"]):
        model, _ = run_stages(make_config(*layout, "train.steps=6", f"checkpoint.resume={first.checkpoint}"),
                              str(tmp_path / "-".join(layout)))
        assert_same_params(model, want)
    # ... and in a plain process
    model, _ = train_reference(make_config("train.steps=6"), resume_from=first.checkpoint)
    assert_same_params(dict(model.state_dict()), want)
    optim = checkpoint.merged_state(first.checkpoint)["optim"]
    assert optim["1.fc.weight"]["exp_avg"].shape == (128, 32) and float(optim["1.fc.weight"]["step"]) == 3


def test_dp2_fsdp2_pp2_shards_resume_in_a_plain_process_and_as_fsdp4(make_config, tmp_path):
    # all three axes at once (eight forked workers), its shard files published as a checkpoint
    first_dir = str(tmp_path / "grid")
    model, _ = run_stages(make_config("parallel.dp=2", "parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=2",
                                      "train.steps=2"), first_dir)
    assert_same_params(model, reference_state(make_config("train.steps=2")))
    ckpt = _publish_forked(first_dir, str(tmp_path / "ckpts"), step=2, files=[(s, f) for s in (0, 1) for f in (0, 1)])
    want = reference_state(make_config("train.steps=4"))
    resumed, _ = run_stages(make_config("parallel.fsdp=4", "train.steps=4", f"checkpoint.resume={ckpt}"),
                            str(tmp_path / "fsdp4"))
    assert_same_params(resumed, want)
    plain, _ = train_reference(make_config("train.steps=4"), resume_from=ckpt)
    assert_same_params(dict(plain.state_dict()), want)


def _publish_forked(run_dir: str, base: str, step: int, files: list[tuple[int, int]]) -> str:
    """A checkpoint of the shard files tests.forked_stages left (``stage<s>-<f>-<tp>.pt``), as a run publishes one."""
    ckpt = checkpoint.step_dir(base, step)
    shards = []
    for stage, part in files:
        state = torch.load(os.path.join(run_dir, f"stage{stage}-{part}-0.pt"), weights_only=True)  # tp rank 0
        part = part if "rows" in state else None
        shards.append(checkpoint.save_shard(ckpt, stage, state, part))
    checkpoint.publish(ckpt, {"step": step, "shards": shards})
    return ckpt


def test_a_replica_checkpoint_loads_into_shards(make_config, tmp_path):
    # the other direction: written whole (dp=1), resumed sharded
    first_dir = str(tmp_path / "whole")
    run_stages(make_config("train.steps=2"), first_dir)
    ckpt = _publish_forked(first_dir, str(tmp_path / "ckpts"), step=2, files=[(0, 0)])
    resumed, _ = run_stages(make_config("parallel.fsdp=2", "train.steps=4", f"checkpoint.resume={ckpt}"),
                            str(tmp_path / "sharded"))
    assert_same_params(resumed, reference_state(make_config("train.steps=4")))


def test_dp2_fsdp2_worker_killed_from_outside_is_repaired(ray_session, make_config, fast_driver_poll):
    # Every worker stops itself at step 3; the test SIGKILLs replica 1's shard 1 from outside and
    # resumes the others. Replica 1 is dropped whole (its shard 0 waits as a spare) and replica 0
    # takes the global batch. Replica 0's shard 0 stops again at step 5 until the replacement has
    # started, so the spare and it re-form replica 1, taking their shards' state from replica 0's.
    pauses = [f"'{r}:{f}:0@3:pause'" for r in (0, 1) for f in (0, 1)] + ["'0:0:0@5:pause'"]
    cfg = make_config("parallel.dp=2", "parallel.fsdp=2", "train.steps=8", "elastic.min_dp=1",
                      "run.record_samples=true", f"elastic.faults=[{', '.join(pauses)}]")

    def kill_replica_1_shard_1(paused, started):
        pids = started["pids"]
        deadline = time.monotonic() + 60
        while not all(stopped(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first to pause wakes the watcher: wait for all four
        os.kill(pids[3], signal.SIGKILL)  # rank 3 = replica 1, shard 1
        for pid in pids[:3]:
            os.kill(pid, signal.SIGCONT)

    def resume_once_the_replacement_started(paused, started):
        hold_until_a_new_worker_starts([], set(started["pids"]))
        for pid in paused:
            os.kill(pid, signal.SIGCONT)

    with WhenPaused(1, kill_replica_1_shard_1, resume_once_the_replacement_started, after_step=3) as watcher:
        result = train(cfg, on_rows=watcher.on_rows)
    events = [e["event"] for e in result.events]
    assert watcher.acted and result.failures == 1 and events.count("grow") == 1, result.events
    repair = next(e for e in result.events if e["event"] == "repair")
    assert repair["lost"] == ["replica 1 shard 1 stage 0"] and repair["new_layout"] == "dp=1 fsdp=2 pp=1"
    assert [r["layout"] for r in result.metrics][-1] == "dp=2 fsdp=2 pp=1"
    killed = result.worker_pids[3]
    assert killed not in result.final_pids and len(result.final_pids) == 4
    assert set(result.worker_pids) - {killed} <= set(result.final_pids), "a survivor was restarted"
    assert result.committed_steps == list(range(8))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert len(ids) == 8 * 8 and len(set(ids)) == len(ids)
    assert_replicas_identical(result, replicas=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_fsdp2_on_actors_matches_single_process_and_reloads_the_checkpoint_when_it_loses_a_shard(ray_session,
                                                                                                 make_config):
    # dp=1: no live copy of the lost shard anywhere, so the run reloads its last checkpoint and says so.
    cfg = make_config("parallel.fsdp=2", "train.steps=5", "checkpoint.every=2", "run.record_samples=true",
                      "run.trace_steps=1", "elastic.faults=['0:1:0@3:forward']")
    result = train(cfg)
    assert result.layout == "dp=1 fsdp=2 pp=1 m=1" and len(result.worker_pids) == 2
    reload = [e for e in result.events if e["event"] == "reload"]
    assert len(reload) == 1 and reload[0]["step"] == 2 and "no live copy" in reload[0]["reason"], result.events
    assert result.committed_steps == list(range(5))
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    manifest = checkpoint.read_manifest(result.checkpoint)
    assert [s["file"] for s in manifest["shards"]] == ["stage-0-shard-0.pt", "stage-0-shard-1.pt"]
    # each worker wrote its own half: no file holds a whole parameter
    halves = checkpoint.load_shards(result.checkpoint)
    assert all(h["model"]["1.fc.weight"].shape == (64, 32) for h in halves)
    # the trace shows FSDP2's collectives inside the forward and backward actions
    with open(os.path.join(result.run_dir, "trace.json")) as f:
        trace = json.load(f)["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"all-gather", "reduce-scatter", "F0", "B0"} <= names, names
