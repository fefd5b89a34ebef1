"""Where workers run: the resources of one worker and the placement groups that reserve them.

A tp group must stay on one node: the config requires resources.placement_strategy=STRICT_PACK with
parallel.tp > 1 (raytrain.config.schema), so the starting replicas share one node and each replica
granted later, in its own placement group, is on one node too.

The run reserves ``parallel.dp`` replicas in one placement group before any worker starts (and fails
after ``resources.placement_wait_s`` with what was asked and what the cluster has). Replicas beyond
that, up to ``elastic.max_dp``, are asked for as one placement group each that Ray grants whenever
capacity appears (a node joins, another job frees devices); an autoscaler sees them as demand.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from raytrain.config import Config


class ResourcesUnavailable(RuntimeError):
    """The cluster did not grant the workers' resources within resources.placement_wait_s."""


def worker_bundle(cfg: Config) -> dict:
    """Resources of one worker: its CPU slots, and a GPU when resources.use_gpu."""
    bundle = {"CPU": float(cfg.resources.cpus_per_worker)}
    if cfg.resources.use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def request(cfg: Config, replicas: int) -> PlacementGroup:
    """Ask (without waiting) for ``replicas`` x ``parallel.fsdp`` x ``parallel.tp`` x ``parallel.pp`` worker
    bundles, in rank order (a tp group's bundles are consecutive)."""
    bundles = [worker_bundle(cfg) for _ in range(cfg.layout().with_dp(replicas).world_size)]
    return placement_group(bundles, strategy=cfg.resources.placement_strategy)


def reserve(cfg: Config, fixed_cluster: bool = False) -> PlacementGroup:
    """The starting layout's bundles, granted within resources.placement_wait_s or a clear error. On a
    ``fixed_cluster`` (an embedded Ray: one node that never grows) a layout larger than the whole
    cluster is refused at once instead of after the wait."""
    if fixed_cluster:
        _refuse_what_never_fits(cfg)
    pg = request(cfg, cfg.parallel.dp)
    if not pg.wait(timeout_seconds=cfg.resources.placement_wait_s):
        remove_placement_group(pg)
        world = cfg.layout().world_size
        total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        raise ResourcesUnavailable(
            f"layout {cfg.layout().label} needs {world} workers x {worker_bundle(cfg)} "
            f"(resources.placement_strategy={cfg.resources.placement_strategy}) but the cluster did not grant "
            f"them within resources.placement_wait_s={cfg.resources.placement_wait_s:g}s (cluster: {nodes} node(s), "
            f"total {total}, free now {free}); lower parallel.dp / parallel.fsdp / parallel.tp / parallel.pp, free "
            "resources, or add nodes"
        )
    return pg


def _refuse_what_never_fits(cfg: Config) -> None:
    world = cfg.layout().world_size
    total = ray.cluster_resources()
    short = {k: (world * v, total.get(k, 0)) for k, v in worker_bundle(cfg).items() if world * v > total.get(k, 0)}
    if short:
        needs = ", ".join(f"{need:g} {k} (it has {have:g})" for k, (need, have) in short.items())
        raise ResourcesUnavailable(
            f"layout {cfg.layout().label} needs {world} workers x {worker_bundle(cfg)} = {needs} on this machine's "
            "embedded Ray, which cannot grow (RAY_ADDRESS is unset); lower parallel.dp / parallel.fsdp / "
            "parallel.tp / parallel.pp or resources.cpus_per_worker, or start a cluster and set RAY_ADDRESS")
