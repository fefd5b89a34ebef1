"""The coordinator's state machine and every decision of its elastic policy, with fake workers:
no Ray, no processes, milliseconds per test. Real processes are killed in test_elastic.py."""

import pytest

from raytrain import checkpoint
from raytrain.control.coordinator import CapacityLost, Coordinator, NonFiniteLoss, StepFailed
from raytrain.control.policy import NO_DECISION, Action, ElasticPolicy
from raytrain.control.runstate import RunState
from raytrain.control.crew import Reservation
from tests.helpers import FakePlacement, FakeWorkerGroup, chain, fake_config, fake_prepared


def run(tmp_path, *overrides, dp=2, pp=1, group=None, extra=(), resume=None, on_start=None):
    cfg = fake_config(tmp_path, f"parallel.dp={dp}", f"parallel.pp={pp}", *overrides)
    group = group or FakeWorkerGroup(pp, initial=cfg.layout().world_size)
    coordinator = Coordinator(fake_prepared(cfg, pp, resume), Reservation(None, 0, tuple(extra)), worker_group=group)
    if on_start:
        on_start(coordinator, group)
    summary = coordinator.run(store=None)
    return coordinator, group, summary, coordinator.poll()


def events(rows, kind):
    return [r for r in rows if r.get("event") == kind]


def assert_every_live_worker_applied_each_step_once(coordinator, steps):
    members = coordinator.membership.members()
    assert members and all(m.handle.committed == steps for m in members)
    assert {m.handle.value for m in members} == {chain(range(steps))}


