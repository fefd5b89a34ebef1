"""Rank arithmetic for the dp x fsdp x pp grid that the workers' torch.distributed groups are built on
(raytrain.worker.groups), and the address of the store where a generation's groups meet.

A replica is fsdp x pp workers; a worker's place in it is its slot, ``shard * pp + stage``, and
its global rank is ``replica * fsdp * pp + slot``. Each worker belongs to three groups:

- the dp group: the same shard of the same stage in every replica. Gradients are all-reduced
  there (HSDP's replicate dimension when fsdp > 1), and a new replica takes its state from it;
- the fsdp group: every shard of one stage of one replica. FSDP2 all-gathers parameters and
  reduce-scatters gradients there;
- the pp group: every stage of one shard of one replica (a pipeline column). Activations flow
  along it, and the global gradient norm is summed over it and the fsdp group.

Groups are formed under a generation number: the store prefix changes with every membership
change, so survivors can re-form without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Mesh:
    dp: int
    pp: int
    fsdp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.pp

    @property
    def slots(self) -> int:
        """Workers per replica."""
        return self.fsdp * self.pp

    @property
    def columns(self) -> int:
        """Pipeline columns (data-parallel workers): each trains on its own slice of the global batch."""
        return self.dp * self.fsdp

    def rank(self, replica: int, stage: int, shard: int = 0) -> int:
        return replica * self.slots + shard * self.pp + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a global rank."""
        replica, slot = divmod(rank, self.slots)
        return replica, slot % self.pp

    def shard(self, rank: int) -> int:
        """The shard (fsdp index) of a global rank."""
        return rank % self.slots // self.pp

    def label(self, rank: int) -> str:
        """``replica:stage``, or ``replica:shard:stage`` when fsdp > 1: how events and digests name a worker."""
        replica, stage = self.coords(rank)
        return f"{replica}:{self.shard(rank)}:{stage}" if self.fsdp > 1 else f"{replica}:{stage}"

    def dp_ranks(self, stage: int, shard: int = 0) -> list[int]:
        return [self.rank(r, stage, shard) for r in range(self.dp)]

    def pp_ranks(self, replica: int, shard: int = 0) -> list[int]:
        return [self.rank(replica, s, shard) for s in range(self.pp)]

    def fsdp_ranks(self, replica: int, stage: int) -> list[int]:
        return [self.rank(replica, stage, f) for f in range(self.fsdp)]


class StoreAddress(NamedTuple):
    """Where a coordinator incarnation's generations form their groups: a TCPStore the driver hosts."""

    host: str
    port: int
    namespace: str
    """Key prefix of one coordinator incarnation; generations go under it."""
