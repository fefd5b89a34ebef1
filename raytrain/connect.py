"""Connecting the driver to Ray, or starting an embedded Ray.

With ``RAY_ADDRESS`` unset the driver always starts a fresh embedded Ray (``address="local"``):
a bare ``ray.init()`` would instead join the cluster named in ``/tmp/ray/ray_current_cluster``, a
file that outlives a killed cluster, and hang on it.
"""

from __future__ import annotations

import os

import ray


def ensure_ray(min_cpus: int = 0) -> None:
    """Connect to RAY_ADDRESS when set; otherwise start an embedded local Ray sized to the machine
    (at least ``min_cpus`` CPU slots)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus) if min_cpus else None,
                 include_dashboard=False)
