"""One Ray instance per test session (per pytest-xdist process); small models; every wait bounded."""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest

from raytrain.config import load_config

from tests.helpers import TEST_RAY_CPUS


RAY_FIXTURES = {"ray_cluster", "ray_session", "ray_tmpdir"}
"""A test that uses one of these (itself or through another fixture) starts or joins a Ray: the Ray tier.
ray_tmpdir (tests/test_connect.py) is for tests that start a Ray of their own."""


def pytest_configure(config):
    """Compile the repository's modules once, in the process that starts the others. This machine and CI
    set PYTHONDONTWRITEBYTECODE, and an editable install leaves raytrain uncompiled, so otherwise each of
    the suite's several hundred processes (Ray workers, coordinators, CLIs) compiles what it imports anew."""
    if not hasattr(config, "workerinput"):  # pytest-xdist's controller, or the only process with -n 0
        repo = Path(__file__).resolve().parents[1]
        for package in ("raytrain", "tests", "experiments"):
            compileall.compile_dir(repo / package, quiet=1)


def pytest_collection_modifyitems(items):
    """Mark every test that needs Ray ``ray``: ``pytest -m "not ray"`` is the fast tier (pure functions,
    fake workers, forked stages); modules that start a Ray of their own mark themselves."""
    for item in items:
        if RAY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.ray)


# Node loss must be noticed in seconds, not Ray's default tens of seconds, for node tests to stay short.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's one Ray instance: a head node (a ray.cluster_utils.Cluster) that node tests add
    worker nodes to and remove them from, as a real cluster gains and loses machines. Each pytest-xdist
    process is a session of its own, so each starts one, when the first test it runs needs it."""
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

@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


def small_config(run_dir, data_cache: str, *overrides: str):
    """A small GPT on a small slice of the built-in corpus; ``overrides`` are --set strings."""
    base = [
        "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
        "train.steps=5", "train.global_batch=8", "train.lr=1e-2", "train.seed=3",
        f"data.cache_dir={data_cache}", "data.max_bytes=200000",
        f"run.dir={run_dir}", "run.trace_steps=0", "resources.placement_wait_s=20",
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


@pytest.fixture
def fast_driver_poll(monkeypatch):
    """The driver collects rows every 0.1 s instead of every second, so an ``on_rows`` callback that
    acts on an event (kills a worker, frees resources) acts within a few tiny test steps of it."""
    import raytrain.driver.run

    monkeypatch.setattr(raytrain.driver.run, "POLL_INTERVAL_S", 0.1)