def test_a_fault_free_run_commits_every_step_once_and_checkpoints(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2")
    assert summary.committed_steps == list(range(6)) and summary.failures == 0
    assert [r["step"] for r in rows if "loss" in r and "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [2, 4, 6]
    assert coordinator.state.kind is RunState.FINISHED
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_loss_before_the_vote_retries_the_step_with_a_replacement(tmp_path):
    coordinator, group, summary, rows = run(tmp_path, "elastic.faults=['1:0@2:backward']")
    repair = events(rows, "repair")[0]
    assert repair["retrying_step"] == 2 and not repair["rolled_forward"]
    assert [d["decision"] for d in repair["decisions"]] == ["retry", "continue"]
    assert repair["new_layout"] == "dp=2 pp=1" and summary.failures == 1
    assert summary.committed_steps == list(range(6)) and group.spawned == 3
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_loss_after_the_vote_rolls_the_step_forward(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "parallel.dp=3", "train.global_batch=6",
                                        "elastic.faults=['0:0@3:optimizer']", dp=3)
    repair = events(rows, "repair")[0]
    assert repair["rolled_forward"] and repair["decisions"][0]["decision"] == "roll_forward"
    assert [r["step"] for r in rows if r.get("rolled_forward") is True and "event" not in r] == [4]
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_without_capacity_the_run_shrinks_to_min_dp(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "elastic.min_dp=1", "elastic.faults=['0:0@1:forward']",
                                        group=FakeWorkerGroup(1, initial=2, capacity=0))
    repair = events(rows, "repair")[0]
    assert repair["new_layout"] == "dp=1 pp=1" and "shrinks to dp=1" in repair["decisions"][1]["reason"]
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_below_min_dp_without_capacity_it_waits_then_gives_up_naming_the_key(tmp_path):
    with pytest.raises(CapacityLost, match="fewer than elastic.min_dp=2.*elastic.capacity_wait_s=0.2s"):
        run(tmp_path, "elastic.faults=['1:0@1:forward']", group=FakeWorkerGroup(1, initial=2, capacity=0))


def test_a_run_that_gives_up_first_saves_what_its_survivors_committed(tmp_path):
    with pytest.raises(CapacityLost, match="survivors saved every committed step to .*step_00000001"):
        run(tmp_path, "elastic.faults=['1:0@1:forward']", group=FakeWorkerGroup(1, initial=2, capacity=0))
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [1]


def test_a_run_that_gives_up_without_a_complete_live_state_saves_nothing(tmp_path):
    with pytest.raises(CapacityLost, match="no checkpoint was written yet"):
        run(tmp_path, "elastic.faults=['0:1@1:forward']", dp=1, pp=2)
    assert checkpoint.list_checkpoints(str(tmp_path / "ckpt")) == []


def test_a_stop_while_waiting_for_replacements_saves_from_the_live_replicas_at_once(tmp_path):
    class StopWhenReplacing(FakeWorkerGroup):
        def spawn(self, *args, **kwargs):
            if self.spawned >= 2:  # the replacement of the lost worker: a SIGTERM arrives meanwhile
                self.coordinator.request_stop("SIGTERM")
            return super().spawn(*args, **kwargs)

    group = StopWhenReplacing(1, initial=2, capacity=0)
    _, _, summary, rows = run(tmp_path, "elastic.capacity_wait_s=20", "elastic.faults=['1:0@1:forward']", group=group,
                              on_start=lambda coordinator, g: setattr(g, "coordinator", coordinator))
    assert summary.stopped == "SIGTERM" and summary.steps == 1
    assert "stopping" in events(rows, "repair")[0]["decisions"][-1]["reason"]
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [1]


def test_a_stage_without_a_live_copy_reloads_the_checkpoint(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "elastic.faults=['0:1@3:forward']", dp=1, pp=2)
    reload = events(rows, "reload")[0]
    assert reload["step"] == 2 and reload["steps_lost"] == 1 and reload["decision"] == "reload"
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_stage_lost_before_any_checkpoint_gives_up_naming_checkpoint_every(tmp_path):
    with pytest.raises(CapacityLost, match="no checkpoint to reload.*checkpoint.every"):
        run(tmp_path, "elastic.faults=['0:1@1:forward']", dp=1, pp=2)


def test_more_losses_than_max_failures_give_up(tmp_path):
    with pytest.raises(CapacityLost, match="more than elastic.max_failures=1"):
        run(tmp_path, "elastic.max_failures=1", "elastic.faults=['1:0@1:forward', '1:0@3:forward']")


def test_a_loss_while_saving_is_repaired_and_the_save_retried_in_a_new_directory(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "elastic.faults=['0:0@2:checkpoint']")
    assert events(rows, "repair")[0]["during"] == "checkpoint" and summary.failures == 1
    published = checkpoint.list_checkpoints(str(tmp_path / "ckpt"))
    assert [s for s, _ in published] == [2, 4, 6] and published[0][1].endswith("step_00000002.1")
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_worker_that_hangs_in_a_save_is_killed_and_replaced(tmp_path):
    group = FakeWorkerGroup(1, initial=2, capacity=1, hangs_in="save")
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", group=group)
    hung = group.workers[0]
    assert not hung.alive, "a worker declared lost must be killed: it holds the bundle its replacement needs"
    assert events(rows, "repair")[0]["during"] == "checkpoint" and summary.failures == 1
    assert group.spawned == 3 and coordinator.membership.dp == 2
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_loss_while_re_forming_is_a_second_failure(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "parallel.dp=3", "train.global_batch=6", "elastic.min_dp=1",
                                        "elastic.faults=['1:0@2:forward', '0:0@2:join']", dp=3)
    assert len(events(rows, "repair_failed")) == 1 and summary.failures == 2
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_granted_placement_grows_the_run_at_a_step_boundary(tmp_path):
    def grant_after_start(coordinator, group):
        group.granted_tokens.add("extra")

    coordinator, _, summary, rows = run(tmp_path, "elastic.max_dp=3", "train.global_batch=6", "elastic.grow_poll_s=0.001",
                                        extra=(FakePlacement("extra"),), on_start=grant_after_start)
    grow = events(rows, "grow")
    assert events(rows, "capacity") and len(grow) == 1 and grow[0]["decision"] == "grow"
    assert grow[0]["new_layout"] == "dp=3 pp=1" and len(coordinator.membership.members()) == 3
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_non_finite_steps_are_skipped_up_to_the_limit_then_the_run_stops(tmp_path):
    group = FakeWorkerGroup(1, initial=2, nonfinite_steps={1, 2, 3})
    with pytest.raises(NonFiniteLoss, match="step 4: .*train.skip_nonfinite=2"):
        run(tmp_path, "train.skip_nonfinite=2", group=group)
    assert {w.committed for w in group.workers} == {3}  # steps 2 and 3 counted, not applied
    assert {w.value for w in group.workers} == {chain(range(1))}


def test_a_worker_that_fails_to_start_is_a_step_failure(tmp_path):
    with pytest.raises(StepFailed, match="failed to start: ValueError: bad model"):
        run(tmp_path, group=FakeWorkerGroup(1, initial=2, init_error="bad model"))


def test_a_stop_request_ends_at_a_step_boundary_after_a_checkpoint(tmp_path):
    def stop_now(coordinator, group):
        coordinator.request_stop("SIGTERM")

    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=4", on_start=stop_now)
    assert summary.stopped == "SIGTERM" and summary.steps == 0
    assert events(rows, "stopped")[0]["checkpoint"].endswith("step_00000000")


def test_policy_decisions_are_plain_values():
    policy = ElasticPolicy(min_dp=2, target_dp=3, max_failures=1, capacity_wait_s=5.0, skip_nonfinite=0)
    assert policy.settle_step(3, [4, 3]).action is Action.ROLL_FORWARD
    assert policy.settle_step(3, [3, 3]).action is Action.RETRY
    assert policy.capacity(2, waited_s=0).action is Action.CONTINUE
    assert policy.capacity(1, waited_s=1).action is Action.WAIT
    assert policy.capacity(1, waited_s=6).config_key == "elastic.min_dp"
    # "Nothing to decide" is a decision of its own, never None.
    assert policy.after_failure(1) is NO_DECISION and policy.after_failure(2).config_key == "elastic.max_failures"
    assert policy.stale_stages([], None) is NO_DECISION
    assert policy.stale_stages(["stage 1"], "ckpt").action is Action.RELOAD
    assert policy.grow(3, 1) is NO_DECISION and policy.grow(2, 1).action is Action.GROW
    assert NO_DECISION.action is Action.NONE
    assert policy.nonfinite(0).action is Action.GIVE_UP


def test_a_background_save_is_published_once_its_shards_are_written_and_training_goes_on(tmp_path):
    waited = []

    def count_waits(coordinator, group):
        original = group.finish_save
        group.finish_save = lambda members: waited.append(len(members)) or original(members)

    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "checkpoint.async_save=true",
                                        on_start=count_waits)
    saves = events(rows, "checkpoint")
    assert [(e["step"], e["async"]) for e in saves] == [(2, True), (4, True), (6, False)]  # the last is waited for
    # Nothing waited on a write: each was published when the next step's reports said it was durable.
    assert waited == []
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [2, 4, 6]
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_saver_lost_mid_write_leaves_the_previous_checkpoint_latest_and_is_repaired(tmp_path):
    # The saver of replica 0 dies writing step 4's shard (during step 5): step 4 is never published.
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "checkpoint.async_save=true",
                                        "elastic.faults=['0:0@4:checkpoint']")
    abandoned = events(rows, "checkpoint_abandoned")
    assert [(e["step"], e["latest"].endswith("step_00000002")) for e in abandoned] == [(4, True)]
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [2, 6]
    torn = tmp_path / "ckpt" / "step_00000004"
    assert not (torn / "manifest.json").exists()
    assert summary.failures == 1 and summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_stop_request_waits_for_the_background_save_before_it_finishes(tmp_path):
    def stop_after_first_save(coordinator, group):
        original = group.start_save

        def start_then_stop(members, ckpt_dir):
            coordinator.request_stop("SIGTERM")
            return original(members, ckpt_dir)
        group.start_save = start_then_stop

    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "checkpoint.async_save=true",
                                        on_start=stop_after_first_save)
    assert summary.stopped == "SIGTERM" and summary.steps == 2
    assert [(e["step"], e["async"]) for e in events(rows, "checkpoint")] == [(2, True)]
    assert events(rows, "stopped")[0]["checkpoint"] == summary.checkpoint
    assert checkpoint.read_manifest(summary.checkpoint)["step"] == 2


