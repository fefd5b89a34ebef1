"""Out of memory is a named failure: a worker killed for memory (by Ray's memory monitor or the kernel's
OOM killer) or whose allocation failed is an ``oom`` event naming the worker and its node's memory, it
leaves the run like any lost worker (repair where a replica remains, reload where none does), and a
run that cannot go on says "out of memory", what was running and what to change (exit 4).

Ray's errors are built as Ray builds them and go through the real classification
(raytrain.control.workergroup.memory_loss); the coordinator runs on fake workers; one real run has a
worker's allocation really fail (an ``oom`` fault: RLIMIT_AS), and one CLI run cannot go on."""

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.core.generated.common_pb2 import ActorDiedErrorContext

from raytrain import checkpoint, train
from raytrain.control.coordinator import CapacityLost, OutOfMemoryLost
from raytrain.control.membership import Member
from raytrain.control.workergroup import memory_loss
from raytrain.reports import oom as oom_module
from raytrain.reports.oom import NodeMemory, WorkerOutOfMemory, is_out_of_memory, kernel_killed, node_memory
from tests.helpers import RAY_OOM_MESSAGE, FakeWorkerGroup, assert_same_params, pid_alive, ray_out_of_memory_error, \
    reference_state
from tests.test_coordinator import assert_every_live_worker_applied_each_step_once, events, run

REPO = Path(__file__).resolve().parents[1]


def member(pid=4242) -> Member:
    return Member(handle=None, stage=1, placement=None, bundle=0, pid=pid)


def actor_died(error_message: str, pid=4242) -> ray.exceptions.ActorDiedError:
    """The ActorDiedError Ray raises for a call of a dead actor: its cause is the GCS's context."""
    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        error_message=error_message, pid=pid, class_name="StageWorker", actor_id=b"\x01" * 16,
        node_ip_address="10.0.0.7"))


def task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    """What ``ray.get`` raises when the actor's method raised ``cause``: Ray pickles the RayTaskError in
    the worker and raises it as an instance of the cause's class too."""
    error = ray.exceptions.RayTaskError("StageWorker.run_step", "Traceback ...", cause, pid=4242, ip="10.0.0.8")
    return pickle.loads(pickle.dumps(error)).as_instanceof_cause()


# --- the classification of Ray's errors -----------------------------------------------------------


def test_an_out_of_memory_error_of_rays_memory_monitor_names_it_and_the_node_memory_at_the_kill():
    oom = memory_loss(ray_out_of_memory_error(4242), member())
    assert oom.killed_by == "ray memory monitor" and oom.node == "10.0.0.7"
    assert oom.error.startswith("1 worker(s) were killed due to the node running low on memory")
    assert oom.memory == NodeMemory(24064, 707, "Ray's memory monitor at the kill")  # 23.50 GB, 0.69 GB free
    assert "killed by Ray's memory monitor (node 10.0.0.7: 0.7 of 23.5 GiB available per Ray's memory monitor at the kill)" in oom.text()


def test_the_memory_monitors_older_message_is_read_too():
    old = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 172.17.0.2, ID: 3a4b) "
           "where the task (task ID: 76b2, name=StageWorker.run_step, pid=664672, memory used=0.05GB) was running "
           "was 32.53GB / 33.28GB (0.977449), which exceeds the memory usage threshold of 0.95.")
    oom = memory_loss(ray.exceptions.OutOfMemoryError(old), member())
    assert oom.node == "172.17.0.2" and oom.memory.total_mb == 34079 and oom.memory.available_mb == 768


def test_an_actor_death_that_the_memory_monitor_caused_is_out_of_memory():
    # The actor's death can reach the caller before its task's OutOfMemoryError: the context says why.
    error = actor_died("The actor is dead because its worker process has died. Worker exit type: USER_ERROR "
                       "Worker exit detail: " + RAY_OOM_MESSAGE.format(pid=4242))
    assert isinstance(error, ray.exceptions.RayActorError)
    oom = memory_loss(error, member())
    assert oom.killed_by == "ray memory monitor" and oom.memory.available_mb == 707


SIGKILLED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
             "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
             "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
             "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


