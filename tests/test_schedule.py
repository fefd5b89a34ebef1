"""Schedules are data: every generated schedule is sound, broken ones are rejected, bubbles match theory."""

import pytest

from raytrain.pipeline import checker
from raytrain.pipeline.actions import Action, Placement, ScheduleError, format_grid
from raytrain.pipeline.checker import check_schedule
from raytrain.pipeline.schedule import build_schedule


@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "split-backward"])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_generated_schedules_pass_the_checker_and_match_the_bubble_formula(kind, p, m, split):
    schedule = build_schedule(kind, p, m, split)
    check_schedule(schedule, m)
    # GPipe splits every backward of the stages after the first, 1F1B the cool-down ones
    splits = {"gpipe": lambda s: set(range(m)), "1f1b": lambda s: set(range(max(0, m - (p - s)), m))}[kind]
    assert [checker.split_microbatches(acts) for acts in schedule] == [splits(s) if split and s > 0 else set()
                                                                    for s in range(p)]
    # With free weight gradients (weight_cost 0), a split schedule idles as the unsplit one, bubble for bubble.
    assert checker.idle_fraction(schedule) == pytest.approx(checker.bubble_formula(p, m))
    # also when a backward costs twice a forward, as in practice
    assert checker.idle_fraction(schedule, 1.0, 2.0) == pytest.approx(checker.bubble_formula(p, m))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_split_backward_shortens_the_step_by_sending_input_gradients_early(kind, p, m):
    # forward 1, backward 2 of which 1 is weight gradients: the predecessor gets each input gradient
    # one unit sooner, so the cool-down shrinks; the work is the same.
    whole, whole_busy, _ = checker.simulate(build_schedule(kind, p, m), 1.0, 2.0)
    split, split_busy, _ = checker.simulate(build_schedule(kind, p, m, split_backward=True), 1.0, 2.0, 1.0)
    assert split_busy == whole_busy
    assert split <= whole - 1.0


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_1f1b_splits_only_where_the_weight_half_fills_a_wait(p, m):
    # A split costs something (here 0.2 of a forward) and in 1F1B's steady state a stage has no wait
    # to put the weight half in. Splitting the cool-down backwards, as build_schedule does, beats both
    # the whole backward and splitting every backward; on two stages at m=8 the latter even loses
    # to the whole backward, as bench_pp measured.
    costs = dict(forward_cost=1.0, backward_cost=2.0, weight_cost=1.0, split_cost=0.2)
    whole, _, _ = checker.simulate(build_schedule("1f1b", p, m), **costs)
    cool_down, _, _ = checker.simulate(build_schedule("1f1b", p, m, split_backward=True), **costs)
    every = [[w for a in acts for w in ([a, Action("W", a.mb)] if a.kind == ">B" else [a])]
             for acts in build_schedule("1f1b", p, m)]  # W right after every send of an input gradient
    check_schedule(every, m)
    every_split, _, _ = checker.simulate(every, **costs)
    assert cool_down < whole and cool_down < every_split
    if p == 2 and m == 8:
        assert every_split > whole


def test_last_gradient_action_is_the_last_w_or_whole_backward():
    # the executor arms the dp all-reduce buckets before this action
    whole, split = build_schedule("1f1b", 2, 4)[1], build_schedule("1f1b", 2, 4, split_backward=True)[1]
    assert whole[checker.last_gradient_action(whole)] == Action("B", 3)
    assert split[checker.last_gradient_action(split)] == Action("W", 3)
    # stage 0 never splits
    stage0 = build_schedule("gpipe", 2, 4, split_backward=True)[0]
    assert stage0[checker.last_gradient_action(stage0)] == Action("B", 3)


def test_split_backward_two_stages_one_microbatch_exact_timeline():
    finish, _, timeline = checker.simulate(build_schedule("gpipe", 2, 1, split_backward=True), 1.0, 2.0, 1.0)
    assert [(start, end, repr(a)) for start, end, a in timeline[1]] == [(1, 2, "F0"), (2, 3, "B0"), (3, 4, "W0")]
    assert [(start, end, repr(a)) for start, end, a in timeline[0]] == [(0, 1, "F0"), (3, 5, "B0")]
    assert finish == 5.0  # 6 with the whole backward before the send


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 2)])
def test_live_activations_1f1b_bounded_by_stages_gpipe_grows_with_microbatches(p, m, split):
    gpipe = [checker.peak_live_activations(a) for a in build_schedule("gpipe", p, m, split)]
    one_f_one_b = [checker.peak_live_activations(a) for a in build_schedule("1f1b", p, m, split)]
    assert gpipe == [m] * p
    assert one_f_one_b == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_with_one_microbatch_1f1b_is_gpipe_action_for_action(p):
    # test_pipeline relies on this to run the m=1 cells on actors for GPipe only.
    assert [list(map(repr, a)) for a in build_schedule("1f1b", p, 1)] == [list(map(repr, a)) for a in build_schedule("gpipe", p, 1)]


