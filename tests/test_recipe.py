"""The training recipe's features: a learning-rate schedule that is a function of the step alone (so
every layout, resize and resume follows the one-process run), activation checkpointing (same math),
bf16 autocast on CPU."""

import math

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.config import load_config
from raytrain.optim.lr_schedule import learning_rate
from tests.helpers import assert_same_params, reference_state


def _train_cfg(*overrides):
    return load_config(None, ["train.steps=10", "train.lr=1e-2", *overrides]).train


def test_warm_up_then_cosine_or_linear_decay_to_min_lr():
    cosine = _train_cfg("train.lr_schedule=cosine", "train.warmup_steps=4", "train.min_lr=1e-3")
    assert [learning_rate(cosine, s) for s in range(4)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert learning_rate(cosine, 4) == pytest.approx(1e-2)  # the decay starts at the peak
    middle = 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 6))
    assert learning_rate(cosine, 7) == pytest.approx(middle)
    assert learning_rate(cosine, 9) > 1e-3 and learning_rate(cosine, 10) == pytest.approx(1e-3)
    linear = _train_cfg("train.lr_schedule=linear", "train.min_lr=0")
    assert [learning_rate(linear, s) for s in (0, 5)] == pytest.approx([1e-2, 5e-3])
    assert {learning_rate(_train_cfg(), s) for s in range(10)} == {1e-2}


@pytest.mark.parametrize("bad, key", [("train.lr_schedule=step", "train.lr_schedule"),
                                      ("train.warmup_steps=-1", "train.warmup_steps"),
                                      ("train.min_lr=0.5", "train.min_lr")])
def test_bad_schedule_settings_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        load_config(None, ["train.steps=10", "train.lr=1e-2", bad])


SCHEDULE = ("train.lr_schedule=cosine", "train.warmup_steps=3", "train.min_lr=1e-3")


@pytest.mark.parametrize("layout", [
    ("parallel.dp=2",),
    # activation checkpointing recomputes each layer's forward in its backward, without changing the math
    ("parallel.pp=2", "parallel.microbatches=2", "train.activation_checkpointing=true"),
], ids=["dp2", "pp2-m2-recompute"])
def test_every_layout_follows_the_one_process_schedule(ray_session, make_config, layout):
    cfg = make_config("train.steps=6", *SCHEDULE, *layout)
    result = train(cfg)
    # lr 1e-2: warm-up over 3 steps, then cosine from 1e-2 to 1e-3 over the last 3
    assert [r["lr"] for r in result.metrics] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2, 7.75e-3, 3.25e-3])
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_run_resumed_mid_warm_up_ends_at_the_uninterrupted_parameters(ray_session, make_config, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = make_config("parallel.dp=2", "train.steps=6", *SCHEDULE)
    train(make_config("parallel.dp=2", "train.steps=2", *SCHEDULE, f"checkpoint.dir={ckpt}"))
    # train.steps differs in the first run, and so would its decay: resume under the full run's config
    resumed = train(make_config("parallel.dp=2", "train.steps=6", *SCHEDULE, f"checkpoint.dir={ckpt}",
                                "checkpoint.resume=latest"))
    assert [r["step"] for r in resumed.metrics] == [3, 4, 5, 6]
    assert_same_params(checkpoint.load_state_dict(resumed.checkpoint), reference_state(straight))


def test_bf16_autocast_trains_on_cpu(ray_session, make_config):
    result = train(make_config("parallel.dp=2", "train.steps=12", "resources.bf16=true", "train.lr=3e-3"))
    losses = [r["loss"] for r in result.metrics]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    params = checkpoint.load_state_dict(result.checkpoint)
    assert all(t.dtype.is_floating_point and t.dtype != torch.bfloat16 for t in params.values())  # fp32 master


def test_activation_checkpointing_and_split_backward_are_refused_together():
    with pytest.raises(ValueError, match="train.activation_checkpointing.*parallel.split_backward"):
        load_config(None, ["train.activation_checkpointing=true", "parallel.split_backward=true"])
