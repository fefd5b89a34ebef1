"""The grid (Mesh) owns the dp x fsdp x pp arithmetic; the Layout answers the layout's questions (label,
layer count, stage ranges) in one place, asks its grid the rest, and refuses a cut the model cannot take,
naming the key to change."""

import itertools

import pytest

from raytrain.config import ParallelConfig, load_config
from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.driver.model_check import model_layout


def test_world_size_counts_every_replica_shard_and_stage():
    assert Mesh().world_size == 1
    assert Mesh(dp=2, pp=3).world_size == 6
    assert Mesh(dp=2, fsdp=2, pp=2).world_size == 8
    assert Mesh(dp=3, fsdp=2, pp=4).slots == 8 and Mesh(dp=3, fsdp=2, pp=4).columns == 6


def test_the_layout_asks_its_grid():
    grid = Mesh(dp=3, fsdp=2, pp=2)
    layout = Layout(mesh=grid, microbatches=2)
    assert (layout.dp, layout.fsdp, layout.pp, layout.world_size) == (3, 2, 2, 12) == (*_axes(grid), grid.world_size)
    assert layout.grid_label == grid.grid_label == "dp=3 fsdp=2 pp=2"
    assert layout.with_dp(1).mesh == Mesh(dp=1, fsdp=2, pp=2) and layout.with_dp(1).world_size == 4
    assert Layout.of(ParallelConfig(dp=2, fsdp=2, pp=2)).mesh == Mesh(dp=2, fsdp=2, pp=2)


def _axes(grid: Mesh) -> tuple[int, int, int]:
    return grid.dp, grid.fsdp, grid.pp


@pytest.mark.parametrize("dp, fsdp, pp", [(1, 1, 1), (2, 1, 3), (1, 3, 1), (2, 2, 2), (3, 2, 4)])
def test_every_rank_round_trips_through_its_coordinates(dp, fsdp, pp):
    grid = Mesh(dp=dp, fsdp=fsdp, pp=pp)
    places = []
    for rank in range(grid.world_size):
        replica, stage = grid.coords(rank)
        shard = grid.shard(rank)
        assert grid.rank(replica=replica, shard=shard, stage=stage) == rank
        places.append((replica, shard, stage))
    # Every (replica, shard, stage) once, in the grid's order: replica outermost, stage innermost.
    assert places == list(itertools.product(range(dp), range(fsdp), range(pp)))
    for replica, shard, stage in places:  # each worker is in one group of each axis, of that axis's size
        rank = grid.rank(replica=replica, shard=shard, stage=stage)
        groups = grid.dp_ranks(stage, shard), grid.fsdp_ranks(replica, stage), grid.pp_ranks(replica, shard)
        assert [len(g) for g in groups] == [dp, fsdp, pp] and all(rank in g for g in groups)
        assert grid.label(rank) == (f"{replica}:{shard}:{stage}" if fsdp > 1 else f"{replica}:{stage}")


def test_the_grid_is_built_by_keyword_only():
    with pytest.raises(TypeError):
        Mesh(2, 1, 2)  # the order of the axes is not the caller's to guess
    with pytest.raises(TypeError):
        Layout(Mesh(dp=2))
    with pytest.raises(TypeError):
        Mesh(dp=2).rank(0, 1, 0)


def test_label_names_the_layout_and_the_schedule_of_a_pipeline():
    assert Layout.of(ParallelConfig(dp=2)).label == "dp=2 pp=1 m=1"
    assert Layout.of(ParallelConfig(pp=2, microbatches=4, schedule="gpipe")).label == "dp=1 pp=2 m=4 gpipe"
    assert Layout(mesh=Mesh(dp=3, pp=2), microbatches=2).with_dp(1).label == "dp=1 pp=2 m=2 1f1b"
    assert Layout.of(ParallelConfig(dp=2, fsdp=2)).label == "dp=2 fsdp=2 pp=1 m=1"
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
    layout = model_layout(load_config(None, overrides))
    assert layout.num_layers == 6 and layout.stage_ranges == ranges


def test_split_points_need_no_model():
    layout = Layout.of(ParallelConfig(pp=3, split_points=[2, 3])).for_model(5, "the model")
    assert not layout.needs_cuts and layout.stage_ranges == [range(0, 2), range(2, 3), range(3, 5)]
    assert Layout(mesh=Mesh(pp=2)).needs_cuts and not Layout().needs_cuts