def test_a_worker_told_to_leave_goes_at_the_step_boundary_with_no_step_redone(tmp_path):
    # replica 1 gets a SIGTERM in step 3 (the fourth): it commits, and its vote makes that step's end
    # the boundary; the step sent ahead of its reply is skipped by both workers, then run by the
    # re-formed dp=1 run
    coordinator, group, summary, rows = run(tmp_path, "elastic.min_dp=1", "elastic.faults=['1:0@3:sigterm']",
                                            "elastic.replace_at_notice=false",
                                            group=FakeWorkerGroup(1, initial=2, capacity=0))
    assert not any(hold for _, hold in group.holds) and group.elsewhere == 0
    drain = events(rows, "drain")[0]
    assert drain["step"] == 4 and drain["workers"] == ["replica 1 stage 0"] and drain["why"] == ["SIGTERM"]
    assert drain["new_layout"] == "dp=1 pp=1" and drain["deadline_s"] == 30.0
    assert 0 <= drain["notice_to_boundary_s"] <= drain["notice_to_step_s"]
    assert events(rows, "repair") == [] and summary.failures == 0  # nothing lost, nothing retried
    assert summary.committed_steps == list(range(6))
    assert [r["dp"] for r in rows if "loss" in r and "event" not in r] == [2, 2, 2, 2, 1, 1]
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_worker_told_to_leave_trains_on_until_its_replacement_is_up_and_the_run_never_narrows(tmp_path):
    # elastic.replace_at_notice (the default): replica 1's worker is told in step 2 and does not vote to
    # go; a replacement starts in a placement of its own, and once it is up the coordinator makes the
    # boundary itself (step 3, sent ahead, runs with the leaver): the run re-forms at dp=2 at step 4
    coordinator, group, summary, rows = run(tmp_path, "elastic.faults=['1:0@2:sigterm']")
    assert [e["worker"] for e in events(rows, "notice")] == ["replica 1 stage 0"]
    drain = events(rows, "drain")[0]
    assert (drain["step"], drain["new_layout"], drain["replaced_at_notice"]) == (4, "dp=2 pp=1", 1)
    assert group.cancelled == 0
    assert [r["dp"] for r in rows if "loss" in r and "event" not in r] == [2] * 6
    assert group.elsewhere == 1 and group.spawned == 3  # nothing started on the leaver's bundle
    assert all(hold for _, hold in group.holds)
    assert events(rows, "repair") == [] and summary.failures == 0 and summary.committed_steps == list(range(6))
    leaver = next(w for w in group.workers[:2] if w.draining is not None)
    assert not leaver.alive and leaver.pid not in summary.final_pids
    assert_every_live_worker_applied_each_step_once(coordinator, 6)
    coordinator.shutdown()
    assert group.closed  # the replacement's own placement group is given back


