"""Data parallelism end to end on real Ray actors: the layout does not change the math."""

import pytest

from raytrain import checkpoint, train
from tests.helpers import assert_same_params, reference_state
def test_dp4_matches_single_process(ray_session, make_config):
    """dp=2: test_dp2_follows_the_reference_step_by_step; dp=1 on actors: tests/test_eval.py's dp1 run."""
    cfg = make_config("parallel.dp=4")
    result = train(cfg)
    assert result.steps == 5 and len(result.metrics) == 5
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_microbatches_accumulate_to_the_same_step(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "parallel.microbatches=2")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_dp2_follows_the_reference_step_by_step(dp2_run):
    from raytrain.testing.reference import train_reference

    cfg, result = dp2_run
    assert result.steps == 5 and len(result.metrics) == 5
    model, ref_losses = train_reference(cfg)
    assert [r["loss"] for r in result.metrics] == pytest.approx(ref_losses, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it learns
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), dict(model.state_dict()))
