"""Pipeline and hybrid parallelism on real actors: same parameters as a single process."""

import json
import os

import pytest

from raytrain import checkpoint, train
from raytrain.reference import train_reference
from tests.conftest import assert_same_params, reference_state


# At m=1 the 1F1B plan is the GPipe plan, action for action (asserted in test_schedule), and the
# executor only runs plans: the (1f1b, m=1) cells would repeat the (gpipe, m=1) runs, so they are
# not run again on actors.
CELLS = [(pp, kind, m) for pp in (2, 4) for kind in ("gpipe", "1f1b") for m in (1, 2, 4) if (kind, m) != ("1f1b", 1)]


@pytest.mark.parametrize("pp, kind, m", CELLS)
def test_pipeline_matches_single_process(ray_session, make_config, pp, kind, m):
    cfg = make_config(f"parallel.pp={pp}", f"parallel.schedule={kind}", f"parallel.microbatches={m}", "train.steps=4")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    # Count live activations per stage (rank == stage here): 1F1B keeps at most pp - stage, GPipe all m.
    peaks = result.metrics[-1]["peak_live_activations"]
    want = [m] * pp if kind == "gpipe" else [min(pp - s, m) for s in range(pp)]
    assert [peaks[str(s)] for s in range(pp)] == want


def test_hybrid_dp2_pp2_matches_single_process(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_timeline_and_bubble_are_recorded(ray_session, make_config):
    cfg = make_config("parallel.pp=2", "parallel.microbatches=4", "run.trace_steps=2")
    result = train(cfg)
    with open(os.path.join(result.run_dir, "trace.json")) as f:
        trace = json.load(f)["traceEvents"]
    tracks = {e["tid"] for e in trace if e["ph"] == "X"}
    assert tracks == {0, 1}
    names = [e["name"] for e in trace if e["ph"] == "X" and e["tid"] == 1 and e["args"]["step"] == 1]
    assert [n for n in names if n[0] in "FB"] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert all(0.0 <= r["bubble"] < 1.0 for r in result.metrics)
    assert os.path.exists(os.path.join(result.run_dir, "loss.png"))


def test_hybrid_checkpoint_reshards_to_other_layouts(ray_session, make_config, tmp_path):
    ckpt_dir = str(tmp_path / "ckpts")
    first = train(make_config("parallel.dp=2", "parallel.pp=2", "train.steps=3", f"checkpoint.dir={ckpt_dir}"))
    want = reference_state(make_config("train.steps=6"))
    for layout in (["parallel.pp=4"], ["parallel.dp=4"]):
        resumed = train(make_config(*layout, "train.steps=6", f"checkpoint.resume={first.checkpoint}",
                                    f"checkpoint.dir={tmp_path / 'out' / layout[0]}"))
        assert_same_params(checkpoint.load_state_dict(resumed.checkpoint), want)
    # and in a single plain-torch process
    model, _ = train_reference(make_config("train.steps=6"), resume_from=first.checkpoint)
    assert_same_params(dict(model.state_dict()), want)
