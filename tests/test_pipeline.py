"""Pipeline and hybrid parallelism on real actors: same parameters as a single process."""

import json
import os

import pytest

from raytrain import checkpoint, train
from raytrain.testing.reference import train_reference
from raytrain.pipeline.checker import last_gradient_action, peak_live_activations
from raytrain.pipeline.schedule import build_schedule
from tests.forked_stages import run_stages
from tests.helpers import assert_same_params, reference_state


# At m=1 the 1F1B schedule is the GPipe schedule, action for action (asserted in test_schedule), and the
# executor only runs schedules: the (1f1b, m=1) cells would repeat the (gpipe, m=1) runs.
CELLS = [(pp, kind, m) for pp in (2, 4) for kind in ("gpipe", "1f1b") for m in (1, 2, 4) if (kind, m) != ("1f1b", 1)]
# The cells that also run on Ray actors: both schedules, both depths. The schedule and m only change
# what each Stage executes, which the whole grid checks in forked processes; what the coordinator
# does for a pipeline does not depend on them.
RAY_CELLS = [(2, "gpipe", 2), (4, "1f1b", 4)]


def expected_peak_live(pp: int, kind: str, m: int) -> list[int]:
    """Live activations per stage: 1F1B keeps at most pp - stage, GPipe all m."""
    return [m] * pp if kind == "gpipe" else [min(pp - s, m) for s in range(pp)]


@pytest.mark.parametrize("split", ["false", "true"], ids=["whole-backward", "split-backward"])
@pytest.mark.parametrize("pp, kind, m", CELLS)
def test_executor_grid_matches_single_process(make_config, tmp_path, pp, kind, m, split):
    cfg = make_config(f"parallel.pp={pp}", f"parallel.schedule={kind}", f"parallel.microbatches={m}", "train.steps=4",
                      f"parallel.split_backward={split}")
    model, peak_live = run_stages(cfg, str(tmp_path))
    assert_same_params(model, reference_state(cfg))
    assert peak_live == expected_peak_live(pp, kind, m)


# Virtual stages: two chunks per worker, looped (interleaved 1F1B) or in a V (zero-bubble V and DualPipeV,
# whose last worker hands its first chunk's output to its second without a message); at pp=4 on 8 layers.
CHUNK_CELLS = [(2, "interleaved_1f1b", 2, "false"), (2, "interleaved_1f1b", 4, "true"), (4, "interleaved_1f1b", 4, "true"),
               (2, "zbv", 1, "true"), (2, "zbv", 4, "true"), (4, "zbv", 8, "true"),
               (2, "dualpipev", 4, "false"), (4, "dualpipev", 8, "false")]
CHUNK_BOUND = {"interleaved_1f1b": lambda pp: 2 * pp + pp - 1, "zbv": lambda pp: 2 * pp, "dualpipev": lambda pp: 2 * pp + 1}
"""Each schedule's promise: the most chunk activations a worker holds."""