def _swap(acts, i, j):
    acts = list(acts)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def test_checker_rejects_backward_before_forward():
    schedule = build_schedule("gpipe", 2, 2)
    last = schedule[1]
    i, j = last.index(Action("F", 0)), last.index(Action("B", 0))
    with pytest.raises(ScheduleError, match=r"stage 1 .*B0.* comes before F0|comes before"):
        check_schedule([schedule[0], _swap(last, i, j)], 2)


def test_checker_rejects_missing_and_duplicate_actions():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="stage 0 is missing >F1"):
        check_schedule([[a for a in schedule[0] if a != Action(">F", 1)], schedule[1]], 2)
    with pytest.raises(ScheduleError, match="appears twice"):
        check_schedule([schedule[0] + [Action("F", 0)], schedule[1]], 2)


def test_checker_rejects_misplaced_weight_gradients():
    schedule = build_schedule("gpipe", 2, 2, split_backward=True)
    s1 = schedule[1]
    i, j = s1.index(Action(">B", 0)), s1.index(Action("W", 0))
    with pytest.raises(ScheduleError, match=r"W0\) comes before >B0"):
        check_schedule([schedule[0], _swap(s1, i, j)], 2)
    # a micro-batch without W simply gets a whole backward on that stage
    check_schedule([schedule[0], [a for a in s1 if a != Action("W", 1)]], 2)
    with pytest.raises(ScheduleError, match="stage 0 has W actions"):
        check_schedule([schedule[0] + [Action("W", 0), Action("W", 1)], s1], 2)


def test_checker_finds_deadlock_and_marks_the_cell():
    # both stages receive before they send: a classic deadlock
    s0 = [Action("F", 0), Action("<B", 0), Action(">F", 0), Action("B", 0)]
    s1 = [Action("<F", 0), Action("F", 0), Action("B", 0), Action(">B", 0)]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        check_schedule([s0, s1], 1)
    assert "[<B0]" in str(err.value)  # the grid marks where stage 0 is stuck


def test_checker_rejects_receives_out_of_order():
    schedule = build_schedule("gpipe", 2, 2)
    s1 = list(schedule[1])
    i, j = s1.index(Action("<F", 0)), s1.index(Action("<F", 1))
    s1[i], s1[j] = s1[j], s1[i]
    with pytest.raises(ScheduleError):
        check_schedule([schedule[0], s1], 2)


def test_grid_is_readable():
    grid = format_grid(build_schedule("1f1b", 2, 2))
    assert grid.splitlines()[0].startswith("stage 0:") and "F0" in grid and ">B1" in grid