def test_a_sigkilled_worker_is_out_of_memory_only_where_the_kernel_log_names_its_pid(monkeypatch):
    # Ray says the same of every SIGKILL (a lost machine, a fault test's kill): only the kernel knows.
    now_us = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    log = (f"6,1234,{now_us - 2_000_000},-;Out of memory: Killed process 4242 (ray::StageWorke) "
           "total-vm:9000000kB, anon-rss:7000000kB\n")
    monkeypatch.setattr(oom_module, "read_kernel_log", lambda: "6,1,2,-;eth0: link up\n")
    assert memory_loss(actor_died(SIGKILLED), member()) is None
    monkeypatch.setattr(oom_module, "read_kernel_log", lambda: log)
    oom = memory_loss(actor_died(SIGKILLED), member())
    assert oom.killed_by == "kernel oom killer" and oom.memory.total_mb > 0
    assert memory_loss(actor_died(SIGKILLED), member(pid=4243)) is None  # another process
    cgroup = "4,9,{},-;Memory cgroup out of memory: Killed process 77 (ray::StageWorke) total-vm:1kB"
    assert kernel_killed(77, cgroup.format(5_000_000), now_us=6_000_000)
    assert not kernel_killed(77, cgroup.format(5_000_000), now_us=5_000_000 + 3600 * 10**6)  # an older pid 77
    assert not kernel_killed(77, "6,9,9,-;Out of memory: Killed process 77 (python) total-vm:1kB", now_us=10)


