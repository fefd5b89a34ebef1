"""The torch.distributed groups of one worker in one generation, formed over the run's mesh.

Groups are formed under a generation number: the store prefix changes with every membership
change, so survivors can re-form without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from raytrain.compat import reset_process_group_counter
from raytrain.config.mesh import Mesh, StoreAddress


@dataclass
class Groups:
    dp_group: Optional[dist.ProcessGroup]
    """This rank's data-parallel group; None when dp == 1."""
    pp_group: Optional[dist.ProcessGroup]
    """This rank's pipeline group; None when pp == 1."""
    fsdp_group: Optional[dist.ProcessGroup] = None
    """This rank's sharding group; None when fsdp == 1."""
    tp_group: Optional[dist.ProcessGroup] = None
    """This rank's tensor-parallel group (consecutive ranks, one node); None when tp == 1."""
    tie_groups: dict = field(default_factory=dict)
    """Pipeline workers that hold one tied parameter -> the group of this rank's column's ranks among them
    (the pp group when they are all of them); only for sets this rank is in."""


def init_groups(
    mesh: Mesh, rank: int, store: StoreAddress, generation: int, backend: str, timeout_s: float,
    tie_workers: tuple[tuple[int, ...], ...] = (),
) -> Groups:
    """Join generation ``generation`` of the run's process groups (collective over all ranks); ``tie_workers``:
    each set of pipeline workers that hold a tied parameter, whose ranks in each column get a group."""
    client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(f"{store.namespace}/gen{generation}/", client)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=mesh.world_size, timeout=timedelta(seconds=timeout_s)
    )
    mine = {"dp": None, "pp": None, "fsdp": None, "tp": None}
    # Every rank must create every group, in the same order.
    for kind, size, members in _group_members(mesh):
        if size == 1:
            continue
        for ranks in members:
            # new_group's own default is torch's 30 minutes, not the world's: a frozen peer (its
            # connections open, its process stopped) would hold a collective that long.
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                mine[kind] = group
    groups = Groups(mine["dp"], mine["pp"], mine["fsdp"], mine["tp"])
    for workers in sorted(set(tie_workers)):
        if len(workers) == mesh.pp:  # every stage holds it: the pp group is its group
            groups.tie_groups[workers] = groups.pp_group
            continue
        for ranks in _tie_members(mesh, workers):
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                groups.tie_groups[workers] = group
    return groups


def _tie_members(mesh: Mesh, workers: tuple[int, ...]) -> list[list[int]]:
    """The ranks of ``workers`` (pipeline workers) in every column of the grid, in the order every rank
    creates their groups."""
    return [[mesh.rank(replica=r, shard=f, stage=w, tp=t) for w in workers]
            for r in range(mesh.dp) for f in range(mesh.fsdp) for t in range(mesh.tp)]


def _group_members(mesh: Mesh) -> list[tuple[str, int, list[list[int]]]]:
    """(kind, size, member lists) of every group of the grid, in the order every rank creates them."""
    replicas, shards, stages, tps = range(mesh.dp), range(mesh.fsdp), range(mesh.pp), range(mesh.tp)
    return [
        ("dp", mesh.dp, [mesh.dp_ranks(s, f, t) for f in shards for s in stages for t in tps]),
        ("pp", mesh.pp, [mesh.pp_ranks(r, f, t) for r in replicas for f in shards for t in tps]),
        ("fsdp", mesh.fsdp, [mesh.fsdp_ranks(r, s, t) for r in replicas for s in stages for t in tps]),
        ("tp", mesh.tp, [mesh.tp_ranks(r, s, f) for r in replicas for f in shards for s in stages]),
    ]


def destroy_groups() -> None:
    """Destroy this process's torch.distributed groups, whether or not its last init succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        reset_process_group_counter()  # its last init failed (a peer died during a repair)


def abort_groups(groups: Groups) -> None:
    """Abort every process group of a generation (``ProcessGroup.abort``), from any thread: a collective
    blocked in one returns with an error (NCCL aborts its communicators; gloo's abort, in torch 2.13, does not
    interrupt a collective already blocked, which its peer's death or the group timeout then ends)."""
    every = [groups.dp_group, groups.pp_group, groups.fsdp_group, groups.tp_group, *groups.tie_groups.values()]
    if dist.is_initialized():
        every.append(dist.group.WORLD)
    for group in {id(g): g for g in every if g is not None}.values():
        try:
            group.abort()
        except RuntimeError:  # already aborted or torn down: nothing is blocked in it any more
            pass
