"""Data parallelism end to end on real Ray actors: the layout does not change the math."""

import pytest

from raytrain import checkpoint, train
from tests.conftest import assert_same_params, reference_state


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_matches_single_process(ray_session, make_config, dp):
    cfg = make_config(f"parallel.dp={dp}")
    result = train(cfg)
    assert result.steps == 5 and len(result.metrics) == 5
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_microbatches_accumulate_to_the_same_step(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "parallel.microbatches=2")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_losses_follow_the_reference_curve(ray_session, make_config):
    from raytrain.reference import train_reference

    cfg = make_config("parallel.dp=2")
    result = train(cfg)
    _, ref_losses = train_reference(cfg)
    assert [r["loss"] for r in result.metrics] == pytest.approx(ref_losses, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it learns
