"""The worker grid as one value: its dp x fsdp x tp x pp shape, the rank arithmetic the workers'
torch.distributed groups are built on (raytrain.worker.groups), and the address of the store where a
generation's groups meet.

The axes nest outermost first as (replica, shard, stage, tp): a global rank's digits are those four,
so a replica is ``fsdp x pp x tp`` consecutive ranks (its slots, ``(shard * pp + stage) * tp + t``)
and the global rank is ``replica * slots + slot``. tp is innermost: a tp group is ``tp`` consecutive
ranks, which the placement keeps on one node (its collectives run on every layer). Each worker
belongs to four groups:

- the dp group: the same shard of the same stage in every replica. Gradients are all-reduced
  there (HSDP's replicate dimension when fsdp > 1), and a new replica takes its state from it;
- the fsdp group: every shard of one stage of one replica. FSDP2 all-gathers parameters and
  reduce-scatters gradients there;
- the tp group: the workers that split each layer of one stage of one shard of one replica
  (tensor parallelism, DTensor). They read the same samples: a column is (replica, shard), not tp;
- the pp group: every stage of one shard and tp rank of one replica (a pipeline column). Activations
  flow along it, and the global gradient norm is summed over it, the tp and the fsdp group.

Groups are formed under a generation number: the store prefix changes with every membership
change, so survivors can re-form without a restart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The dp x fsdp x tp x pp grid of a run's workers. Keyword-only (``Mesh(dp=2, fsdp=2)``), so that no
    caller can swap two axes; the one place that multiplies them out."""

    dp: int = 1
    """Data-parallel replicas."""
    fsdp: int = 1
    """Workers that shard each stage of a replica (FSDP2)."""
    pp: int = 1
    """Pipeline stages of each replica."""
    tp: int = 1
    """Workers that split each layer of one stage (tensor parallelism): the innermost axis."""

    @property
    def world_size(self) -> int:
        """Workers in the grid: one per (replica, shard, stage)."""
        return self.dp * self.slots

    @property
    def slots(self) -> int:
        """Workers per replica."""
        return self.fsdp * self.pp * self.tp

    @property
    def columns(self) -> int:
        """Pipeline columns (data-parallel workers): each trains on its own slice of the global batch
        (the tp ranks of a column read the same samples)."""
        return self.dp * self.fsdp

    @property
    def grid_label(self) -> str:
        """``dp=2 pp=1``, ``dp=2 fsdp=2 pp=1``, ``dp=1 tp=2 pp=1``: how metric rows, repair events and runs
        name the grid."""
        optional = [f"{axis}={n}" for axis, n in (("fsdp", self.fsdp), ("tp", self.tp)) if n > 1]
        return " ".join([f"dp={self.dp}", *optional, f"pp={self.pp}"])

    def with_dp(self, dp: int) -> Mesh:
        """This grid with ``dp`` replicas, as a repair or a grow leaves it."""
        return dataclasses.replace(self, dp=dp)

    def rank(self, *, replica: int, shard: int = 0, stage: int, tp: int = 0) -> int:
        """The global rank of a (replica, shard, stage, tp): keyword-only, in the grid's order."""
        return ((replica * self.fsdp + shard) * self.pp + stage) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a global rank."""
        replica, slot = divmod(rank, self.slots)
        return replica, slot // self.tp % self.pp

    def shard(self, rank: int) -> int:
        """The shard (fsdp index) of a global rank."""
        return rank % self.slots // (self.pp * self.tp)

    def tp_index(self, rank: int) -> int:
        """The tp rank of a global rank within its tp group."""
        return rank % self.tp

    def label(self, rank: int) -> str:
        """``replica:stage``, ``replica:shard:stage`` when fsdp > 1, ``replica:shard:stage:tp`` when tp > 1:
        how events and digests name a worker."""
        replica, stage = self.coords(rank)
        if self.tp > 1:
            return f"{replica}:{self.shard(rank)}:{stage}:{self.tp_index(rank)}"
        return f"{replica}:{self.shard(rank)}:{stage}" if self.fsdp > 1 else f"{replica}:{stage}"

    def dp_ranks(self, stage: int, shard: int = 0, tp: int = 0) -> list[int]:
        return [self.rank(replica=r, shard=shard, stage=stage, tp=tp) for r in range(self.dp)]

    def pp_ranks(self, replica: int, shard: int = 0, tp: int = 0) -> list[int]:
        return [self.rank(replica=replica, shard=shard, stage=s, tp=tp) for s in range(self.pp)]

    def fsdp_ranks(self, replica: int, stage: int, tp: int = 0) -> list[int]:
        return [self.rank(replica=replica, shard=f, stage=stage, tp=tp) for f in range(self.fsdp)]

    def tp_ranks(self, replica: int, stage: int, shard: int = 0) -> list[int]:
        """The tp group of a (replica, shard, stage): consecutive ranks."""
        return [self.rank(replica=replica, shard=shard, stage=stage, tp=t) for t in range(self.tp)]

    def slot_order(self) -> list[tuple[int, int, int]]:
        """Every (shard, stage, tp) of a replica, in rank order."""
        return [(f, s, t) for f in range(self.fsdp) for s in range(self.pp) for t in range(self.tp)]


class StoreAddress(NamedTuple):
    """Where a coordinator incarnation's generations form their groups: a TCPStore the driver hosts."""

    host: str
    port: int
    namespace: str
    """Key prefix of one coordinator incarnation; generations go under it."""


def place_of(label: str) -> str:
    """``replica 1 stage 0`` (``replica 1 shard 1 stage 0``, ``... stage 0 tp 1``) from a worker's label
    (raytrain.config.mesh.Mesh.label)."""
    parts = label.split(":")
    names = {2: ("replica", "stage"), 3: ("replica", "shard", "stage")}.get(len(parts), ("replica", "shard", "stage", "tp"))
    return " ".join(f"{n} {v}" for n, v in zip(names, parts))
