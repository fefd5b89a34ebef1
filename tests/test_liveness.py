"""Liveness and the abort path: a worker beats from a thread of its own; the coordinator answers each beat
with the newest generation a member of which was lost, and a worker aborts its process groups of that
generation (never of a later one). The frozen workers found by their silence are in tests/test_elastic.py."""

import threading
import time

import pytest
import ray

from raytrain.control.liveness import Heartbeats
from raytrain.worker.heartbeat import Heartbeat


def test_a_beat_is_answered_with_the_newest_generation_to_abort_and_silence_is_counted():
    beats = Heartbeats()
    assert beats.silent_s(41) == 0.0  # never beat: starting, not silent
    assert beats.beat(41) is None
    time.sleep(0.6)
    assert 0.6 <= beats.silent_s(41) < 30
    beats.abort(3)
    beats.abort(2)  # an older loss reported late: the newest stays
    assert beats.beat(41) == 3 and beats.silent_s(41) < 0.5  # the beat reset it (bounds loose for a busy machine)
    beats.beat(42, leaving="SIGTERM")  # a worker told to leave says so, and why, in every beat
    assert beats.told_to_leave() == {42: "SIGTERM"} and beats.told_to_leave() == {}


def test_a_stage_aborts_the_groups_of_the_generation_named_and_of_no_later_one(make_config, monkeypatch):
    from raytrain.config.mesh import Mesh
    from raytrain.config.prepared import Slot
    from raytrain.driver.prepare import prepare
    from raytrain.driver.rendezvous import RendezvousStore
    from raytrain.worker import stage as stage_module

    aborted = []
    monkeypatch.setattr(stage_module, "abort_groups", lambda groups: aborted.append(groups))
    stage = stage_module.Stage(prepare(make_config("train.steps=1")).worker_spec(), Slot(0))
    rendezvous = RendezvousStore()
    try:
        stage.join(0, Mesh(), [8], rendezvous.address("127.0.0.1", "abort"), generation=4, faults=[])
        stage.abort(3)  # an earlier generation's loss: this one's groups are not its
        assert aborted == []
        stage.abort(4)
        stage.abort(5)  # once per generation
        assert aborted == [stage.gen.groups]
        assert stage.run_step(0).aborted  # the step says its groups were aborted
    finally:
        stage.shutdown()
        rendezvous.close()


@pytest.mark.ray
def test_the_heartbeat_thread_says_whether_it_leaves_and_hands_the_answer_to_abort(ray_session):
    @ray.remote(num_cpus=0)
    class Coordinator:
        def __init__(self):
            self.told = []

        def beat(self, beat_id, leaving):
            self.told.append((beat_id, leaving))
            return 7

        def beats(self):
            return self.told

    coordinator, got, done = Coordinator.remote(), [], threading.Event()
    beat = Heartbeat(coordinator, 5, on_abort=lambda generation: got.append(generation) or done.set(), leaving=lambda: "node drain")
    try:
        assert done.wait(10), "no abort within 10 s of the coordinator's answer"
    finally:
        beat.stop()
    assert got[0] == 7
    assert ray.get(coordinator.beats.remote(), timeout=30)[0] == (5, "node drain")  # its beat id, not a pid


def test_gpu_workers_keep_their_process_when_nccl_fails_and_cpu_workers_get_no_nccl_settings(make_config):
    from raytrain.control.coordinator import NCCL_SURVIVES_ERRORS, _worker_options

    gpu = _worker_options(make_config("resources.use_gpu=true"))
    assert gpu["runtime_env"]["env_vars"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert gpu["num_gpus"] == 1 and NCCL_SURVIVES_ERRORS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "runtime_env" not in _worker_options(make_config())


@pytest.mark.ray
@pytest.mark.parametrize("loss", ["failed reply", "death"])
def test_a_survivor_waiting_out_its_group_timeout_after_a_loss_is_not_killed_when_the_step_timeout_ends_first(
        ray_session, loss):
    # resources.step_timeout_s (here 1 s) may end before elastic.detect_timeout_s: a survivor blocked in a
    # collective with a lost peer returns only when its group times out, and beats until then. A loss gives
    # the replies settle_s (detect_timeout_s and a margin) after it, so it is collected, not killed as hung.
    from raytrain.control.membership import Member
    from raytrain.control.workergroup import RayWorkerGroup
    from raytrain.reports import StepReport

    @ray.remote(num_cpus=0)
    class Peer:
        def step(self, seconds, ok, die=False):
            if die:
                import os
                os._exit(1)
            time.sleep(seconds)
            return StepReport(rank=0, step=0, ok=ok, committed=0)

    peers = [Peer.remote() for _ in range(2)]
    try:
        ray.get([p.step.remote(0, True) for p in peers], timeout=60)  # both started
        first = peers[0].step.remote(0.1, False, die=loss == "death")
        survivor = peers[1].step.remote(3.0, False)  # its group's timeout frees it after 3 s
        group = RayWorkerGroup(Peer, {"num_cpus": 0}, spec=None)
        started = time.monotonic()
        outcomes = group.collect([Member(p, 0, None, 0) for p in peers], [first, survivor], timeout=1.0, settle_s=6.0)
    finally:
        for p in peers:
            ray.kill(p)
    assert not outcomes[1].silent and outcomes[1].value.ok is False, "the survivor was given up on at the step timeout"
    assert outcomes[0].dead == (loss == "death")
    assert 2.5 < time.monotonic() - started < 6.0  # collected when it returned, well before settle_s ran out