# --- virtual stages: interleaved 1F1B and zero-bubble V ------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "split-backward"])
@pytest.mark.parametrize("p, v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_1f1b_passes_the_checker_and_its_bubble_is_1f1bs_divided_by_the_chunks(p, v, rounds, split):
    m = rounds * p
    schedule = build_schedule("interleaved_1f1b", p, m, split, v)
    placement = Placement(p, v)
    check_schedule(schedule, m, placement)
    # Narayanan et al. 2021: the bubble of (p-1)/m shrinks to (p-1)/(v m); as a share of the step's time
    # (p-1)/v over m + (p-1)/v. A chunk costs 1/v of a stage, here 1 (forward) and 2 (backward).
    for costs in ((1.0, 1.0), (1.0, 2.0)):
        idle = checker.idle_fraction(schedule, *costs, placement=placement)
        assert idle == pytest.approx(checker.bubble_formula(p, m, v))
        assert idle < checker.bubble_formula(p, m)  # less than 1F1B's
    # its price: worker s holds up to 2(p-s-1) + (v-1)p + 1 chunk activations, not 1F1B's p-s stages
    warmups = [min(2 * (p - s - 1) + (v - 1) * p, m * v) for s in range(p)]
    assert [checker.peak_live_activations(acts) for acts in schedule] == [min(w + 1, m * v) for w in warmups]


def test_interleaved_1f1b_runs_micro_batches_in_rounds_of_the_stages_over_the_chunks():
    schedule = build_schedule("interleaved_1f1b", 2, 4, False, 2)
    forwards = [repr(a) for a in schedule[0] if a.kind == "F"]
    assert forwards == ["F0", "F1", "F0c1", "F1c1", "F2", "F3", "F2c1", "F3c1"]
    backwards = [repr(a) for a in schedule[0] if a.kind == "B"]
    assert backwards == ["B0c1", "B1c1", "B0", "B1", "B2c1", "B3c1", "B2", "B3"]
    # worker 1's chunk 0 (stage 1) sends to worker 0's chunk 1 (stage 2): the looped placement
    assert Action(">F", 0, 0) in schedule[1] and Action("<F", 0, 1) in schedule[0]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_zero_bubble_v_passes_the_checker_holds_2p_chunks_and_leaves_only_the_warm_up_idle(p, m):
    schedule = build_schedule("zbv", p, m, True, 2)
    placement = Placement(p, 2, v_shape=True)
    check_schedule(schedule, m, placement)
    # the last worker holds stages p-1 and p: their hand-off is no message
    hand_off = {(">F", 0), ("<B", 0), ("<F", 1), (">B", 1)}
    assert not [a for a in schedule[p - 1] if (a.kind.value, a.chunk) in hand_off]
    # the first worker holds the first and the last stage; the first stage's backward is never split
    assert placement.stage(0, 0) == 0 and placement.stage(0, 1) == 2 * p - 1
    assert not checker.split_microbatches(schedule[0], chunk=0)
    assert all(checker.split_microbatches(acts, chunk=1) == set(range(m)) for acts in schedule)
    # ZB-V's memory: about 2p chunk activations on each worker, as 1F1B's p whole stages
    assert max(checker.peak_live_activations(acts) for acts in schedule) <= 2 * p
    # Qi et al. 2024: with forward = input gradient = weight gradient time the V leaves no bubble but
    # the warm-up's, a constant p-1 chunk forwards on each worker however many micro-batches
    finish, busy, _ = checker.simulate(schedule, 1.0, 2.0, 1.0, placement=placement)
    if m >= 2 * p - 1:
        assert all(finish - b == pytest.approx(p - 1) for b in busy[1:])
    one_f_one_b, _, _ = checker.simulate(build_schedule("1f1b", p, m, True), 2.0, 4.0, 2.0)  # stages twice a chunk
    assert finish <= one_f_one_b


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 4, 8])
def test_dualpipev_passes_the_checker_splits_only_its_cool_down_and_beats_zbv_when_splits_cost(p, extra):
    m = 2 * p + extra
    schedule = build_schedule("dualpipev", p, m, True, 2)
    placement = Placement(p, 2, v_shape=True)
    check_schedule(schedule, m, placement)
    assert Placement.of_schedule("dualpipev", p, 2) == placement
    # the first stage's backward is never split; a worker splits at most 2(p-1) backwards however many
    # micro-batches (ZB-V: all 2m), those of its warm-up and cool-down, where a W fills a wait
    assert not checker.split_microbatches(schedule[0], chunk=0)
    for acts in schedule:
        assert len(checker.split_keys(acts)) <= 2 * (p - 1)
        steady = range(p, m - p)
        assert not any(mb in steady for _, mb in checker.split_keys(acts))
    # one more chunk activation than ZB-V's 2p, for ZB-V's bubble with far fewer splits
    assert max(checker.peak_live_activations(acts) for acts in schedule) <= 2 * p + 1
    zbv = build_schedule("zbv", p, m, True, 2)
    free = checker.simulate(schedule, 1.0, 2.0, 1.0, placement=placement)[0]
    assert free == pytest.approx(checker.simulate(zbv, 1.0, 2.0, 1.0, placement=placement)[0])
    costly = dict(forward_cost=1.0, backward_cost=2.0, weight_cost=1.0, split_cost=0.2, placement=placement)
    assert checker.simulate(schedule, **costly)[0] < checker.simulate(zbv, **costly)[0]


