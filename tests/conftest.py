"""One Ray instance for the whole test session; small models; every wait bounded."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from raytrain.config import load_config

# Logical CPU slots for the session's Ray: dp=4 and dp=2 x pp=2 need 4 workers of 1 slot each.
# Each worker runs one torch thread, so 4 slots on 2 cores oversubscribe time, never correctness.
TEST_RAY_CPUS = 4


# Node loss must be noticed in seconds, not Ray's default tens of seconds, for node tests to stay short.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's one Ray instance: a head node (a ray.cluster_utils.Cluster) that node tests add
    worker nodes to and remove them from, as a real cluster gains and loses machines."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": TEST_RAY_CPUS, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    import ray

    return ray

# Long runs at lr 1e-2 drift from the single-process reference by float rounding alone (a different
# summation order per layout, amplified over hundreds of Adam steps: 0.5 relative after 1500 steps
# of a fault-free dp=2 run). At lr 1e-3 the drift stays under 1e-6, so long runs use it and every
# run is still held to 1e-5.
LONG_RUN_LR = "train.lr=1e-3"


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


def small_config(run_dir, data_cache: str, *overrides: str):
    """A small GPT on a small slice of the built-in corpus; ``overrides`` are --set strings."""
    base = [
        "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
        "train.steps=5", "train.global_batch=8", "train.lr=1e-2", "train.seed=3",
        f"data.cache_dir={data_cache}", "data.max_bytes=200000",
        f"run.dir={run_dir}", "run.trace_steps=0", "resources.wait_s=20",
        "resources.step_timeout_s=60",
    ]
    return load_config(None, base + list(overrides))


@pytest.fixture
def make_config(tmp_path, data_cache):
    """``small_config`` writing under this test's tmp_path."""
    return lambda *overrides: small_config(tmp_path / "runs", data_cache, *overrides)


@pytest.fixture(scope="session")
def dp2_run(ray_session, tmp_path_factory, data_cache):
    """The default small config at dp=2, trained once and read by several tests (config, Result)."""
    from raytrain import train

    cfg = small_config(tmp_path_factory.mktemp("dp2") / "runs", data_cache, "parallel.dp=2")
    return cfg, train(cfg)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of two tensors (0 for identical)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def assert_same_params(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Every parameter present in both and equal to ``rtol`` relative (norm-wise per tensor)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    worst = max(((relative_error(got[k], want[k]), k) for k in want))
    assert worst[0] <= rtol, f"parameter {worst[1]} differs by {worst[0]:.2e} relative (> {rtol})"


def reference_state(cfg, steps=None) -> dict:
    from raytrain.reference import train_reference

    model, _ = train_reference(cfg, steps)
    return {k: v.detach() for k, v in model.state_dict().items()}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fast_driver_poll(monkeypatch):
    """The driver collects rows every 0.1 s instead of every second, so an ``on_rows`` callback that
    acts on an event (kills a worker, frees resources) acts within a few tiny test steps of it."""
    import raytrain.driver

    monkeypatch.setattr(raytrain.driver, "POLL_INTERVAL_S", 0.1)


def stage_worker_pids() -> set[int]:
    """Pids of the processes on this machine that host a raytrain StageWorker actor."""
    return set(_stage_worker_titles())


def _stage_worker_titles() -> dict[int, str]:
    titles = {}
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::StageWorker"):
            titles[pid] = title
    return titles


def hold_until_a_new_worker_starts(running: list[int], known: set[int], timeout_s: float = 120.0) -> int:
    """Pause the ``running`` workers (SIGSTOP) until a StageWorker not in ``known`` has started, and
    return its pid. A run never waits for a joining worker, so with tiny test steps it could end
    before a fresh process has imported torch; this makes a grow test independent of that race.
    Ray retitles an actor's process from ``ray::StageWorker.__init__`` once the constructor returned."""
    for pid in running:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            started = [p for p, t in _stage_worker_titles().items() if p not in known and not t.endswith("__init__")]
            if started:
                return started[0]
            time.sleep(0.2)
        raise AssertionError(f"no new StageWorker actor finished starting within {timeout_s} s")
    finally:
        for pid in running:
            os.kill(pid, signal.SIGCONT)