def test_a_factory_model_is_counted_and_cut():
    layout = model_layout(load_config(None, ["model.factory=tests.factories:raises_in_workers", "parallel.pp=2"]))
    assert layout.num_layers == 2 and layout.stage_ranges == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize("layout, must_mention", [
    (Layout(mesh=Mesh(pp=9)), ["parallel.pp=9", "exceeds the 6 layers of the model", "lower parallel.pp"]),
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
def test_the_config_and_the_model_layout_refuse_a_bad_cut_the_same_way(overrides, must_mention):
    # The built-in GPT is checked when the config is built; a factory's layers once prepare counts them.
    with pytest.raises(ValueError) as err:
        model_layout(load_config(None, overrides))
    assert all(text in str(err.value) for text in must_mention), str(err.value)


@pytest.mark.parametrize("dp, fsdp, tp, pp", [(1, 1, 2, 1), (2, 1, 2, 2), (1, 2, 4, 1), (2, 2, 2, 3)])
def test_tp_is_the_innermost_digit_of_the_rank(dp, fsdp, tp, pp):
    grid = Mesh(dp=dp, fsdp=fsdp, tp=tp, pp=pp)
    assert grid.world_size == dp * fsdp * tp * pp and grid.slots == fsdp * tp * pp
    assert grid.columns == dp * fsdp  # the tp ranks of a column read the same samples
    places = []
    for rank in range(grid.world_size):
        replica, stage = grid.coords(rank)
        shard, t = grid.shard(rank), grid.tp_index(rank)
        assert grid.rank(replica=replica, shard=shard, stage=stage, tp=t) == rank
        places.append((replica, shard, stage, t))
        assert grid.label(rank) == f"{replica}:{shard}:{stage}:{t}"
    assert places == list(itertools.product(range(dp), range(fsdp), range(pp), range(tp)))
    assert grid.slot_order() == [p[1:] for p in places[:grid.slots]]
    for replica, shard, stage, t in places:
        rank = grid.rank(replica=replica, shard=shard, stage=stage, tp=t)
        members = grid.tp_ranks(replica, stage, shard)
        assert members == list(range(members[0], members[0] + tp)) and rank in members  # consecutive: one node
        groups = grid.dp_ranks(stage, shard, t), grid.fsdp_ranks(replica, stage, t), grid.pp_ranks(replica, shard, t)
        assert [len(g) for g in groups] == [dp, fsdp, pp] and all(rank in g for g in groups)
        assert all(grid.tp_index(r) == t for g in groups for r in g)  # the other axes stay on one tp rank
    assert grid.grid_label == " ".join([f"dp={dp}"] + ([f"fsdp={fsdp}"] if fsdp > 1 else []) + [f"tp={tp}", f"pp={pp}"])
    assert Layout.of(ParallelConfig(dp=dp, fsdp=fsdp, tp=tp, pp=pp)).mesh == grid


def test_a_tp_rank_holds_its_heads_of_each_fused_part_and_the_ranks_tile_every_tensor():
    from raytrain.models.tensor_plan import grad_summed, local_boxes, split_of

    plan = {"qkv": ("colwise", 3), "proj": ("rowwise", 1)}
    assert local_boxes(plan, "qkv.weight", (12, 4), 2, 1) == [((2, 4), (0, 4)), ((6, 8), (0, 4)), ((10, 12), (0, 4))]
    assert local_boxes(plan, "proj.weight", (4, 4), 2, 1) == [((0, 4), (2, 4))]
    assert local_boxes(plan, "proj.bias", (4,), 2, 1) == [((0, 4),)]  # added once, after the sum: whole
    assert local_boxes(plan, "ln.weight", (4,), 2, 0) == [((0, 4),)] and split_of(plan, "ln.weight") is None
    summed = {"q_norm": ("replicated_grad_sum", 1)}  # whole on each rank; its gradient summed over tp
    assert local_boxes(summed, "q_norm.weight", (4,), 2, 1) == [((0, 4),)] and split_of(summed, "q_norm.weight") is None
    assert grad_summed(summed, "q_norm.weight") and not grad_summed(plan, "qkv.weight")
    for name, shape in (("qkv.weight", (12, 4)), ("proj.weight", (4, 4))):
        cells = [(i, j) for t in range(2) for box in local_boxes(plan, name, shape, 2, t)
                 for i in range(*box[0]) for j in range(*box[1])]
        assert sorted(cells) == [(i, j) for i in range(shape[0]) for j in range(shape[1])]


def test_a_bare_parameter_of_one_value_per_head_is_split_with_the_heads():
    import torch
    from torch import nn

    from raytrain.models.tensor_plan import local_boxes, plan_problem, split_of

    layer = nn.Sequential()
    layer.attn = nn.Linear(8, 8)
    layer.attn.sinks = nn.Parameter(torch.zeros(4))  # one logit per head, read by the attention's own code
    layer.tp_plan = {"attn": ("colwise", 1), "attn.sinks": ("param_rows", 1)}
    assert plan_problem([layer], 2) is None and split_of(layer.tp_plan, "attn.sinks") == ("param_rows", 1, 0)
    assert local_boxes(layer.tp_plan, "attn.sinks", (4,), 2, 1) == [((2, 4),)]
    assert "has 4 rows, which do not split into 1 part(s) of tp=8" in plan_problem([layer], 8)
    layer.tp_plan = {"attn.gates": ("param_rows", 1)}
    assert "names no parameter of that layer" in plan_problem([layer], 2)


def test_a_head_is_split_by_vocabulary_only_where_tp_divides_it_and_it_is_not_tied():
    from torch import nn

    from raytrain.config.schema import ModelConfig
    from raytrain.models.layers import Embedding, Head
    from raytrain.models.tensor_plan import layer_plan, local_boxes, plan_problem

    cfg = ModelConfig(d_model=8, n_head=2, vocab_size=258)
    embedding, head = Embedding(cfg), Head(cfg)
    assert layer_plan(head, 2) == {"lm_head": ("vocab_parallel", 1)} and layer_plan(head, 4) == {}
    assert local_boxes(layer_plan(head, 2), "lm_head.weight", (258, 8), 2, 1) == [((129, 258), (0, 8))]
    # with sequence parallelism its norm runs on the rank's tokens; whole at tp=4, it takes every rank's
    assert layer_plan(head, 2, sequence=True) == {"ln": ("sequence_parallel", 1), "lm_head": ("vocab_parallel", 1)}
    assert layer_plan(head, 4, sequence=True) == {"ln": ("sequence_parallel", 1), "lm_head": ("sequence_gather", 1)}
    for tp in (2, 4):
        assert plan_problem([embedding, head], tp, sequence=True) is None
    assert "layer 0 takes the tokens split" in plan_problem([head], 2, sequence=True)  # nothing before split them
    bare = nn.Sequential()
    bare.lm_head, bare.tp_plan = nn.Linear(8, 258), {"lm_head": ("vocab_parallel", 1)}
    assert layer_plan(bare, 4) == {} and "no entry of the layers' tp_plan splits a linear at tp=4" in plan_problem([bare], 4)
    bare.tp_plan = {"lm_head": ("vocab_parallel", 2)}
    assert "give ('vocab_parallel', 1)" in plan_problem([bare], 2)
    embedding, bare.tp_plan = nn.Embedding(258, 8), {"lm_head": ("vocab_parallel", 1)}
    embedding.weight = bare.lm_head.weight  # tied: the embedding needs it whole on every rank
    assert "tied to another parameter" in plan_problem([embedding, bare], 2)


def test_the_token_table_splits_by_vocabulary_where_tp_divides_it():
    from torch import nn

    from raytrain.config.schema import ModelConfig
    from raytrain.models.layers import Embedding
    from raytrain.models.tensor_plan import layer_plan, local_boxes, plan_problem

    embedding = Embedding(ModelConfig(d_model=8, n_head=2, vocab_size=258))
    assert layer_plan(embedding, 2) == {"tok": ("vocab_embedding", 1)} and layer_plan(embedding, 4) == {}
    assert local_boxes(layer_plan(embedding, 2), "tok.weight", (258, 8), 2, 1) == [((129, 258), (0, 8))]
    assert local_boxes(layer_plan(embedding, 2), "pos.weight", (32, 8), 2, 1) == [((0, 32), (0, 8))]  # positions whole
    assert layer_plan(embedding, 2, sequence=True) == {"tok": ("vocab_embedding", 1), "": ("sequence_scatter", 1)}
    table = nn.Sequential()
    table.tok, table.tp_plan = nn.Linear(8, 258), {"tok": ("vocab_embedding", 1)}
    assert "names no nn.Embedding of that layer" in plan_problem([table], 2)
    table.tok, table.tp_plan = nn.Embedding(258, 8), {"tok": ("vocab_embedding", 2)}
    assert "give ('vocab_embedding', 1)" in plan_problem([table], 2)
    head = nn.Sequential()
    head.lm_head = nn.Linear(8, 258, bias=False)
    head.lm_head.weight = table.tok.weight  # tied to the head: both stay whole
    table.tp_plan = {"tok": ("vocab_embedding", 1)}
    assert "tied to another parameter" in plan_problem([table, head], 2)