def test_a_worker_whose_allocation_failed_is_out_of_memory_with_the_memory_it_reported():
    reported = WorkerOutOfMemory("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                 "268435456 bytes", NodeMemory(24105, 512, "/proc/meminfo"), pid=4242, node="10.0.0.8")
    oom = memory_loss(task_error(reported), member())
    assert oom.killed_by == "allocation failed" and oom.node == "10.0.0.8"
    assert oom.memory == NodeMemory(24105, 512, "/proc/meminfo")
    assert "failed to allocate memory (RuntimeError: DefaultCPUAllocator" in oom.text()


def test_a_plain_memory_error_or_torchs_is_out_of_memory_and_other_errors_are_not():
    import torch

    plain = memory_loss(task_error(MemoryError()), member())
    assert plain.killed_by == "allocation failed" and plain.error == "MemoryError"
    cuda = memory_loss(task_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")), member())
    assert cuda.error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert memory_loss(task_error(ValueError("bad data")), member()) is None
    assert memory_loss(task_error(RuntimeError("Connection closed by peer")), member()) is None
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 1024 bytes"))


def test_a_coordinator_killed_by_the_memory_monitor_is_restarted_then_named_in_one_line():
    from raytrain.driver.run import _coordinator_lost, coordinator_out_of_memory

    killed = ray_out_of_memory_error(4242)
    assert _coordinator_lost(killed)  # restarted from the last checkpoint, as a lost coordinator is
    line = str(coordinator_out_of_memory(killed, "/ckpt/step_00000004"))
    assert line.startswith("the coordinator was killed by Ray's memory monitor (node 10.0.0.7: 0.7 of 23.5 GiB")
    assert "resume from /ckpt/step_00000004" in line and "raise parallel.fsdp" in line and "\n" not in line


def test_node_memory_reads_proc_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683520 kB\nMemFree:         1000 kB\nMemAvailable:    2097152 kB\n")
    assert node_memory(str(meminfo)) == NodeMemory(24105, 2048, str(meminfo))
    assert node_memory(str(tmp_path / "missing")) is None


_MEMORY_MONITOR_PROBE = """
import json, os, time
import ray
from raytrain.control.membership import Member
from raytrain.control.workergroup import RayWorkerGroup

@ray.remote(num_cpus=0)
class Sleeper:
    def __init__(self):
        time.sleep(3)  # starting for longer than the monitor takes to kill it (it looks every 100 ms)

    def pid(self):
        return os.getpid()
    def nap(self, s):
        time.sleep(s)

def seen(m):
    return m.oom and {"killed_by": m.oom.killed_by, "node": m.oom.node, "memory": m.oom.memory.__dict__}

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # never the session's Ray
group, handle = RayWorkerGroup(Sleeper, {}, lambda s, f: ()), Sleeper.remote()
starting, calling = Member(handle, 0, None, 0, ready=handle.pid.remote()), Member(handle, 0, None, 0)
pid = group.pid(starting, 120)
outcome = group.collect([calling], [handle.nap.remote(60)], timeout=120)[0]
print("RESULT " + json.dumps({"pid": pid, "at_start": seen(starting), "dead": outcome.dead, "call": seen(calling)}))
"""


@pytest.mark.ray  # a Ray of its own, whose memory monitor kills at 1% of the node's memory
def test_a_worker_rays_memory_monitor_really_kills_is_classified_out_of_memory_by_the_worker_group():
    # The node uses more than 1% of its memory already, so the monitor kills the actor at once:
    # nothing is allocated. The worker group's real calls (pid, collect) meet Ray's real errors.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="100", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _MEMORY_MONITOR_PROBE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert found, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(found[0][len("RESULT "):])
    assert result["pid"] is None and result["dead"]  # died while starting; its call fails as a death
    for seen in (result["at_start"], result["call"]):
        assert seen["killed_by"] == "ray memory monitor" and seen["node"]
        assert seen["memory"]["source"] == "Ray's memory monitor at the kill"
        assert abs(seen["memory"]["total_mb"] - node_memory().total_mb) < 0.1 * node_memory().total_mb


# --- the coordinator: an oom loss is a lost worker, named ---------------------------------------


def test_a_worker_killed_for_memory_mid_step_is_an_oom_event_then_a_repair(tmp_path):
    coordinator, group, summary, rows = run(tmp_path, "elastic.faults=['1:0@2:oom']")
    oom, repair = events(rows, "oom"), events(rows, "repair")
    assert len(oom) == 1 and len(repair) == 1 and rows.index(oom[0]) < rows.index(repair[0])
    assert oom[0]["worker"] == "replica 1 stage 0" and (oom[0]["replica"], oom[0]["stage"]) == (1, 0)
    assert oom[0]["during"] == "step" and oom[0]["step"] == 2 and oom[0]["killed_by"] == "ray memory monitor"
    assert oom[0]["node"] == "10.0.0.7" and oom[0]["node_memory"]["available_mb"] == 707
    assert repair[0]["lost"] == ["replica 1 stage 0"] and repair[0]["retrying_step"] == 2
    assert summary.committed_steps == list(range(6)) and summary.failures == 1 and group.spawned == 3
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_shard_killed_for_memory_with_no_live_copy_reloads_the_checkpoint(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", "elastic.faults=['0:1@3:oom']", dp=1, pp=2)
    assert events(rows, "oom")[0]["worker"] == "replica 0 stage 1"
    assert events(rows, "reload")[0]["step"] == 2
    assert summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_worker_killed_for_memory_while_saving_is_named_and_the_save_retried(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "checkpoint.every=2", group=FakeWorkerGroup(1, initial=2, oom_in="save"))
    oom = events(rows, "oom")
    assert len(oom) == 1 and oom[0]["during"] == "checkpoint" and oom[0]["step"] == 2
    assert events(rows, "repair")[0]["during"] == "checkpoint"
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [2, 4, 6]
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_when_the_run_cannot_go_on_after_an_oom_it_says_out_of_memory_what_ran_and_what_to_change(tmp_path):
    with pytest.raises(OutOfMemoryLost) as raised:
        run(tmp_path, "elastic.faults=['0:0@1:oom']", dp=1)
    line = str(raised.value)
    assert isinstance(raised.value, CapacityLost) and "\n" not in line
    assert line.startswith("replica 0 stage 0 was killed by Ray's memory monitor (node 10.0.0.7: 0.7 of 23.5 GiB")
    assert "during a step (step 2)" in line and "no checkpoint to reload (config: checkpoint.every)" in line
    assert "raise parallel.fsdp or parallel.pp" in line and "train.activation_checkpointing=true" in line


def test_an_oom_while_saving_that_exhausts_the_failures_names_the_save(tmp_path):
    with pytest.raises(OutOfMemoryLost, match=r"during a save \(the checkpoint of step 2\); .*elastic.max_failures=0"):
        run(tmp_path, "checkpoint.every=2", "elastic.max_failures=0", group=FakeWorkerGroup(1, initial=2, oom_in="save"))


def test_a_second_oom_with_nothing_committed_between_gives_up_at_once_instead_of_retrying(tmp_path):
    # the same layout at the same step would only run out again: a reload per try up to
    # elastic.max_failures (20) would spend 20 minutes of a 1B run for nothing
    group = FakeWorkerGroup(1, initial=2, oom_in="save", oom_times=5)
    with pytest.raises(OutOfMemoryLost, match=r"during a save \(the checkpoint of step 2\); workers ran out of "
                                               r"memory twice after step 2 with no step committed between") as raised:
        run(tmp_path, "checkpoint.every=2", group=group)
    assert "(config: parallel)" in str(raised.value)
    assert group.oom_left == 2  # both workers in the first save, and the first in its retry: then no more tries


def test_ooms_at_different_steps_are_each_repaired(tmp_path):
    coordinator, _, summary, rows = run(tmp_path, "elastic.faults=['1:0@2:oom', '0:0@4:oom']")
    assert [e["step"] for e in events(rows, "oom")] == [2, 4] and summary.committed_steps == list(range(6))
    assert_every_live_worker_applied_each_step_once(coordinator, 6)


def test_a_run_lost_without_memory_trouble_stays_plain_capacity_lost(tmp_path):
    with pytest.raises(CapacityLost) as raised:
        run(tmp_path, "elastic.faults=['0:0@1:forward']", dp=1)
    assert not isinstance(raised.value, OutOfMemoryLost)


# --- real runs ------------------------------------------------------------------------------------


def test_a_worker_whose_allocation_really_fails_mid_step_leaves_and_the_run_repairs(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "train.steps=5", "elastic.faults=['1:0@2:oom']", "run.record_samples=true",
                      "elastic.detect_timeout_s=20")
    result = train(cfg)
    oom = [e for e in result.events if e["event"] == "oom"]
    assert len(oom) == 1, result.events
    assert oom[0]["worker"] == "replica 1 stage 0" and oom[0]["during"] == "step" and oom[0]["step"] == 2
    assert oom[0]["killed_by"] == "allocation failed" and "can't allocate memory" in oom[0]["error"]
    memory = oom[0]["node_memory"]
    assert memory["source"] == "/proc/meminfo" and 0 < memory["available_mb"] <= memory["total_mb"]
    assert oom[0]["pid"] == result.worker_pids[1] and not pid_alive(oom[0]["pid"])  # it left the run
    assert result.failures == 1 and result.committed_steps == list(range(5))
    assert oom[0]["pid"] not in result.final_pids and result.worker_pids[0] in result.final_pids
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_the_cli_says_out_of_memory_in_one_line_and_exits_4_when_the_run_cannot_go_on(ray_cluster, tmp_path, data_cache):
    sets = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "train.steps=4",
            "train.global_batch=8", f"data.cache_dir={data_cache}", "data.max_bytes=200000", f"run.dir={tmp_path}",
            "run.trace_steps=0", "elastic.faults=['0:0@1:oom']", "elastic.capacity_wait_s=60"]
    proc = subprocess.run([sys.executable, "-m", "raytrain", "train", *[a for s in sets for a in ("--set", s)]],
                          cwd=REPO, env=dict(os.environ, RAY_ADDRESS=ray_cluster.address), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("raytrain: ")]
    assert len(lines) == 1 and lines[0].startswith("raytrain: out of memory: replica 0 stage 0 failed to allocate"), \
        proc.stderr[-3000:]
    assert "during a step (step 2)" in lines[0] and "raise parallel.fsdp or parallel.pp" in lines[0]
    assert "Traceback" not in proc.stderr and "ray.exceptions" not in proc.stderr
    rows = [json.loads(line) for f in tmp_path.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    assert [r["worker"] for r in rows if r.get("event") == "oom"] == ["replica 0 stage 0"]