def test_a_replacement_not_up_before_the_deadline_nears_lets_the_worker_go_without_it(tmp_path):
    # no capacity for the replacement, and a notice shorter than the margin: the worker goes at the next
    # boundary the coordinator makes (the run shrinks, as elastic.min_dp=1 allows); the replacement
    # that did not start is cancelled, and one starts on the leaver's bundle instead, as without a notice
    coordinator, group, summary, rows = run(tmp_path, "elastic.min_dp=1", "elastic.faults=['1:0@3:sigterm']",
                                            group=FakeWorkerGroup(1, initial=2, capacity=0, notice_s=1.0))
    drain = events(rows, "drain")[0]
    assert (drain["step"], drain["new_layout"], drain["replaced_at_notice"]) == (5, "dp=1 pp=1", 0)
    assert [r["dp"] for r in rows if "loss" in r and "event" not in r] == [2, 2, 2, 2, 2, 1]
    assert (group.elsewhere, group.cancelled, group.spawned) == (1, 1, 4)
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_worker_told_to_leave_goes_at_once_when_a_standby_waits(tmp_path):
    # a standby replica takes the slot at the boundary its vote makes: no step is held, nothing started
    group = FakeWorkerGroup(1, initial=3, capacity=0)
    group.granted_tokens.add("standby")
    coordinator, group, summary, rows = run(tmp_path, "elastic.standby=1", "elastic.faults=['1:0@2:sigterm']",
                                            group=group, extra=(FakePlacement("standby"),))
    drain = events(rows, "drain")[0]
    assert (drain["step"], drain["new_layout"], drain["replaced_at_notice"]) == (3, "dp=2 pp=1", 0)
    assert not any(hold for step, hold in group.holds if step <= 2) and group.elsewhere == 0
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


@pytest.mark.parametrize("replace_at_notice, boundary", [(False, 3), (True, 4)])
def test_a_drain_with_replacements_waits_for_one_and_a_last_copy_saves_first(tmp_path, replace_at_notice, boundary):
    # dp=1 x pp=2: stage 1's only copy leaves: it saves at the boundary, its replacement reloads that;
    # the boundary is the end of the step it was told in, or (its replacement started at the notice)
    # of the step sent ahead, which it runs
    coordinator, group, summary, rows = run(tmp_path, "elastic.faults=['0:1@2:sigterm']",
                                            f"elastic.replace_at_notice={str(replace_at_notice).lower()}", dp=1, pp=2)
    drain = events(rows, "drain")[0]
    assert drain["workers"] == ["replica 0 stage 1"] and drain["new_layout"] == "dp=1 pp=2"
    assert drain["replaced_at_notice"] == int(replace_at_notice) and group.elsewhere == int(replace_at_notice)
    assert [e["step"] for e in events(rows, "checkpoint")][:1] == [boundary]
    assert [(e["step"], e["steps_lost"]) for e in events(rows, "reload")] == [(boundary, 0)]
    assert summary.committed_steps == list(range(6)) and summary.failures == 0 and group.spawned == 3
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


