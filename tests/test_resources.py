"""A layout the cluster cannot hold fails after a bounded wait, with a clear message, leaving nothing."""

import time

import pytest

from raytrain import ResourcesUnavailable, train
from tests.helpers import TEST_RAY_CPUS


def test_too_many_workers_fail_after_bounded_wait(ray_session, make_config):
    cfg = make_config("parallel.dp=8", "resources.wait_s=2")
    start = time.monotonic()
    with pytest.raises(ResourcesUnavailable) as err:
        train(cfg)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "dp=8" in message and "8 workers" in message and "resources.wait_s=2" in message
    assert "'CPU': 4.0" in message  # what the cluster has
    # the reservation was released
    deadline = time.monotonic() + 10
    while ray_session.available_resources().get("CPU", 0) < TEST_RAY_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_session.available_resources().get("CPU", 0) == TEST_RAY_CPUS


def test_a_sharded_world_the_cluster_cannot_hold_names_parallel_fsdp(ray_session, make_config):
    cfg = make_config("parallel.dp=2", "parallel.fsdp=4", "resources.wait_s=1")
    with pytest.raises(ResourcesUnavailable) as err:
        train(cfg)
    message = str(err.value)
    assert "dp=2 fsdp=4" in message and "8 workers" in message and "parallel.fsdp" in message
