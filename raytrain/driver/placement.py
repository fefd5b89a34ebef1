"""Where workers run: the resources of one worker and the placement groups that reserve them, by axis.

Each replica has placement groups of its own (the starting replicas too): a tp group (a replica stage's, or
shard's, tp workers, which talk on every layer) is one STRICT_PACK group, on one node; a replica without tp
is one group of resources.placement_strategy (PACK unless set), so its pipeline stages and fsdp shards, and
the replicas themselves, go wherever the cluster has room. resources.placement_strategy overrides it:
STRICT_PACK keeps each whole replica on one node; SPREAD and STRICT_SPREAD spread the workers of a layout
without tp over nodes, the starting replicas' too (one group holds them all). No layout needs the setting.

The run reserves ``parallel.dp`` replicas before any worker starts (and fails after
``resources.placement_wait_s`` with what was asked and what the cluster has). Replicas beyond that, up to
``elastic.max_dp``, are asked for the same way, and Ray grants them whenever capacity appears (a node joins,
another job frees devices); an autoscaler sees them as demand.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raytrain.config import Config
from raytrain.control.crew import ReplicaPlacement

class ResourcesUnavailable(RuntimeError):
    """The cluster did not grant the workers' resources within resources.placement_wait_s."""


def worker_bundle(cfg: Config) -> dict:
    """Resources of one worker: its CPU slots, and a GPU when resources.use_gpu."""
    bundle = {"CPU": float(cfg.resources.cpus_per_worker)}
    if cfg.resources.use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def request(cfg: Config) -> ReplicaPlacement:
    """Ask (without waiting) for one replica's worker bundles, in slot order (a tp group's bundles are
    consecutive), placed by axis (the module's docstring)."""
    slots = cfg.layout().with_dp(1).world_size
    tp = cfg.parallel.tp
    if tp == 1 or cfg.resources.placement_strategy == "STRICT_PACK":
        group = placement_group([worker_bundle(cfg) for _ in range(slots)], strategy=cfg.resources.placement_strategy)
        return ReplicaPlacement.of(group, slots)
    groups = tuple(placement_group([worker_bundle(cfg) for _ in range(tp)], strategy="STRICT_PACK")
                   for _ in range(slots // tp))
    return ReplicaPlacement(groups, tuple((i // tp, i % tp) for i in range(slots)))


def reserve(cfg: Config, fixed_cluster: bool = False) -> list[ReplicaPlacement]:
    """The starting replicas' placements, granted within resources.placement_wait_s or a clear error. On a
    ``fixed_cluster`` (an embedded Ray: one node that never grows) a layout larger than the whole
    cluster is refused at once instead of after the wait."""
    if fixed_cluster:
        _refuse_what_never_fits(cfg)
    replicas = _request_starting(cfg)
    groups = placement_groups(replicas)
    deadline = time.monotonic() + cfg.resources.placement_wait_s  # one wait for them all, not one each
    if not all(g.wait(timeout_seconds=max(0.0, deadline - time.monotonic())) for g in groups):
        for g in groups:
            remove_placement_group(g)
        world = cfg.layout().world_size
        total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        raise ResourcesUnavailable(
            f"layout {cfg.layout().label} needs {world} workers x {worker_bundle(cfg)} "
            f"({_placed_how(cfg)}) but the cluster did not grant "
            f"them within resources.placement_wait_s={cfg.resources.placement_wait_s:g}s (cluster: {nodes} node(s), "
            f"total {total}, free now {free}); lower parallel.dp / parallel.fsdp / parallel.tp / parallel.pp, free "
            "resources, or add nodes"
        )
    return replicas


def placement_groups(replicas: list[ReplicaPlacement]) -> list:
    """Each placement group the ``replicas`` use, once (replicas may share one)."""
    return list({id(g): g for r in replicas for g in r.groups}.values())


def _request_starting(cfg: Config) -> list[ReplicaPlacement]:
    """The starting replicas' requests: one each, except that SPREAD and STRICT_SPREAD without tp spread the
    replicas too, so those share one placement group of every starting worker (replica r's from bundle r x
    slots on)."""
    if cfg.parallel.tp == 1 and cfg.resources.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
        slots = cfg.layout().with_dp(1).world_size
        bundles = [worker_bundle(cfg) for _ in range(cfg.layout().world_size)]
        group = placement_group(bundles, strategy=cfg.resources.placement_strategy)
        return [ReplicaPlacement.of(group, slots, r * slots) for r in range(cfg.parallel.dp)]
    return [request(cfg) for _ in range(cfg.parallel.dp)]


def _placed_how(cfg: Config) -> str:
    tp = cfg.parallel.tp
    if tp > 1 and cfg.resources.placement_strategy != "STRICT_PACK":
        return f"each tp group of {tp} on one node"
    return f"each replica as resources.placement_strategy={cfg.resources.placement_strategy}"


def check_tp_fits_a_node(cfg: Config) -> None:
    """A ValueError (before any actor) when a tp group, which must stay on one node, is larger than what any
    node of the cluster holds: its CPU slots (resources.cpus_per_worker each) or its GPUs."""
    tp = cfg.parallel.tp if cfg.resources.placement_strategy != "STRICT_PACK" else cfg.layout().with_dp(1).world_size
    if tp == 1:
        return
    need, unit = worker_bundle(cfg), "GPU" if cfg.resources.use_gpu else "CPU"
    holds = max((int(node["Resources"].get(unit, 0) // need[unit]) for node in ray.nodes() if node["Alive"]), default=0)
    if holds < tp:
        packed = tp != cfg.parallel.tp
        what = (f"resources.placement_strategy=STRICT_PACK puts a replica's {tp} workers on one node" if packed else
                f"parallel.tp={tp} needs its {tp} workers on one node (a tp group talks on every layer)")
        fix = ("drop resources.placement_strategy=STRICT_PACK (a tp group stays on one node without it), lower "
               "parallel.pp / parallel.fsdp / parallel.tp" if packed else "lower parallel.tp")
        raise ValueError(f"{what}, and the largest node of the cluster holds {holds} ({unit} per worker: "
                         f"{need[unit]:g}); {fix}, or add nodes with more {unit}s")


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