@pytest.mark.parametrize("replace_at_notice, steps", [(False, 3), (True, 4)])
def test_when_every_worker_is_told_to_leave_the_run_saves_and_stops(tmp_path, replace_at_notice, steps):
    # without replace_at_notice their vote makes the step they were told in the last; with it, the
    # step sent ahead (held) runs too, and no replacement starts
    coordinator, group, summary, rows = run(tmp_path, "elastic.faults=['0:0@2:sigterm', '1:0@2:sigterm']",
                                            f"elastic.replace_at_notice={str(replace_at_notice).lower()}")
    assert summary.stopped == "SIGTERM" and summary.steps == steps and group.elsewhere == 0
    assert checkpoint.read_manifest(summary.checkpoint)["step"] == steps
    assert "checkpoint and stop" in events(rows, "drain")[0]["reason"]


def test_a_standby_replica_takes_a_lost_workers_place_at_once(tmp_path):
    # elastic.standby=1: a third replica's worker starts with the run and waits; when replica 1's worker
    # dies the run is back at dp=2 in the same repair, with no replacement started yet (none can start)
    group = FakeWorkerGroup(1, initial=3, capacity=0)
    group.granted_tokens.add("standby")  # the driver asked for its placement with the run's
    coordinator, group, summary, rows = run(tmp_path, "elastic.standby=1", "elastic.faults=['1:0@2:backward']",
                                            group=group, extra=(FakePlacement("standby"),))
    started = events(rows, "started")[0]
    assert started["replicas"] == 2 and len(started["standby"]) == 1 and len(summary.worker_pids) == 2
    repair = events(rows, "repair")[0]
    assert repair["new_layout"] == "dp=2 pp=1" and repair["retrying_step"] == 2
    assert started["standby"][0] in summary.final_pids and summary.failures == 1
    assert [r["dp"] for r in rows if "loss" in r and "event" not in r] == [2] * 6
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_standby_without_a_free_slot_is_said_and_starts_when_its_slot_is_granted(tmp_path):
    # elastic.standby=1 on a cluster without room for it: the run says so at the start and trains at
    # dp=2; the standby's placement granted later starts a worker, which waits for a loss to take its slot
    def grant_after_start(coordinator, group):
        group.granted_tokens.add("standby")

    coordinator, _, summary, rows = run(tmp_path, "elastic.standby=1", "elastic.grow_poll_s=0.001",
                                        extra=(FakePlacement("standby"),), on_start=grant_after_start)
    assert events(rows, "started")[0]["standby"] == []
    (waiting,) = events(rows, "standby_waiting")
    assert (waiting["standby"], waiting["started"]) == (1, 0) and "no free slot" in waiting["reason"]
    assert events(rows, "capacity") and not events(rows, "grow")
    assert len(coordinator.membership.members()) == 2 and len(coordinator.membership.pending) == 1
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


class StandbyToldToLeave(FakeWorkerGroup):
    """When step ``at`` is sent, the standby's heartbeat says it was told to leave, and ``why``."""

    def __init__(self, at: int, why: str, **kwargs):
        super().__init__(1, **kwargs)
        self.at, self.why, self.coordinator, self.told = at, why, None, []

    def send_step(self, members, step, trace, hold=False):
        if step == self.at and not self.told:
            spares = self.coordinator.membership.spares
            self.told = [m.pid for m in spares]
            for m in spares:
                self.coordinator.beat(m.beat_id, leaving=self.why)
        return super().send_step(members, step, trace, hold)


