"""parallel.auto: the candidates are every runnable layout of the cluster's workers; the probe picks
the fastest and the run trains with it, on the same trajectory as any other layout."""

import pytest

from raytrain import checkpoint, train
from raytrain.config import load_config
from raytrain.driver.memory import layout_memory
from raytrain.models.memory import PROCESS_BYTES
from raytrain.tune.autolayout import candidate_layouts, layout_of, splits_by_tp, too_big
from tests.factories import Scale
from tests.helpers import assert_same_params, reference_state
def _layouts(workers, layers, *overrides):
    """The candidates without tp (one worker per node: tp's candidates have their own test)."""
    cfg = load_config(None, ["parallel.auto=true", "resources.placement_strategy=STRICT_SPREAD", *overrides])
    return [(l["parallel.dp"], l.get("parallel.fsdp", 1), l["parallel.pp"], l["parallel.microbatches"],
             l.get("parallel.schedule")) for l in candidate_layouts(cfg, workers, layers)]


def test_candidates_use_every_worker_and_fit_batch_and_layers():
    # global batch 8: dp x fsdp must divide it; each worker's share must divide by m; pp <= layers
    assert _layouts(2, 4, "train.global_batch=8") == [
        (2, 1, 1, 1, None), (1, 2, 1, 1, None), (1, 1, 2, 2, "1f1b"), (1, 1, 2, 4, "1f1b"), (1, 1, 2, 8, "1f1b")]
    assert _layouts(4, 3, "train.global_batch=8", "parallel.auto_microbatches=[2, 8]",
                    "parallel.auto_schedules=[gpipe, 1f1b]") == [
        (4, 1, 1, 1, None), (2, 2, 1, 1, None), (1, 4, 1, 1, None),
        (2, 1, 2, 2, "gpipe"), (2, 1, 2, 2, "1f1b"), (1, 2, 2, 2, "gpipe"), (1, 2, 2, 2, "1f1b")]  # m=8 > share 4
    assert _layouts(3, 4, "train.global_batch=8") == [
        (1, 1, 3, 2, "1f1b"), (1, 1, 3, 4, "1f1b"), (1, 1, 3, 8, "1f1b")]  # 8 samples do not divide over 3


def test_tp_candidates_stay_on_one_node_and_need_a_plan_that_splits_the_model():
    # tp is the innermost axis and each tp group stays on one node: one worker per node (STRICT_SPREAD)
    # leaves no candidate with tp > 1
    assert all(l.get("parallel.tp", 1) == 1 for l in candidate_layouts(
        load_config(None, ["parallel.auto=true", "resources.placement_strategy=STRICT_SPREAD"]), 4, 4))
    cfg = load_config(None, ["parallel.auto=true", "train.global_batch=8"])
    grids = {(l["parallel.dp"], l.get("parallel.fsdp", 1), l.get("parallel.tp", 1), l["parallel.pp"])
             for l in candidate_layouts(cfg, 4, 4)}
    assert {(2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 1), (1, 1, 2, 2)} <= grids
    assert (1, 1, 4, 1) in grids and all(dp * fsdp * tp * pp == 4 for dp, fsdp, tp, pp in grids)
    # the built-in GPT's 4 heads do not split 3 ways: the config's own check drops tp=3
    assert all(l.get("parallel.tp", 1) != 3 for l in candidate_layouts(cfg, 3, 4))
    # a factory's plan decides which tp it can take (GatedMLP's hidden 2 x d_model=256, in two parts)
    from tests.factories import one_row_head, planned_mlp

    factory = load_config(None, ["model.factory=tests.factories:planned_mlp"])
    layers = planned_mlp(factory.model)
    assert splits_by_tp(factory, layers, 2) and splits_by_tp(factory, layers, 4) and not splits_by_tp(factory, layers, 3)
    assert not splits_by_tp(factory, one_row_head(factory.model), 2) and splits_by_tp(factory, [], 1)


