"""Rank arithmetic for the dp x pp grid, and the torch.distributed groups built on it.

Global rank = replica * pp + stage. Each stage has a dp group (the same stage of every replica:
gradients are all-reduced there); each replica has a pp group (its stages: activations flow and the
global gradient norm is summed there). Groups are formed under a generation number: the store
prefix changes with every membership change, so survivors can re-form without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch.distributed as dist

    from raytrain.rendezvous import StoreAddress


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.pp + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a global rank."""
        return divmod(rank, self.pp)

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank(r, stage) for r in range(self.dp)]

    def pp_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, s) for s in range(self.pp)]


@dataclass
class Groups:
    dp_group: Optional[dist.ProcessGroup]
    """This rank's data-parallel group; None when dp == 1."""
    pp_group: Optional[dist.ProcessGroup]
    """This rank's pipeline group; None when pp == 1."""


def init_groups(
    mesh: Mesh, rank: int, store: StoreAddress, generation: int, backend: str, timeout_s: float
) -> Groups:
    """Join generation ``generation`` of the run's process groups (collective over all ranks)."""
    import torch.distributed as dist

    client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(f"{store.namespace}/gen{generation}/", client)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=mesh.world_size, timeout=timedelta(seconds=timeout_s)
    )
    replica, stage = mesh.coords(rank)
    dp_group = pp_group = None
    # Every rank must create every group, in the same order.
    for s in range(mesh.pp):
        group = dist.new_group(mesh.dp_ranks(s)) if mesh.dp > 1 else None
        if s == stage:
            dp_group = group
    for r in range(mesh.dp):
        group = dist.new_group(mesh.pp_ranks(r)) if mesh.pp > 1 else None
        if r == replica:
            pp_group = group
    return Groups(dp_group, pp_group)