@pytest.mark.parametrize("why, elsewhere", [("SIGTERM", 0), ("node drain", 1)])
def test_a_standby_told_to_leave_goes_at_once_and_another_starts_in_its_place(tmp_path, why, elsewhere):
    # a standby runs no steps, so its heartbeat carries the notice: it is let go at the next boundary,
    # with an event, instead of taking a slot only to leave it; another starts on its bundle, or in a
    # placement group of its own when the standby's node drains (its bundle is there)
    group = StandbyToldToLeave(2, why, initial=3)
    group.granted_tokens.add("standby")
    coordinator, group, summary, rows = run(tmp_path, "elastic.standby=1", group=group,
                                            extra=(FakePlacement("standby"),),
                                            on_start=lambda coordinator, group: setattr(group, "coordinator", coordinator))
    (left,) = events(rows, "standby_left")
    assert left["pids"] == group.told and len(group.told) == 1 and left["step"] in (2, 3)
    assert group.spawned == 4 and group.elsewhere == elsewhere
    assert not any(w.alive for w in group.workers if w.pid in group.told)
    assert summary.failures == 0 and summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_worker_told_to_leave_trains_on_for_as_long_as_its_replacement_takes_to_start(tmp_path):
    # told in step 2, noticed once step 3 was sent ahead; its replacement is up only once 4 more steps
    # (4-7) were sent: the told worker trains through them at dp=2, and goes at the end of step 7
    group = FakeWorkerGroup(1, initial=2, elsewhere_delay=4)
    coordinator, group, summary, rows = run(tmp_path, "train.steps=12", "elastic.faults=['1:0@2:sigterm']",
                                            group=group)
    drain = events(rows, "drain")[0]
    assert (drain["step"], drain["replaced_at_notice"], drain["new_layout"]) == (8, 1, "dp=2 pp=1")
    assert [r["dp"] for r in rows if "loss" in r and "event" not in r] == [2] * 12
    assert all(hold for step, hold in group.holds if step < 8) and group.cancelled == 0
    assert_every_live_worker_applied_each_step_once(coordinator, 12)


def test_a_worker_lost_before_its_boundary_is_repaired_and_its_replacement_not_yet_up_cancelled(tmp_path):
    # told in step 2, killed in step 4's backward while its replacement still starts: a repair (step 4
    # retried); the replacement elsewhere is cancelled and one starts on the lost worker's bundle
    group = FakeWorkerGroup(1, initial=2, elsewhere_delay=50)
    coordinator, group, summary, rows = run(tmp_path, "train.steps=8",
                                            "elastic.faults=['1:0@2:sigterm', '1:0@4:backward']", group=group)
    assert events(rows, "drain") == [] and [e["step"] for e in events(rows, "repair")] == [4]
    assert (group.elsewhere, group.cancelled, group.spawned) == (1, 1, 4)
    assert summary.committed_steps == list(range(8)) and summary.failures == 1
    assert_every_live_worker_applied_each_step_once(coordinator, 8)


def test_when_the_last_worker_is_told_to_leave_the_replacements_still_starting_are_cancelled(tmp_path):
    # replica 1 is told in step 2 (its replacement starts), replica 0 in step 3: every worker leaves, so
    # the run saves and stops, and the replacement that never came up is cancelled
    group = FakeWorkerGroup(1, initial=2, elsewhere_delay=50)
    coordinator, group, summary, rows = run(tmp_path, "train.steps=8",
                                            "elastic.faults=['1:0@2:sigterm', '0:0@3:sigterm']", group=group)
    assert summary.stopped == "SIGTERM" and "checkpoint and stop" in events(rows, "drain")[0]["reason"]
    assert (group.elsewhere, group.cancelled) == (1, 1)


def test_a_worker_told_to_leave_whose_replica_breaks_meanwhile_is_let_go_as_a_spare(tmp_path):
    # dp=2 x pp=2: replica 1's stage 0 is told in step 2 (its replacement starts), its stage 1 dies in
    # step 4 and no worker can start: the replica breaks and the told worker waits as a spare; it is let
    # go then (no boundary is left to make for it), and dp=1 goes on to the end with every step once
    group = FakeWorkerGroup(2, initial=4, capacity=0)
    coordinator, group, summary, rows = run(tmp_path, "train.steps=10", "elastic.min_dp=1",
                                            "elastic.faults=['1:0@2:sigterm', '1:1@4:backward']",
                                            dp=2, pp=2, group=group)
    told = next(w for w in group.workers[:4] if w.draining is not None)
    assert not told.alive and events(rows, "drain") == [] and len(events(rows, "repair")) == 1
    assert summary.committed_steps == list(range(10))
    assert_every_live_worker_applied_each_step_once(coordinator, 10)
