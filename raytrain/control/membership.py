"""Who is in the run: one object for the replicas of the current generation, the live workers
outside it (spares) and the workers still starting (pending). A replica is fsdp x pp x tp workers,
one per slot (shard, stage, tp); it is the unit of repair: losing any of its workers drops it whole.

Only these verbs change its lists (start, drop the dead, add and admit the started, fill to the
target), so every loss and every growth is counted and reported one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain.config.mesh import Mesh
from raytrain.reports.oom import OutOfMemory


@dataclass(eq=False)
class Member:
    """A worker actor, the stage (and shard) it hosts for life, the bundle it occupies and its progress."""

    handle: Any
    stage: int
    placement: Any
    bundle: int
    ready: Any = None  # resolves to the worker's pid once it is up
    pid: Optional[int] = None
    committed: int = 0
    shard: int = 0
    tp: int = 0
    """Its rank in its stage's tp group (0 unless parallel.tp > 1)."""
    saved: Any = None
    """Its last background save once finished (raytrain.reports.BackgroundSave), as its step reports say."""
    oom: Optional[OutOfMemory] = None
    """Set when the worker was lost to memory (killed for it, or its allocation failed): an ``oom`` event."""
    hung: Optional[float] = None
    """Set when the worker was killed for its silence: the seconds since its last heartbeat."""
    node: str = ""
    """The node it runs on (Ray's node id), as its last join said."""
    beat_id: Optional[int] = None
    """Its name in its heartbeats (raytrain.control.liveness), given by the worker group that started it."""

    @property
    def slot(self) -> tuple[int, int, int]:
        """(shard, stage, tp): its place in any replica."""
        return self.shard, self.stage, self.tp


@dataclass
class Membership:
    pp: int
    replicas: list[list[Member]] = field(default_factory=list)
    """The current generation: ``replicas[r][(shard * pp + stage) * tp + t]``."""
    spares: list[Member] = field(default_factory=list)
    """Live, started workers outside the generation (the rest of a broken replica, a replacement)."""
    pending: list[Member] = field(default_factory=list)
    """Workers still starting."""
    fsdp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def slots(self) -> list[tuple[int, int, int]]:
        """Every (shard, stage, tp) of a replica, in rank order."""
        return self.mesh().slot_order()

    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, fsdp=self.fsdp, tp=self.tp, pp=self.pp)

    def members(self) -> list[Member]:
        """The generation's workers in rank order."""
        return [m for rep in self.replicas for m in rep]

    def ranked(self) -> list[tuple[int, Member]]:
        mesh = self.mesh()
        return [(mesh.rank(replica=r, shard=m.shard, stage=m.stage, tp=m.tp), m)
                for r, rep in enumerate(self.replicas) for m in rep]

    def everyone(self) -> list[Member]:
        return self.members() + self.spares + self.pending

    def add_pending(self, starting: list[Member]) -> None:
        """Workers that were just spawned: they wait in ``pending`` until they have started."""
        self.pending += starting

    def start(self, started: list[Member], target_dp: int) -> None:
        """The first workers, started, form the first replicas in slot order (``pending`` empties), up
        to ``target_dp``; those beyond wait as spares (elastic.standby)."""
        size = len(self.slots)
        self.pending = [m for m in self.pending if m not in started]
        replicas = [started[r * size:(r + 1) * size] for r in range(len(started) // size)]
        self.replicas = replicas[:target_dp]
        self.spares = [m for replica in replicas[target_dp:] for m in replica]

    def restart(self, dead: Member, replacement: Member) -> None:
        """A worker died while starting: its replacement takes its place in ``pending``."""
        self.pending[self.pending.index(dead)] = replacement

    def clear(self) -> None:
        """Every worker was ended (the run is over)."""
        self.replicas, self.spares, self.pending = [], [], []

    def drop_dead(self, dead: list[Member]) -> None:
        """Remove the dead; a replica that lost a worker leaves the generation and its live workers
        become spares."""
        gone = set(map(id, dead))
        broken = [rep for rep in self.replicas if any(id(m) in gone for m in rep)]
        self.replicas = [rep for rep in self.replicas if rep not in broken]
        self.spares = [m for m in self.spares if id(m) not in gone]
        self.spares += [m for rep in broken for m in rep if id(m) not in gone]
        self.pending = [m for m in self.pending if id(m) not in gone]

    def admit(self, started: list[Member]) -> None:
        """Started workers leave ``pending`` and wait as spares."""
        for m in started:
            self.pending.remove(m)
            self.spares.append(m)

    def formable(self) -> int:
        """Replicas the spares could form: one worker of every slot each."""
        return min(sum(1 for m in self.spares if m.slot == slot) for slot in self.slots)

    def fill_to(self, target_dp: int) -> int:
        """Form replicas from spares up to ``target_dp``, most up-to-date spares first (they can be
        a slot's state source); returns how many were formed."""
        formed = 0
        while self.dp < target_dp and self.formable() > 0:
            replica = [max((m for m in self.spares if m.slot == slot), key=lambda m: m.committed)
                       for slot in self.slots]
            for m in replica:
                self.spares.remove(m)
            self.replicas.append(replica)
            formed += 1
        return formed

    def stale_stages(self, step: int) -> list[str]:
        """Slots with no member of the generation at ``step``, named ("stage 1", "shard 1 stage 0"
        when sharded, "... tp 1" with tensor parallelism)."""
        current = {m.slot for m in self.members() if m.committed == step}
        return [(f"shard {shard} stage {stage}" if self.fsdp > 1 else f"stage {stage}")
                + (f" tp {t}" if self.tp > 1 else "")
                for shard, stage, t in self.slots if (shard, stage, t) not in current]

    def sources(self, step: int) -> dict[tuple[int, int], int]:
        """For each slot, the rank of a member at ``step`` (the state every other member takes)."""
        sources: dict[tuple[int, int], int] = {}
        for rank, m in self.ranked():
            if m.committed == step:
                sources.setdefault(m.slot, rank)
        return sources

    def holders(self, step: int, excluding: list[Member]) -> Optional[list[Member]]:
        """One live member at ``step`` for every slot, in slot order (what a save needs), from the
        generation and the spares, leaving out ``excluding``; None when some slot has none."""
        gone = set(map(id, excluding))
        found: dict[tuple[int, int], Member] = {}
        for m in self.members() + self.spares:
            if id(m) not in gone and m.committed == step:
                found.setdefault(m.slot, m)
        return [found[slot] for slot in self.slots] if len(found) == len(self.slots) else None

    def set_committed(self, step: int) -> None:
        for m in self.members():
            m.committed = step

    def pids(self) -> list[Optional[int]]:
        return [m.pid for m in self.members()]