def test_chunked_schedules_are_probed_with_two_chunks_per_worker_where_the_layers_allow():
    cfg = load_config(None, ["parallel.auto=true", "train.global_batch=8", "parallel.auto_microbatches=[1, 2, 4]",
                             "parallel.auto_schedules=[1f1b, interleaved_1f1b, zbv, dualpipev]"])
    piped = [l for l in candidate_layouts(cfg, 2, 4) if l["parallel.pp"] == 2]
    assert [(l["parallel.microbatches"], l["parallel.schedule"], l.get("parallel.virtual_stages", 1)) for l in piped] == [
        (1, "1f1b", 1), (1, "zbv", 2),  # interleaved 1F1B needs m a multiple of pp, DualPipeV m >= 2 pp
        (2, "1f1b", 1), (2, "interleaved_1f1b", 2), (2, "zbv", 2),
        (4, "1f1b", 1), (4, "interleaved_1f1b", 2), (4, "zbv", 2), (4, "dualpipev", 2)]
    assert all(layout_of(l).num_chunks == 4 for l in piped if l.get("parallel.virtual_stages") == 2)
    # 3 layers cannot be cut into 2 x 2 chunks: only the one-chunk schedule is probed
    assert {l["parallel.schedule"] for l in candidate_layouts(cfg, 2, 3) if l["parallel.pp"] == 2} == {"1f1b"}
    # a base config set to zbv still gets every grid, each candidate with its own chunk count
    based = load_config(None, ["parallel.auto=true", "train.global_batch=8", "parallel.schedule=zbv",
                               "parallel.auto_microbatches=[2]", "parallel.auto_schedules=[1f1b, zbv]",
                               "resources.placement_strategy=STRICT_SPREAD"])  # no tp=2 grid among them
    found = [(l["parallel.pp"], l.get("parallel.schedule"), l["parallel.virtual_stages"]) for l in candidate_layouts(based, 2, 4)]
    assert found == [(1, None, 1), (1, None, 1), (2, "1f1b", 1), (2, "zbv", 2)]


def test_layouts_whose_state_does_not_fit_a_worker_are_not_probed():
    """parallel.auto ranks by the estimate every run is checked against (raytrain.models.memory)."""
    cfg = load_config(None, ["model.factory=tests.factories:unused"])  # a factory's activations are not estimated
    counts = [1000, 4000, 4000, 1000]  # parameters per layer: 160 kB of state in all
    layouts = [{"parallel.dp": 2, "parallel.pp": 1}, {"parallel.fsdp": 2, "parallel.pp": 1},
               {"parallel.pp": 2, "parallel.microbatches": 2}]
    tensors = [layout_memory(cfg, layout_of(layout), counts) for layout in layouts]
    tensors = [m.total - m.process for m in tensors]  # beside the worker process (PROCESS_BYTES and its slack)
    assert tensors == [16 * 10_000, 8 * 10_000 + 8 * 4000, 16 * 5_000]  # fsdp: + the gathered layer
    reasons = too_big(cfg, layouts, counts, worker_bytes=PROCESS_BYTES + 100_000)
    assert list(reasons) == [0, 1] and "exceeds" in reasons[0] and "GiB" in reasons[0]
    assert too_big(cfg, layouts, counts, worker_bytes=None) == {}  # unknown (GPUs): probed, not estimated


@pytest.mark.parametrize("overrides, must_mention", [
    (["parallel.auto=true", "parallel.pp=2", "parallel.split_points=[2]"], ["parallel.split_points"]),
    (["parallel.auto=true", "elastic.min_dp=1"], ["parallel.auto", "elastic.min_dp"]),
    (["parallel.auto=true", "parallel.auto_schedules=[zigzag]"], ["parallel.auto_schedules"]),
    (["parallel.auto=true", "parallel.tp=2", "resources.placement_strategy=STRICT_PACK"],
     ["parallel.auto", "chooses parallel.tp itself", "leave parallel.tp=1"]),
])
def test_auto_bad_input_names_the_key(overrides, must_mention):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert all(text in str(err.value) for text in must_mention), str(err.value)


def test_auto_probes_then_trains_with_the_fastest_layout(ray_session, make_config):
    cfg = make_config("parallel.auto=true", "parallel.auto_max_workers=2", "parallel.auto_microbatches=[2]",
                      "parallel.auto_steps=3", "train.steps=3", "resources.placement_strategy=STRICT_PACK")
    result = train(cfg)
    probes = result.auto_layout["probes"]
    assert sorted(p["layout"] for p in probes) == ["dp=1 fsdp=2 pp=1 m=1", "dp=1 pp=2 m=2 1f1b", "dp=1 tp=2 pp=1 m=1",
                                                   "dp=2 pp=1 m=1"]
    assert all(p["status"] == "finished" and p["samples_per_s"] > 0 for p in probes), probes
    fastest = max(probes, key=lambda p: p["samples_per_s"])["layout"]
    assert result.auto_layout["chosen"] == fastest == result.layout
    assert result.summary()["auto_layout"] == fastest
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_fsdp_may_leave_a_small_parameter_empty_but_never_cut_a_scalar(tmp_path):
    from torch import nn

    from raytrain.driver.model_check import shardable_rows
    from raytrain.driver.prepare import prepare

    assert shardable_rows([nn.Linear(8, 1), nn.Linear(1, 8)]) == 8  # the 1-row Linear leaves shards empty: allowed
    assert shardable_rows([nn.Linear(8, 1), Scale()]) == 1
    base = [f"run.dir={tmp_path}", "parallel.fsdp=2"]
    prepare(load_config(None, [*base, "model.factory=tests.factories:one_row_head"]))
    with pytest.raises(ValueError, match="parallel.fsdp=2.*scalar.*parallel.fsdp <= 1"):
        prepare(load_config(None, [*base, "model.factory=tests.factories:with_a_scalar"]))
