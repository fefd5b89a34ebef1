"""A layout the cluster cannot hold fails after a bounded wait, with a clear message, leaving nothing."""

import time

import pytest

from raytrain import ResourcesUnavailable, train
from tests.helpers import TEST_RAY_CPUS


def test_too_many_workers_fail_after_bounded_wait(ray_session, make_config):
    cfg = make_config("parallel.dp=8", "resources.placement_wait_s=2")
    start = time.monotonic()
    with pytest.raises(ResourcesUnavailable) as err:
        train(cfg)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "dp=8" in message and "8 workers" in message and "resources.placement_wait_s=2" in message
    assert "'CPU': 4.0" in message  # what the cluster has
    # the reservation was released
    deadline = time.monotonic() + 10
    while ray_session.available_resources().get("CPU", 0) < TEST_RAY_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_session.available_resources().get("CPU", 0) == TEST_RAY_CPUS


def test_a_sharded_world_the_cluster_cannot_hold_names_parallel_fsdp(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "parallel.fsdp=4", "resources.placement_wait_s=1")
    with pytest.raises(ResourcesUnavailable) as err:
        train(cfg)
    message = str(err.value)
    assert "dp=2 fsdp=4" in message and "8 workers" in message and "parallel.fsdp" in message


@pytest.mark.ray  # the CLI starts an embedded Ray
def test_a_layout_larger_than_the_embedded_ray_is_refused_at_once(tmp_path, data_cache):
    """With RAY_ADDRESS unset raytrain starts a Ray of this machine's size, which never grows: a
    layout that needs more fails in one line (exit 3) without waiting resources.placement_wait_s."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "raytrain", "train", "--config", "experiments/configs/tiny.yaml",
           "--set", "parallel.dp=64", "--set", "train.global_batch=64", "--set", "resources.placement_wait_s=600",
           "--set", f"run.dir={tmp_path / 'runs'}", "--set", f"data.cache_dir={data_cache}",
           "--set", "data.max_bytes=200000"]
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    assert time.monotonic() - start < 120, "it waited for resources that an embedded Ray can never have"
    last = out.stderr.strip().splitlines()[-1]
    assert "64 CPU (it has" in last and "cannot grow" in last and "RAY_ADDRESS" in last, last
    assert "Traceback" not in out.stderr


def test_a_tp_group_larger_than_any_node_is_refused_before_any_actor(make_config, monkeypatch):
    from raytrain.driver import placement

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 3.0}},
             {"Alive": False, "Resources": {"CPU": 64.0}}]
    monkeypatch.setattr(placement.ray, "nodes", lambda: nodes)
    with pytest.raises(ValueError, match=r"parallel.tp=4 needs its 4 workers on one node .* the largest node of the "
                                         r"cluster holds 3 \(CPU per worker: 1\); lower parallel.tp, or add nodes"):
        placement.check_tp_fits_a_node(make_config("parallel.tp=4", "model.n_head=4"))
    placement.check_tp_fits_a_node(make_config("parallel.tp=2"))  # fits the node of 3
    with pytest.raises(ValueError, match=r"resources.placement_strategy=STRICT_PACK puts a replica's 4 workers on one node"):
        placement.check_tp_fits_a_node(make_config("parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                                                   "resources.placement_strategy=STRICT_PACK"))