def _compute_order(actions, p, worker):
    """``(kind, global stage, micro-batch)`` of each compute action; a backward with a W later is "I"."""
    stage = {0: worker, 1: 2 * p - 1 - worker}
    split = {(a.chunk, a.mb) for a in actions if a.kind == "W"}
    return [("I" if a.kind == "B" and (a.chunk, a.mb) in split else str(a.kind), stage[a.chunk], a.mb)
            for a in actions if a.kind.is_compute]


def _torch_compute_order(schedule_class, p, m, worker):
    """torch.pipelining's order for the same worker, read from the schedule class's (private) per-rank
    generator: a cross-check of the V schedules against the implementation the benchmark races."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import _ComputationType as T

    kinds = {T.FORWARD: "F", T.BACKWARD_INPUT: "I", T.FULL_BACKWARD: "B", T.BACKWARD_WEIGHT: "W"}
    ops = schedule_class._calculate_single_rank_operations(
        SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p), worker)
    flat = [sub for a in ops if a is not None for sub in (a.sub_actions or (a,))]  # OVERLAP_F_B: F, then B
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in flat]


@pytest.mark.parametrize("kind, torch_class", [("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_v_schedules_compute_in_torch_pipelinings_order(kind, torch_class, p):
    from torch.distributed.pipelining import schedules as torch_schedules

    for m in range(2 * p, 2 * p + 5):
        schedule = build_schedule(kind, p, m, True, 2)
        for worker in range(p):
            theirs = _torch_compute_order(getattr(torch_schedules, torch_class), p, m, worker)
            if worker == 0:  # the first stage's backward is whole here; torch splits it into I and an empty W
                theirs = [("B", 0, mb) if (k, stage) == ("I", 0) else (k, stage, mb) for k, stage, mb in theirs
                          if (k, stage) != ("W", 0)]
            assert _compute_order(schedule[worker], p, worker) == theirs


@pytest.mark.parametrize("kind", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_without_a_pipeline_every_schedule_is_one_stages_order(kind):
    # parallel.schedule=zbv at pp=1 (the config lets it: nothing to chunk) runs as one stage
    assert build_schedule(kind, 1, 4) == build_schedule("1f1b", 1, 4)
    assert Placement.of_schedule(kind, 1, 1) == Placement(1)


def test_schedules_with_chunks_refuse_the_wrong_chunk_count():
    with pytest.raises(AssertionError, match="two chunks"):
        build_schedule("zbv", 2, 4, True, 3)
    with pytest.raises(AssertionError, match="one chunk"):
        build_schedule("1f1b", 2, 4, False, 2)
    with pytest.raises(AssertionError, match="multiple of the stages"):
        build_schedule("interleaved_1f1b", 2, 3, False, 2)
    with pytest.raises(AssertionError, match="at least 2 x stages"):
        build_schedule("dualpipev", 2, 3, True, 2)


def test_checker_rejects_broken_chunked_schedules():
    placement = Placement(2, 2)
    schedule = build_schedule("interleaved_1f1b", 2, 2, False, 2)
    # a chunk's forward before its previous chunk's on the same worker (V: worker 1 holds stages 1, 2)
    v_place = Placement(2, 2, v_shape=True)
    v_schedule = build_schedule("zbv", 2, 2, True, 2)
    w1 = list(v_schedule[1])
    i, j = w1.index(Action("F", 0, 0)), w1.index(Action("F", 0, 1))
    with pytest.raises(ScheduleError, match=r"F0c1\) comes before F0"):
        check_schedule([v_schedule[0], _swap(w1, i, j)], 2, v_place)
    # a message to the same worker's chunk is no message: a send there is refused
    with pytest.raises(ScheduleError, match="same worker"):
        check_schedule([v_schedule[0], w1 + [Action(">F", 0, 0)]], 2, v_place)
    # receives in another order than their sender's sends on the channel: one tensor for another
    w0 = list(schedule[0])
    i, j = w0.index(Action("<B", 0, 1)), w0.index(Action("<F", 0, 1))
    with pytest.raises(ScheduleError):
        check_schedule([_swap(w0, i, j), schedule[1]], 2, placement)
    # a chunk out of range
    with pytest.raises(ScheduleError, match="chunk out of range"):
        check_schedule([schedule[0] + [Action("F", 0, 2)], schedule[1]], 2, placement)
