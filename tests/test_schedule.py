"""Schedules are data: every generated plan is sound, broken ones are rejected, bubbles match theory."""

import pytest

from raytrain.pipeline import schedule
from raytrain.pipeline.schedule import Action, PlanError, build_plan, check_plan


@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "split-backward"])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_generated_plans_pass_the_checker_and_match_the_bubble_formula(kind, p, m, split):
    plan = build_plan(kind, p, m, split)
    check_plan(plan, m)
    # GPipe splits every backward of the stages after the first, 1F1B the cool-down ones
    splits = {"gpipe": lambda s: set(range(m)), "1f1b": lambda s: set(range(max(0, m - (p - s)), m))}[kind]
    assert [schedule.split_microbatches(acts) for acts in plan] == [splits(s) if split and s > 0 else set()
                                                                    for s in range(p)]
    # With free weight gradients (weight_cost 0), a split plan is its schedule, bubble for bubble.
    assert schedule.idle_fraction(plan) == pytest.approx(schedule.bubble_formula(p, m))
    # also when a backward costs twice a forward, as in practice
    assert schedule.idle_fraction(plan, 1.0, 2.0) == pytest.approx(schedule.bubble_formula(p, m))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_split_backward_shortens_the_step_by_sending_input_gradients_early(kind, p, m):
    # forward 1, backward 2 of which 1 is weight gradients: the predecessor gets each input gradient
    # one unit sooner, so the cool-down shrinks; the work is the same.
    whole, whole_busy, _ = schedule.simulate(build_plan(kind, p, m), 1.0, 2.0)
    split, split_busy, _ = schedule.simulate(build_plan(kind, p, m, split_backward=True), 1.0, 2.0, 1.0)
    assert split_busy == whole_busy
    assert split <= whole - 1.0


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_1f1b_splits_only_where_the_weight_half_fills_a_wait(p, m):
    # A split costs something (here 0.2 of a forward) and in 1F1B's steady state a stage has no wait
    # to put the weight half in. Splitting the cool-down backwards, as build_plan does, beats both
    # the whole backward and splitting every backward; on two stages at m=8 the latter even loses
    # to the whole backward, as bench_pp measured.
    costs = dict(forward_cost=1.0, backward_cost=2.0, weight_cost=1.0, split_cost=0.2)
    whole, _, _ = schedule.simulate(build_plan("1f1b", p, m), **costs)
    cool_down, _, _ = schedule.simulate(build_plan("1f1b", p, m, split_backward=True), **costs)
    every = [[w for a in acts for w in ([a, Action("W", a.mb)] if a.kind == ">B" else [a])]
             for acts in build_plan("1f1b", p, m)]  # W right after every send of an input gradient
    check_plan(every, m)
    every_split, _, _ = schedule.simulate(every, **costs)
    assert cool_down < whole and cool_down < every_split
    if p == 2 and m == 8:
        assert every_split > whole


def test_last_gradient_action_is_the_last_w_or_whole_backward():
    # the executor arms the dp all-reduce buckets before this action
    whole, split = build_plan("1f1b", 2, 4)[1], build_plan("1f1b", 2, 4, split_backward=True)[1]
    assert whole[schedule.last_gradient_action(whole)] == Action("B", 3)
    assert split[schedule.last_gradient_action(split)] == Action("W", 3)
    # stage 0 never splits
    stage0 = build_plan("gpipe", 2, 4, split_backward=True)[0]
    assert stage0[schedule.last_gradient_action(stage0)] == Action("B", 3)


def test_split_backward_two_stages_one_microbatch_exact_timeline():
    finish, _, timeline = schedule.simulate(build_plan("gpipe", 2, 1, split_backward=True), 1.0, 2.0, 1.0)
    assert [(start, end, repr(a)) for start, end, a in timeline[1]] == [(1, 2, "F0"), (2, 3, "B0"), (3, 4, "W0")]
    assert [(start, end, repr(a)) for start, end, a in timeline[0]] == [(0, 1, "F0"), (3, 5, "B0")]
    assert finish == 5.0  # 6 with the whole backward before the send


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 2)])
def test_live_activations_1f1b_bounded_by_stages_gpipe_grows_with_microbatches(p, m, split):
    gpipe = [schedule.peak_live_activations(a) for a in build_plan("gpipe", p, m, split)]
    one_f_one_b = [schedule.peak_live_activations(a) for a in build_plan("1f1b", p, m, split)]
    assert gpipe == [m] * p
    assert one_f_one_b == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_with_one_microbatch_1f1b_is_gpipe_action_for_action(p):
    # test_pipeline relies on this to run the m=1 cells on actors for GPipe only.
    assert [list(map(repr, a)) for a in build_plan("1f1b", p, 1)] == [list(map(repr, a)) for a in build_plan("gpipe", p, 1)]


def _swap(acts, i, j):
    acts = list(acts)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def test_checker_rejects_backward_before_forward():
    plan = build_plan("gpipe", 2, 2)
    last = plan[1]
    i, j = last.index(Action("F", 0)), last.index(Action("B", 0))
    with pytest.raises(PlanError, match=r"stage 1 .*B0.* comes before F0|comes before"):
        check_plan([plan[0], _swap(last, i, j)], 2)


def test_checker_rejects_missing_and_duplicate_actions():
    plan = build_plan("1f1b", 2, 2)
    with pytest.raises(PlanError, match="stage 0 is missing >F1"):
        check_plan([[a for a in plan[0] if a != Action(">F", 1)], plan[1]], 2)
    with pytest.raises(PlanError, match="appears twice"):
        check_plan([plan[0] + [Action("F", 0)], plan[1]], 2)


def test_checker_rejects_misplaced_weight_gradients():
    plan = build_plan("gpipe", 2, 2, split_backward=True)
    s1 = plan[1]
    i, j = s1.index(Action(">B", 0)), s1.index(Action("W", 0))
    with pytest.raises(PlanError, match=r"W0\) comes before >B0"):
        check_plan([plan[0], _swap(s1, i, j)], 2)
    # a micro-batch without W simply gets a whole backward on that stage
    check_plan([plan[0], [a for a in s1 if a != Action("W", 1)]], 2)
    with pytest.raises(PlanError, match="stage 0 has W actions"):
        check_plan([plan[0] + [Action("W", 0), Action("W", 1)], s1], 2)


def test_checker_finds_deadlock_and_marks_the_cell():
    # both stages receive before they send: a classic deadlock
    s0 = [Action("F", 0), Action("<B", 0), Action(">F", 0), Action("B", 0)]
    s1 = [Action("<F", 0), Action("F", 0), Action("B", 0), Action(">B", 0)]
    with pytest.raises(PlanError, match="deadlock") as err:
        check_plan([s0, s1], 1)
    assert "[<B0]" in str(err.value)  # the grid marks where stage 0 is stuck


def test_checker_rejects_receives_out_of_order():
    plan = build_plan("gpipe", 2, 2)
    s1 = list(plan[1])
    i, j = s1.index(Action("<F", 0)), s1.index(Action("<F", 1))
    s1[i], s1[j] = s1[j], s1[i]
    with pytest.raises(PlanError):
        check_plan([plan[0], s1], 2)


def test_grid_is_readable():
    grid = schedule.format_grid(build_plan("1f1b", 2, 2))
    assert grid.splitlines()[0].startswith("stage 0:") and "F0" in grid and ">B1" in grid
