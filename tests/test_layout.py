"""The Layout answers the layout's questions (world size, label, layer count, stage ranges) in one
place, and refuses a cut the model cannot take, naming the key to change."""

import pytest

from raytrain.config import ParallelConfig, load_config
from raytrain.config.layout import Layout
from raytrain.driver.plan import plan_layout


def test_world_size_counts_every_replica_shard_and_stage():
    assert Layout().world_size == 1
    assert Layout(dp=2, pp=3).world_size == 6
    assert Layout(dp=2, fsdp=2, pp=2).world_size == 8


def test_label_names_the_layout_and_the_schedule_of_a_pipeline():
    assert Layout.of(ParallelConfig(dp=2)).label == "dp=2 pp=1 m=1"
    assert Layout.of(ParallelConfig(pp=2, microbatches=4, schedule="gpipe")).label == "dp=1 pp=2 m=4 gpipe"
    assert Layout(dp=3, pp=2, microbatches=2).with_dp(1).label == "dp=1 pp=2 m=2 1f1b"
    cfg = load_config(None, ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"])
    assert cfg.layout() == Layout.of(cfg.parallel) and cfg.layout().label == "dp=2 pp=2 m=2 1f1b"


@pytest.mark.parametrize("overrides, ranges", [
    ([], [range(0, 6)]),  # embedding, 4 blocks, head: one stage
    (["parallel.pp=2"], [range(0, 3), range(3, 6)]),  # balanced by parameters
    (["parallel.pp=3"], [range(0, 2), range(2, 4), range(4, 6)]),
    (["parallel.pp=6"], [range(i, i + 1) for i in range(6)]),
    (["parallel.pp=3", "parallel.split_points=[1, 5]"], [range(0, 1), range(1, 5), range(5, 6)]),
    (["parallel.split_points=[]"], [range(0, 6)]),  # pp=1 takes no cut
])
def test_stage_ranges_of_the_builtin_gpt(overrides, ranges):
    layout = plan_layout(load_config(None, overrides))
    assert layout.num_layers == 6 and layout.stage_ranges == ranges


def test_split_points_need_no_model():
    layout = Layout.of(ParallelConfig(pp=3, split_points=[2, 3])).for_model(5, "the model")
    assert not layout.needs_cuts and layout.stage_ranges == [range(0, 2), range(2, 3), range(3, 5)]
    assert Layout(pp=2).needs_cuts and not Layout().needs_cuts


def test_a_factory_model_is_counted_and_cut():
    layout = plan_layout(load_config(None, ["model.factory=tests.factories:raises_in_workers", "parallel.pp=2"]))
    assert layout.num_layers == 2 and layout.stage_ranges == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize("layout, must_mention", [
    (Layout(pp=9), ["parallel.pp=9", "exceeds the 6 layers of the model", "lower parallel.pp"]),
    (Layout.of(ParallelConfig(pp=2, split_points=[6])), ["parallel.split_points=[6]", "out of range", "1..5"]),
    (Layout.of(ParallelConfig(pp=2, split_points=[0])), ["parallel.split_points=[0]", "out of range", "1..5"]),
])
def test_a_cut_the_model_cannot_take_names_the_key(layout, must_mention):
    with pytest.raises(ValueError) as err:
        layout.for_model(6, "the model")
    assert all(text in str(err.value) for text in must_mention), str(err.value)


@pytest.mark.parametrize("overrides, must_mention", [
    (["parallel.pp=7"], ["parallel.pp=7", "6 layers", "model.n_layer=4 blocks + embedding + head"]),
    (["parallel.pp=2", "parallel.split_points=[7]"], ["parallel.split_points=[7]", "1..5"]),
    (["model.factory=tests.factories:raises_in_workers", "parallel.pp=3"], ["parallel.pp=3", "2 layers of model.factory"]),
    (["model.factory=tests.factories:raises_in_workers", "parallel.pp=2", "parallel.split_points=[2]"],
     ["parallel.split_points=[2]", "1..1"]),
])
def test_the_config_and_the_plan_check_the_same_way(overrides, must_mention):
    # The built-in GPT is checked when the config is built; a factory's layers once prepare counts them.
    with pytest.raises(ValueError) as err:
        plan_layout(load_config(None, overrides))
    assert all(text in str(err.value) for text in must_mention), str(err.value)
