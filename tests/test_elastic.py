"""Elastic training: workers SIGKILLed mid-step; survivors repair in place; same math, nothing twice."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from raytrain import checkpoint, train
from raytrain.control.coordinator import may_send_ahead
from tests.helpers import (LONG_RUN_LR, TEST_RAY_CPUS, WhenPaused, assert_replicas_identical, assert_same_params,
                           hold_at_the_notice_until_its_replacement_starts, hold_until_a_new_worker_starts, pid_alive,
                           reference_state)
from tests.test_loggers import tensorboard_scalars


PHASE_FAULTS = {
    # replica:stage@step:phase -- step is 0-based; a checkpoint fault names the checkpoint's step,
    # and only replica 0 writes checkpoints.
    "forward": "1:0@2:forward",
    "backward": "2:0@2:backward",
    "allreduce": "1:0@3:allreduce",
    "optimizer": "0:0@2:optimizer",
    "checkpoint": "0:0@3:checkpoint",
}
KILLED_RANK = {"forward": 1, "backward": 2, "allreduce": 1, "optimizer": 0, "checkpoint": 0}


def _assert_exactly_once(result, steps, global_batch, pp=1, tp=1):
    """Every step committed once, every sample seen once, and every replica of a stage identical."""
    assert result.committed_steps == list(range(steps))
    assert [r["step"] for r in result.metrics] == list(range(1, steps + 1))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert len(ids) == steps * global_batch and len(set(ids)) == len(ids)  # less than an epoch: all distinct
    assert_replicas_identical(result, replicas=len(result.final_pids) // (pp * tp))


def test_next_step_is_sent_ahead_only_when_nothing_happens_in_between():
    assert may_send_ahead(4, steps=10, checkpoint_every=5, membership_changing=False)
    assert not may_send_ahead(5, steps=10, checkpoint_every=5, membership_changing=False)  # checkpoint after step 5
    assert not may_send_ahead(10, steps=10, checkpoint_every=0, membership_changing=False)  # the run is over
    assert may_send_ahead(9, steps=10, checkpoint_every=0, membership_changing=False)
    assert not may_send_ahead(4, steps=10, checkpoint_every=0, membership_changing=True)  # a replica may join


@pytest.mark.parametrize("phase", list(PHASE_FAULTS))
def test_dp3_survives_a_kill_in_each_phase(ray_session, make_config, phase):
    cfg = make_config("parallel.dp=3", "train.global_batch=6", "train.steps=6", "checkpoint.every=3",
                      "elastic.min_dp=2", f"elastic.faults=['{PHASE_FAULTS[phase]}']", "run.record_samples=true",
                      "elastic.detect_timeout_s=20")
    result = train(cfg)
    assert result.failures == 1, result.events
    repair = [e for e in result.events if e["event"] == "repair"]
    assert len(repair) == 1 and repair[0]["repair_s"] < 30
    killed = result.worker_pids[KILLED_RANK[phase]]
    assert not pid_alive(killed)
    survivors = [p for p in result.worker_pids if p != killed]
    assert set(survivors) <= set(result.final_pids), "a survivor was restarted"
    _assert_exactly_once(result, 6, 6)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    # every checkpoint due was published, including one due right after a rolled-forward step
    assert [s for s, _ in checkpoint.list_checkpoints(cfg_dir(result))] == [3, 6]
    if phase == "checkpoint":
        # the torn save of step 3 was retried after the repair into a new directory and published whole
        step3 = dict(checkpoint.list_checkpoints(cfg_dir(result)))[3]
        assert step3.endswith("step_00000003.1") and checkpoint.read_manifest(step3)["step"] == 3
        checkpoint.load_shards(step3)


def test_starts_at_max_dp_when_the_cluster_has_room(ray_session, make_config):
    cfg = make_config("parallel.dp=1", "elastic.max_dp=3", "train.global_batch=6", "train.steps=4",
                      "run.record_samples=true")
    result = train(cfg)
    started = next(e for e in result.events if e["event"] == "started")
    assert started["replicas"] == 3 and len(result.worker_pids) == 3
    assert {r["layout"] for r in result.metrics} == {"dp=3 pp=1"}
    _assert_exactly_once(result, 4, 6)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_grows_beyond_its_starting_size_when_another_job_frees_resources(ray_session, make_config, fast_driver_poll):
    # Another job holds all but one CPU slot, so the run starts with dp=1. When that job ends, the
    # run's request for a second replica (its own placement group) is granted, and the new worker
    # joins at a step boundary, receiving the state by broadcast. (Shrinking on a lost node and
    # growing back when a node joins: tests/test_nodes.py.) The worker pauses twice, so the test
    # acts at known steps: at step 3 the other job ends (the run resumes once Ray granted its
    # request, so the step-3 boundary sees it), at step 6 the run waits for the new worker to start.
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    other_job = placement_group([{"CPU": TEST_RAY_CPUS - 1}])
    assert other_job.wait(timeout_seconds=30)
    cfg = make_config("parallel.dp=1", "elastic.max_dp=2", "elastic.grow_poll_s=0.5", "train.steps=10",
                      "run.record_samples=true", "elastic.faults=['0:0@3:pause', '0:0@6:pause']")

    def end_the_other_job(paused, started):
        remove_placement_group(other_job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(
                pg["state"] == "CREATED" for pg in ray.util.placement_group_table().values()) < 2:
            time.sleep(0.05)  # the run's own group and its request for a second replica
        time.sleep(cfg.elastic.grow_poll_s)  # the run's next look at its requests is due by now
        os.kill(paused[0], signal.SIGCONT)

    def resume_once_the_new_worker_started(paused, started):
        seen["new"] = hold_until_a_new_worker_starts([], set(started["pids"]))
        os.kill(paused[0], signal.SIGCONT)

    seen = {}
    try:
        with WhenPaused(1, end_the_other_job, resume_once_the_new_worker_started) as watcher:
            result = train(cfg, on_rows=watcher.on_rows)
    finally:
        remove_placement_group(other_job)
    events = [e["event"] for e in result.events]
    assert watcher.acted and events.count("capacity") == 1 and events.count("grow") == 1, events
    assert result.failures == 0
    layouts = [r["layout"] for r in result.metrics]
    assert layouts[0] == "dp=1 pp=1" and layouts[-1] == "dp=2 pp=1"
    assert result.worker_pids[0] in result.final_pids and seen["new"] in result.final_pids
    assert len(result.final_pids) == 2
    _assert_exactly_once(result, 10, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_default_policy_replaces_in_place_without_shrinking(ray_session, make_config):
    # min_dp defaults to dp: the run waits for the replacement, which gets its state from a live peer.
    cfg = make_config("parallel.dp=2", "train.steps=6", "elastic.faults=['1:0@2:forward']", "run.record_samples=true")
    result = train(cfg)
    repair = next(e for e in result.events if e["event"] == "repair")
    assert repair["new_layout"] == "dp=2 pp=1" and repair["retrying_step"] == 2
    assert set(r["layout"] for r in result.metrics) == {"dp=2 pp=1"}
    assert result.worker_pids[0] in result.final_pids and result.worker_pids[1] not in result.final_pids
    _assert_exactly_once(result, 6, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def cfg_dir(result):
    return os.path.dirname(result.checkpoint)


def test_kill_from_outside_by_pid(ray_session, make_config, fast_driver_poll):
    # Both workers stop themselves at step 3 (pause faults); the test SIGKILLs replica 1 from outside
    # and resumes replica 0, which finds its peer gone, repairs and finishes alone then with a replacement.
    cfg = make_config("parallel.dp=2", "train.steps=8", "elastic.min_dp=1", "run.record_samples=true",
                      "elastic.faults=['0:0@3:pause', '1:0@3:pause']", "run.loggers=['tensorboard']")

    def kill_replica_1(paused, started):
        survivor, victim = started["pids"]
        assert sorted(paused) == sorted([survivor, victim])
        os.kill(victim, signal.SIGKILL)
        os.kill(survivor, signal.SIGCONT)

    with WhenPaused(2, kill_replica_1, after_step=3) as watcher:
        result = train(cfg, on_rows=watcher.on_rows)
    assert watcher.acted and result.failures == 1
    assert result.worker_pids[0] in result.final_pids and result.worker_pids[1] not in result.final_pids
    _assert_exactly_once(result, 8, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    # goodput: the accounts sum to the wall time from the launch; the kill shows as detection and
    # re-forming, the workers' start as start-up; the summary and metrics.jsonl carry them
    goodput = result.goodput
    assert goodput["good_s"] + sum(goodput["badput_s"].values()) == pytest.approx(goodput["wall_s"], rel=0.02)
    assert 0 < goodput["goodput"] < 1 and goodput["badput_s"]["start_up"] > 1.0
    assert goodput["badput_s"]["detection"] + goodput["badput_s"]["work_redone"] > 0
    assert goodput["badput_s"]["re_forming"] > 0
    assert result.summary()["goodput"] == goodput["goodput"]
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f][-1] == {"event": "goodput", **goodput}
    scalars = tensorboard_scalars(Path(result.run_dir))  # run.loggers: the same rows in TensorBoard
    assert [s for s, _ in scalars["loss"]] == list(range(1, 9)) and scalars["events/repair"] == [(3, 1.0)]
    assert scalars["goodput"] == [(8, pytest.approx(goodput["goodput"]))]


@pytest.mark.parametrize("layout", [("parallel.dp=2",), ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2")],
                         ids=["dp2", "dp2-pp2"])
def test_a_sigtermed_worker_drains_at_a_step_boundary_with_no_step_redone(ray_session, make_config, layout):
    # replica 1's stage-0 worker gets a SIGTERM in step 3: a notice, not a crash. It finishes its steps,
    # the run shrinks without it at the boundary (its replica's other workers wait as spares), and
    # nothing is retried, counted as a failure or waited for.
    cfg = make_config(*layout, "train.steps=8", "elastic.min_dp=1", "run.record_samples=true",
                      "elastic.replace_at_notice=false", "elastic.faults=['1:0@3:sigterm']")
    result = train(cfg)
    pp = cfg.parallel.pp
    (drain,) = [e for e in result.events if e["event"] == "drain"]
    # its vote in step 3 makes that step's end the boundary: the step sent ahead is skipped, not redone
    assert drain["workers"] == ["replica 1 stage 0"] and drain["why"] == ["SIGTERM"] and drain["step"] == 4
    assert drain["new_layout"].startswith("dp=1") and drain["notice_to_boundary_s"] < drain["notice_to_step_s"] < 30
    assert not [e for e in result.events if e["event"] in ("repair", "reload")] and result.failures == 0
    assert result.worker_pids[:pp] == result.final_pids  # replica 0's workers were never restarted
    _assert_exactly_once(result, 8, 8, pp=pp)
    assert [r["dp"] for r in result.metrics] == [2] * 4 + [1] * 4
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_sigtermed_worker_trains_on_until_its_replacement_is_up_and_the_run_never_narrows(ray_session, make_config,
                                                                                          fast_driver_poll):
    # elastic.replace_at_notice (the default) at dp=2: replica 1's worker, told in step 3, keeps training
    # while a replacement starts in a placement group of its own; once that is up the worker goes at a
    # step boundary and the replacement takes its place with replica 0's state: every step at dp=2, no
    # repair, replica 0 never restarted, and the replacement's placement group given back at the end
    from ray.util import placement_group_table

    def live_placements() -> int:
        return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")

    before = live_placements()
    steps, seen = 40, {}
    cfg = make_config("parallel.dp=2", f"train.steps={steps}", "run.record_samples=true", "run.trace_steps=0",
                      "elastic.faults=['1:0@3:sigterm']")
    result = train(cfg, on_rows=hold_at_the_notice_until_its_replacement_starts(seen))
    (notice,) = [e for e in result.events if e["event"] == "notice"]
    (drain,) = [e for e in result.events if e["event"] == "drain"]
    assert notice["worker"] == "replica 1 stage 0" and notice["step"] == 4
    assert drain["replaced_at_notice"] == 1 and drain["new_layout"] == "dp=2 pp=1" and drain["step"] > 4
    assert not [e for e in result.events if e["event"] in ("repair", "reload")] and result.failures == 0
    assert [r["dp"] for r in result.metrics] == [2] * steps
    assert result.worker_pids[0] == result.final_pids[0] and result.final_pids[1] == seen["new"]
    _assert_exactly_once(result, steps, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    assert live_placements() == before
    # a lost coordinator cannot give its replacements' placement groups back: the driver removes them by name
    from ray.util.placement_group import placement_group

    from raytrain.control.workergroup import remove_replacement_placements, replacement_prefix

    orphan = placement_group([{"CPU": 1}], name=f"{replacement_prefix(cfg)}12345-0")
    assert orphan.wait(timeout_seconds=30) and live_placements() == before + 1
    remove_replacement_placements(replacement_prefix(cfg))
    deadline = time.monotonic() + 10
    while live_placements() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_placements() == before


def test_a_notice_shorter_than_a_step_leaves_at_once_and_the_run_repairs_it(ray_session, make_config):
    # elastic.drain_grace_s=0.001: no step ends within the notice, so the worker leaves as it arrives
    # (in step 3's forward) instead of being cut mid-step at its deadline; the run repairs the loss.
    cfg = make_config("parallel.dp=2", "train.steps=6", "elastic.min_dp=1", "elastic.drain_grace_s=0.001",
                      "elastic.faults=['1:0@3:sigterm']")
    result = train(cfg)
    assert not [e for e in result.events if e["event"] == "drain"]
    (repair,) = [e for e in result.events if e["event"] == "repair"]
    # it dies as step 3 starts; its reply to step 2 may not have reached the coordinator by then
    assert repair["lost"] == ["replica 1 stage 0"] and repair["step"] in (2, 3), repair
    assert result.committed_steps == list(range(6)) and result.worker_pids[0] in result.final_pids
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_killed_worker_of_two_chunks_breaks_its_replica_and_the_run_goes_on_exactly_once(ray_session, make_config):
    # Zero-bubble V at dp=2 x pp=2: each worker holds two chunks (worker 0 the first and the last stage).
    # Replica 1's worker 1 dies in step 3's backward: its replica is broken (its worker 0 waits as a
    # spare), the run shrinks to dp=1 at once (min_dp=1); replica 0 keeps its processes.
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zbv",
                      "parallel.virtual_stages=2", "train.steps=6", "elastic.min_dp=1", "run.record_samples=true",
                      "elastic.faults=['1:1@3:backward']")
    result = train(cfg)
    assert result.failures == 1 and [e["event"] for e in result.events].count("repair") == 1, result.events
    assert not pid_alive(result.worker_pids[3])  # rank 3: replica 1, stage 1
    assert set(result.worker_pids[:2]) <= set(result.final_pids), "a survivor was restarted"
    (repair,) = [e for e in result.events if e["event"] == "repair"]
    assert repair["new_layout"] == "dp=1 pp=2" and repair["lost"] == ["replica 1 stage 1"], repair
    _assert_exactly_once(result, 6, 8, pp=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_standby_worker_takes_a_killed_workers_place_without_waiting_for_a_start(ray_session, make_config):
    # elastic.standby=1 starts a third worker that waits; replica 1's worker is killed in step 3 and
    # the standby takes its slot in the same repair (default policy: never below dp=2), its state
    # broadcast from replica 0; the replacement started for the dead one becomes the next standby
    cfg = make_config("parallel.dp=2", "train.steps=8", "elastic.standby=1", "run.record_samples=true",
                      "elastic.faults=['1:0@3:backward']")
    result = train(cfg)
    started = next(e for e in result.events if e["event"] == "started")
    (repair,) = [e for e in result.events if e["event"] == "repair"]
    assert len(started["standby"]) == 1 and repair["new_layout"] == "dp=2 pp=1"
    assert started["standby"][0] in result.final_pids and result.worker_pids[0] in result.final_pids
    assert [r["dp"] for r in result.metrics] == [2] * 8
    _assert_exactly_once(result, 8, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_standby_sent_sigterm_is_let_go_at_once_and_another_starts_in_its_place(ray_session, make_config,
                                                                                 fast_driver_poll):
    # a standby runs no steps: its heartbeat carries the notice, and the run lets it go with an event
    # instead of keeping a standby that leaves when its grace period ends (or after taking a slot)
    steps = 600  # a few seconds: the notice reaches the coordinator with the standby's next beat (each second)
    cfg = make_config("parallel.dp=1", "elastic.standby=1", f"train.steps={steps}", LONG_RUN_LR, "run.trace_steps=0")
    told = {}

    def on_rows(rows):
        for row in rows:
            if row.get("event") == "started":
                told["pid"] = row["standby"][0]
                os.kill(told["pid"], signal.SIGTERM)

    result = train(cfg, on_rows=on_rows)
    (left,) = [e for e in result.events if e["event"] == "standby_left"]
    assert left["pids"] == [told["pid"]] and not pid_alive(told["pid"]), left
    assert not [e for e in result.events if e["event"] in ("repair", "drain")] and result.failures == 0
    assert result.committed_steps == list(range(steps)) and result.final_pids == result.worker_pids[:1]


def test_dp2_tp2_a_tp_worker_killed_from_outside_takes_its_replica_which_is_replaced(ray_session, make_config,
                                                                                       fast_driver_poll):
    # All four workers stop themselves at step 3 (a pause fault names a replica's stage: both its tp
    # ranks); the test SIGKILLs tp rank 1 of replica 1 from outside and resumes the rest. Replica 1 is
    # broken, and (min_dp defaults to dp) the run waits for a replacement, which re-forms replica 1
    # with its surviving tp rank, taking the state from replica 0; no survivor restarts.
    cfg = make_config("parallel.dp=2", "parallel.tp=2", "resources.placement_strategy=STRICT_PACK", "train.steps=6",
                      "run.record_samples=true", "elastic.faults=['0:0@3:pause', '1:0@3:pause']")

    def kill_tp_rank_1_of_replica_1(paused, started):
        pids = started["pids"]  # by rank: (replica 0, tp 0), (0, 1), (1, 0), (1, 1)
        assert sorted(paused) == sorted(pids)
        os.kill(pids[3], signal.SIGKILL)
        for pid in pids[:3]:
            os.kill(pid, signal.SIGCONT)

    with WhenPaused(4, kill_tp_rank_1_of_replica_1, after_step=3) as watcher:
        result = train(cfg, on_rows=watcher.on_rows)
    repairs = [e for e in result.events if e["event"] == "repair"]
    assert watcher.acted and result.failures == 1 and len(repairs) == 1, result.events
    assert repairs[0]["new_layout"] == "dp=2 tp=2 pp=1" and repairs[0]["retrying_step"] == 3, repairs
    assert repairs[0]["lost"] == ["replica 1 shard 0 stage 0 tp 1"], repairs
    assert not pid_alive(result.worker_pids[3])
    assert set(result.worker_pids[:3]) <= set(result.final_pids), "a survivor was restarted"
    assert len(result.final_pids) == 4
    _assert_exactly_once(result, 6, 8, tp=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_hybrid_dp2_pp2_replaces_a_dead_stage_worker(ray_session, make_config, fast_driver_poll):
    # min_dp=1: replica 1 is dropped at once (its stage-0 worker waits as a spare), training goes on
    # with dp=1, and when the replacement for stage 1 is up, the spare and it re-form replica 1. The
    # survivor pauses at step 4 until the replacement has started, so the run cannot end first.
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "train.steps=8",
                      "elastic.min_dp=1", "elastic.faults=['1:1@2:backward', '0:0@4:pause']", "run.record_samples=true")

    def resume_once_the_replacement_started(paused, started):
        hold_until_a_new_worker_starts([], set(started["pids"]))
        for pid in paused:
            os.kill(pid, signal.SIGCONT)

    with WhenPaused(1, resume_once_the_replacement_started) as watcher:
        result = train(cfg, on_rows=watcher.on_rows)
    events = [e["event"] for e in result.events]
    assert watcher.acted and result.failures == 1 and events.count("grow") == 1, events
    killed = result.worker_pids[3]  # rank 3 = replica 1, stage 1
    assert not pid_alive(killed)
    assert set(p for p in result.worker_pids if p != killed) <= set(result.final_pids), "a survivor was restarted"
    assert len(result.final_pids) == 4
    assert result.committed_steps == list(range(8))
    assert_replicas_identical(result, replicas=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_three_failures_in_one_run(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "train.steps=9", "run.record_samples=true",
                      "elastic.faults=['1:0@1:backward', '0:0@4:forward', '1:0@6:optimizer']")
    result = train(cfg)
    assert result.failures == 3, [e for e in result.events if e["event"] in ("repair", "grow")]
    _assert_exactly_once(result, 9, 8)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_failure_during_repair(ray_session, make_config):
    # replica 1 dies at step 2; while the survivors re-form, the new replica 0 dies too.
    cfg = make_config("parallel.dp=3", "train.global_batch=6", "train.steps=5", "elastic.min_dp=1",
                      "elastic.detect_timeout_s=5", "run.record_samples=true",
                      "elastic.faults=['1:0@2:forward', '0:0@2:join']")
    result = train(cfg)
    events = [e["event"] for e in result.events]
    assert "repair_failed" in events and result.failures == 2, events
    _assert_exactly_once(result, 5, 6)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_coordinator_killed_mid_run_resumes_from_last_checkpoint(ray_session, make_config, fast_driver_poll):
    # Both workers pause at step 10; the test kills the coordinator (its workers go with it); the
    # driver starts a new one from the step-8 checkpoint, whose workers pass step 10 again.
    cfg = make_config("parallel.dp=2", "train.steps=12", "checkpoint.every=4", "run.record_samples=true",
                      "elastic.faults=['0:0@10:pause', '1:0@10:pause']")

    def kill_the_coordinator(paused, started):
        os.kill(started["coordinator_pid"], signal.SIGKILL)
        for pid in paused:
            os.kill(pid, signal.SIGCONT)

    with WhenPaused(2, kill_the_coordinator, after_step=10) as watcher:
        result = train(cfg, on_rows=watcher.on_rows)
    assert watcher.acted and result.coordinator_restarts == 1
    restart = next(e for e in result.events if e["event"] == "coordinator_restarted")
    assert restart["resume_from"].endswith("step_00000008")
    assert [r["step"] for r in result.metrics] == list(range(1, 13))
    assert_replicas_identical(result, replicas=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_pipeline_without_a_surviving_stage_reloads_the_checkpoint(ray_session, make_config):
    cfg = make_config("parallel.pp=2", "parallel.microbatches=2", "train.steps=6", "checkpoint.every=2",
                      "elastic.faults=['0:1@3:forward']", "run.record_samples=true")
    result = train(cfg)
    reloads = [e for e in result.events if e["event"] == "reload"]
    assert len(reloads) == 1 and reloads[0]["step"] == 2 and reloads[0]["steps_lost"] == 1
    _assert_exactly_once(result, 6, 8, pp=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_frozen_worker_is_found_by_its_silent_heartbeat_killed_its_slot_freed_and_the_run_repairs(
        ray_session, make_config):
    """A worker stopped with SIGSTOP (a hung process, a paused VM) stops beating (raytrain.control.liveness): at
    the start of a step, in its data read, or while its peers all-reduce without it; one run freezes a worker
    in each of the three, two steps apart. Once it has been silent for elastic.detect_timeout_s it is declared
    hung in any of them, its process is killed so its CPU comes back, and a replacement takes its place on the
    full cluster (dp=2 x fsdp=2 uses all of it)."""
    freezes = ["pause", "freeze_data", "freeze_allreduce"]  # between steps, in a data read, in a collective
    cfg = make_config("parallel.dp=2", "parallel.fsdp=2", "train.steps=8", "run.record_samples=true",
                      "elastic.detect_timeout_s=5", "resources.step_timeout_s=120", "elastic.capacity_wait_s=60",
                      f"elastic.faults={[f'1:1:0@{2 + 2 * i}:{phase}' for i, phase in enumerate(freezes)]}")
    assert 4 == TEST_RAY_CPUS  # each replacement needs the frozen worker's CPU
    started = time.monotonic()
    result = train(cfg)
    assert time.monotonic() - started < 150, "detection waited for resources.step_timeout_s"
    assert result.failures == 3
    repairs = [e for e in result.events if e["event"] == "repair"]
    assert [e["step"] for e in repairs] == [2, 4, 6], repairs
    frozen = [h["pid"] for e in repairs for h in e["hung"]]  # the first a starting worker, then replacements
    assert len(set(frozen)) == 3 and frozen[0] in result.worker_pids and not any(pid_alive(p) for p in frozen)
    rows = {r["step"]: r for r in result.metrics}
    for phase, repair in zip(freezes, repairs):
        assert [h["worker"] for h in repair["hung"]] == ["replica 1 shard 1 stage 0"], (phase, repair)
        assert 5 <= repair["hung"][0]["silent_s"] < 5 + 4, (phase, repair)  # detect_timeout_s, a beat and a poll
        stalled_s = repair["detected_at"] - rows[repair["step"]]["time"]  # from the last step before the frozen one
        assert stalled_s < 5 + 6, f"{phase}: the stall was {stalled_s:.1f} s: detection should take detect_timeout_s plus seconds"
    _assert_exactly_once(result, 8, 8, pp=2)  # two workers (shards) per replica
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
