"""Every private torch and Ray symbol raytrain uses, in one place (pinned: torch 2.13, Ray 2.60).

Each has no public equivalent; each wrapper says why it is needed. An upgrade that removes or
renames one fails here, and in ``tests/test_compat.py``, not deep inside a repair or a connect.
Imports are lazy: importing this module costs neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

RAY_WORKER_LOGGER = "ray._private.worker"
"""The logger of ``ray.init``'s messages (the driver filters one it cannot avoid triggering)."""


def reset_process_group_counter() -> None:
    """Reset torch's process-global group-name counter after an ``init_process_group`` that failed.

    Only ``destroy_process_group`` resets it, and it needs a successful init. Group names key the
    rendezvous store, so a stale counter would make a worker wait under other keys than its peers'.
    """
    import torch.distributed as dist

    dist.distributed_c10d._world.group_count = 0


def clear_dtensor_sharding_cache() -> None:
    """Clear DTensor's cache of op shardings, whose specs hold device meshes and through them process
    groups: without it a left generation's connections outlive it (the only API that clears it)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def resolve_auto_ray_address() -> Optional[str]:
    """The address ``RAY_ADDRESS=auto`` means on this machine (ConnectionError when none runs), so the
    driver can probe it before ``ray.init`` waits on it for minutes."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address("auto")


def draining_nodes() -> dict[str, int]:
    """The nodes Ray is draining (a preemption notice, ``ray drain-node``, an autoscaler scale-down):
    node id (hex) -> deadline in ms since the epoch (0: none given). Ray 2.60 has no public API for it
    (``ray drain-node`` is a hidden developer command); Ray Train V2's preemption watcher reads this
    same state."""
    import ray._private.state

    return dict(ray._private.state.state.get_draining_nodes())


@contextlib.contextmanager
def ray_processes_in_a_session_of_their_own() -> Iterator[None]:
    """While active, the processes ``ray.init`` starts for an embedded Ray (its GCS, raylet, agents: each
    a ``ConsolePopen`` of ``ray._private.services``) start in a session of their own. A signal to the
    driver's process group (``timeout``, ``kill -TERM -PGID``, a shell's job control) then reaches the driver
    alone, which stops the run at a step boundary with a checkpoint, rather than also ending the Ray that
    the run needs to get there. Ray 2.60 has no option for it. The processes still end with the driver:
    Ray starts them with PR_SET_PDEATHSIG, and raytrain.driver.reaper kills what is left."""
    from ray._private import services

    original = services.ConsolePopen

    class InOwnSession(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "start_new_session": True})

    services.ConsolePopen = InOwnSession
    try:
        yield
    finally:
        services.ConsolePopen = original


def on_compile(started, ended) -> None:
    """Call ``started()`` and ``ended()`` around each compilation of torch.compile (Dynamo's graph and
    Inductor's kernels, forward and, when it runs first, backward). Dynamo's compile callbacks are the only
    hook that marks where compiling begins and ends; torch.compiler has no public one."""
    import torch._dynamo.callback as callback

    callback.on_compile_start(lambda args: started())
    callback.on_compile_end(lambda args: ended())
