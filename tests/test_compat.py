"""The private torch and Ray symbols raytrain relies on still exist at the pinned versions: an
upgrade that drops one fails here, by name, instead of deep inside a repair."""


def test_the_process_group_counter_can_be_reset():
    import torch.distributed as dist

    from raytrain.compat import reset_process_group_counter

    assert hasattr(dist.distributed_c10d._world, "group_count")
    before = dist.distributed_c10d._world.group_count
    try:
        dist.distributed_c10d._world.group_count = 7
        reset_process_group_counter()
        assert dist.distributed_c10d._world.group_count == 0
    finally:
        dist.distributed_c10d._world.group_count = before


def test_dtensor_sharding_cache_can_be_cleared():
    from raytrain.compat import clear_dtensor_sharding_cache

    clear_dtensor_sharding_cache()


def test_auto_ray_address_resolves_or_says_none_runs(monkeypatch):
    from raytrain.compat import resolve_auto_ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        address = resolve_auto_ray_address()
    except ConnectionError:
        return  # no cluster on this machine: the documented answer
    assert address is None or ":" in address


def test_ray_init_still_logs_through_the_filtered_logger():
    import logging

    import ray._private.worker as ray_worker

    from raytrain.compat import RAY_WORKER_LOGGER

    assert getattr(ray_worker, "logger", logging.getLogger(RAY_WORKER_LOGGER)).name == RAY_WORKER_LOGGER


def test_rays_draining_nodes_can_be_read(ray_session):
    # on the session's cluster, whose head is not draining (tests/test_nodes.py drains a node)
    from raytrain.compat import draining_nodes

    assert ray_session.get_runtime_context().get_node_id() not in draining_nodes()


def test_the_processes_ray_init_starts_can_be_put_in_a_session_of_their_own():
    import inspect
    import os

    from ray._private import services

    from raytrain.compat import ray_processes_in_a_session_of_their_own

    assert "ConsolePopen(" in inspect.getsource(services.start_ray_process)  # how ray.init starts each process
    original = services.ConsolePopen
    with ray_processes_in_a_session_of_their_own():
        child = services.ConsolePopen(["sleep", "5"])
    try:
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert services.ConsolePopen is original


def test_compile_callbacks_mark_where_compiling_starts_and_ends():
    import torch

    from raytrain.compat import on_compile

    marks = []
    on_compile(lambda: marks.append("start"), lambda: marks.append("end"))
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert marks[:2] == ["start", "end"]
