"""The worker grid as one value: its dp x fsdp x pp shape, the rank arithmetic the workers'
torch.distributed groups are built on (raytrain.worker.groups), and the address of the store where a
generation's groups meet.

The axes nest in the documented order, outermost first: a global rank's digits are (replica, shard,
stage), so a replica is ``fsdp x pp`` consecutive ranks (its slots, ``shard * pp + stage``) and the
global rank is ``replica * fsdp * pp + slot``. Each worker belongs to three groups:

- the dp group: the same shard of the same stage in every replica. Gradients are all-reduced
  there (HSDP's replicate dimension when fsdp > 1), and a new replica takes its state from it;
- the fsdp group: every shard of one stage of one replica. FSDP2 all-gathers parameters and
  reduce-scatters gradients there;
- the pp group: every stage of one shard of one replica (a pipeline column). Activations flow
  along it, and the global gradient norm is summed over it and the fsdp group.

A fourth axis (tensor parallelism: world = dp x fsdp x tp x pp, tp's ranks innermost so that its
group stays inside a node) is a field here, a digit of ``rank`` and ``coords`` and a factor of
``slots`` and ``world_size``; everything else asks the grid.

Groups are formed under a generation number: the store prefix changes with every membership
change, so survivors can re-form without a restart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The dp x fsdp x pp grid of a run's workers. Keyword-only (``Mesh(dp=2, fsdp=2)``), so that no
    caller can swap two axes; the one place that multiplies them out."""

    dp: int = 1
    """Data-parallel replicas."""
    fsdp: int = 1
    """Workers that shard each stage of a replica (FSDP2)."""
    pp: int = 1
    """Pipeline stages of each replica."""

    @property
    def world_size(self) -> int:
        """Workers in the grid: one per (replica, shard, stage)."""
        return self.dp * self.slots

    @property
    def slots(self) -> int:
        """Workers per replica."""
        return self.fsdp * self.pp

    @property
    def columns(self) -> int:
        """Pipeline columns (data-parallel workers): each trains on its own slice of the global batch."""
        return self.dp * self.fsdp

    @property
    def grid_label(self) -> str:
        """``dp=2 pp=1``, ``dp=2 fsdp=2 pp=1``: how metric rows, repair events and runs name the grid."""
        return " ".join([f"dp={self.dp}"] + ([f"fsdp={self.fsdp}"] if self.fsdp > 1 else []) + [f"pp={self.pp}"])

    def with_dp(self, dp: int) -> Mesh:
        """This grid with ``dp`` replicas, as a repair or a grow leaves it."""
        return dataclasses.replace(self, dp=dp)

    def rank(self, *, replica: int, shard: int = 0, stage: int) -> int:
        """The global rank of a (replica, shard, stage): keyword-only, in the grid's order."""
        return (replica * self.fsdp + shard) * self.pp + stage

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
        return [self.rank(replica=r, shard=shard, stage=stage) for r in range(self.dp)]

    def pp_ranks(self, replica: int, shard: int = 0) -> list[int]:
        return [self.rank(replica=replica, shard=shard, stage=s) for s in range(self.pp)]

    def fsdp_ranks(self, replica: int, stage: int) -> list[int]:
        return [self.rank(replica=replica, shard=f, stage=stage) for f in range(self.fsdp)]


class StoreAddress(NamedTuple):
    """Where a coordinator incarnation's generations form their groups: a TCPStore the driver hosts."""

    host: str
    port: int
    namespace: str
    """Key prefix of one coordinator incarnation; generations go under it."""