def test_virtual_stages_with_fsdp_shard_each_chunk_as_its_own_root(make_config, tmp_path):
    # fsdp=2 x pp=2 interleaved: each worker's two chunks are FSDP2 roots of their own, each reduce-scattered
    # in its own last backward (chunk 1's comes before chunk 0's on worker 0); with HSDP (dp=2) over them
    for layout in (["parallel.fsdp=2"], ["parallel.fsdp=2", "parallel.dp=2", "train.global_batch=16"]):
        cfg = make_config("parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                          "parallel.microbatches=2", "train.steps=3", "model.n_layer=6", *layout)
        model, _ = run_stages(cfg, str(tmp_path / layout[-1]))
        assert_same_params(model, reference_state(cfg))


SPLIT_FSDP_CELLS = {
    "zbv": ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=4"],
    "dualpipev-hsdp": ["parallel.schedule=dualpipev", "parallel.virtual_stages=2", "parallel.microbatches=4",
                       "parallel.dp=2", "train.global_batch=16"],
    "1f1b-split": ["parallel.split_backward=true", "parallel.microbatches=4"],
    "gpipe-split": ["parallel.schedule=gpipe", "parallel.split_backward=true", "parallel.microbatches=2"],
}


@pytest.mark.parametrize("cell", SPLIT_FSDP_CELLS)
def test_split_backwards_on_sharded_stages_reduce_after_their_last_weight_half(make_config, tmp_path, cell):
    # A chunk whose last gradients of the step come from a weight half (W) has no backward left to run
    # FSDP2's reduce-scatter in: ShardedGrads.chunk_weights_done runs it after that W (and with HSDP the
    # all-reduce across replicas). Without it these cells end far from one process's parameters.
    cfg = make_config("parallel.fsdp=2", "parallel.pp=2", "train.steps=3", "model.n_layer=6", *SPLIT_FSDP_CELLS[cell])
    schedule = build_schedule(cfg.parallel.schedule, 2, cfg.parallel.microbatches, True, cfg.parallel.virtual_stages)
    model, _ = run_stages(cfg, str(tmp_path))
    assert_same_params(model, reference_state(cfg))
    # the case this is about ran: a chunk's last gradient action was a W, and FSDP2 reduce-scattered in it
    reduced_in_a_last_w = []
    for stage, acts in enumerate(schedule):
        events = json.loads((tmp_path / f"stage{stage}-0-0.json").read_text())["last_step_events"]
        for chunk in sorted({a.chunk for a in acts}):
            last = acts[last_gradient_action(acts, chunk)]
            if last.kind == "W":
                span = next(((a, b) for name, a, b in events if name == repr(last)), None)  # None: it never ran
                reduced_in_a_last_w.append(span is not None and any(
                    name == "reduce-scatter" and span[0] <= a <= span[1] for name, a, _ in events))
    assert reduced_in_a_last_w and all(reduced_in_a_last_w), reduced_in_a_last_w


@pytest.mark.parametrize("pp, kind, m, split", CHUNK_CELLS)
def test_virtual_stages_match_single_process(make_config, tmp_path, pp, kind, m, split):
    cfg = make_config(f"parallel.pp={pp}", f"parallel.schedule={kind}", f"parallel.microbatches={m}", "train.steps=4",
                      "parallel.virtual_stages=2", f"parallel.split_backward={split}", f"model.n_layer={2 * pp - 2}")
    model, peak_live = run_stages(cfg, str(tmp_path))
    assert_same_params(model, reference_state(cfg))
    schedule = build_schedule(kind, pp, m, split == "true", 2)
    assert peak_live == [peak_live_activations(acts) for acts in schedule]  # the executor holds what the schedule says
    assert max(peak_live) <= CHUNK_BOUND[kind](pp)


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_v_schedules_on_actors_match_single_process(ray_session, make_config, kind):
    cfg = make_config("parallel.pp=2", f"parallel.schedule={kind}", "parallel.virtual_stages=2",
                      "parallel.microbatches=4", "train.steps=4")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    peaks = result.metrics[-1]["peak_live_activations"]
    assert [peaks[str(s)] for s in range(2)] == [peak_live_activations(a) for a in build_schedule(kind, 2, 4, True, 2)]


@pytest.mark.parametrize("pp, kind, m", RAY_CELLS)
def test_pipeline_on_actors_matches_single_process(ray_session, make_config, pp, kind, m):
    cfg = make_config(f"parallel.pp={pp}", f"parallel.schedule={kind}", f"parallel.microbatches={m}", "train.steps=4")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    peaks = result.metrics[-1]["peak_live_activations"]
    assert [peaks[str(s)] for s in range(pp)] == expected_peak_live(pp, kind, m)


def test_timeline_and_bubble_are_recorded(ray_session, make_config):
    cfg = make_config("parallel.pp=2", "parallel.microbatches=4", "run.trace_steps=2", "parallel.split_backward=true")
    result = train(cfg)
    with open(os.path.join(result.run_dir, "trace.json")) as f:
        trace = json.load(f)["traceEvents"]
    tracks = {e["tid"] for e in trace if e["ph"] == "X"}
    assert tracks == {0, 1}
    names = [e["name"] for e in trace if e["ph"] == "X" and e["tid"] == 1 and e["args"]["step"] == 1]
    # 1F1B splits only the last stage's cool-down backward: B3 sends, then W3
    assert [n for n in names if n[0] in "FBW"] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W3"]
    assert all(0.0 <= r["bubble"] < 1.0 for r in result.metrics)
    assert os.path.exists(os.path.join(result.run_dir, "loss.png"))


def test_hybrid_dp2_pp2_matches_single_process_and_its_checkpoint_reshards_to_other_layouts(ray_session, make_config,
                                                                                            tmp_path):
    ckpt_dir = str(tmp_path / "ckpts")
    # split: the dp all-reduce starts from hooks that fire in the W actions
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.split_backward=true",
                      "train.steps=3", f"checkpoint.dir={ckpt_dir}")
    first = train(cfg)
    assert_same_params(checkpoint.load_state_dict(first.checkpoint), reference_state(cfg))
    want = reference_state(make_config("train.steps=6"))
    # Resumed by the stage executor that actor runs use (forked processes: see tests/forked_stages.py)
    for layout in ("parallel.pp=4", "parallel.dp=4"):
        model, _ = run_stages(make_config(layout, "train.steps=6", f"checkpoint.resume={first.checkpoint}"),
                              str(tmp_path / layout))
        assert_same_params(model, want)
    # and in a single plain-torch process
    model, _ = train_reference(make_config("train.steps=6"), resume_from=first.checkpoint)
    assert_same_params(dict(model.state_dict()), want)


def test_dp2_pp2_interleaved_on_actors_matches_single_process_and_resumes_in_other_layouts(ray_session, make_config,
                                                                                          tmp_path):
    # Two chunks per worker on real actors, two replicas all-reducing every chunk's gradients, then the
    # checkpoint (keyed by global names, one file per worker holding two chunks) resumed elsewhere.
    ckpt_dir = str(tmp_path / "ckpts")
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=interleaved_1f1b",
                      "parallel.virtual_stages=2", "parallel.split_backward=true", "train.steps=3",
                      f"checkpoint.dir={ckpt_dir}", "run.trace_steps=1")
    first = train(cfg)
    assert_same_params(checkpoint.load_state_dict(first.checkpoint), reference_state(cfg))
    with open(os.path.join(first.run_dir, "trace.json")) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert {"F0c1", "B0c1"} <= names  # the trace names each action's chunk
    want = reference_state(make_config("train.steps=6"))
    for layout in (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=2"],
                   ["parallel.dp=2"]):
        model, _ = run_stages(make_config(*layout, "train.steps=6", f"checkpoint.resume={first.checkpoint}"),
                              str(tmp_path / layout[0]))
        assert_same_params(model, want)
