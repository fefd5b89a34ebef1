"""The worker protocol: everything the coordinator asks of its workers, as one typed interface.

``RayWorkerGroup`` (raytrain.control.workergroup) implements it over Ray actors, and the tests' fake
(tests/helpers.FakeWorkerGroup) in-process; tests/test_protocol.py checks that both implement every
method with the same signature and that each worker call names a method of the worker actor. The
replies are the dataclasses of raytrain.reports.

Two kinds of call: those every member answers before the caller goes on (``join``, ``save``, ...:
``WorkersLost`` names the dead, ``StepFailed`` carries a worker's exception), and those whose replies
are collected later (``send_step``, ``send_commit_prepared``: the coordinator sends the next step
before the current one's replies arrive, and settles a step's outcome member by member).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.control.membership import Member
from raytrain.reports import BackgroundSave, EvalReport, JoinReport, ShardReport

SETUP_TIMEOUT_S = 300.0
"""Bound on any call that is not a step: start-up, joining a generation, state transfer, a save."""


class StepFailed(RuntimeError):
    """A step failed for a reason other than a lost worker (a bug, bad data): not repairable."""


class WorkersLost(Exception):
    """These members died (or hung and were killed) during an operation."""

    def __init__(self, dead: list[Member]):
        super().__init__(f"{len(dead)} worker(s) lost")
        self.dead = dead


@dataclass
class Outcome:
    """One member's answer to a call: its value, or that it died, raised or stayed silent."""

    member: Member
    value: Any = None
    dead: bool = False
    error: Optional[Exception] = None
    silent: bool = False

    @property
    def answered(self) -> bool:
        """The member replied (with a value or an exception): it is alive."""
        return not (self.dead or self.silent)


class WorkerGroup(ABC):
    """The coordinator's workers: start them, call them, learn who died."""

    # --- starting and ending workers ----------------------------------------------------------

    @abstractmethod
    def spawn(self, stage: int, placement, bundle: int, shard: int = 0, tp: int = 0) -> Member:
        """Start a worker for (``shard``, ``stage``, ``tp``) on ``bundle`` of ``placement``; it starts in the
        background."""

    @abstractmethod
    def spawn_elsewhere(self, stage: int, shard: int = 0, tp: int = 0) -> Member:
        """Start a worker for that slot in a placement group of its own (one bundle), reserved now: a
        replacement that starts while the worker it replaces still holds its bundle."""

    @abstractmethod
    def cancel_elsewhere(self, member: Member) -> None:
        """End a worker, started or not; if ``spawn_elsewhere`` started it, give its placement group back."""

    @abstractmethod
    def close(self) -> None:
        """Give back what the group reserved itself (``spawn_elsewhere``'s placement groups)."""

    @abstractmethod
    def started(self, members: list[Member], timeout: float) -> list[Member]:
        """The members whose actor is up (or failed to start) within ``timeout``."""

    @abstractmethod
    def pid(self, member: Member, timeout: float) -> Optional[int]:
        """A started member's pid; None if it died; StepFailed if its constructor raised."""

    @abstractmethod
    def granted(self, requests: list[tuple[Any, Any]], timeout: float) -> list[tuple[Any, Any]]:
        """The (placement group, ready token) requests the cluster granted within ``timeout``."""

    @abstractmethod
    def kill(self, member: Member) -> None:
        """End the member's worker (at the end of a run, or when it is lost)."""

    @abstractmethod
    def kill_hung(self, member: Member) -> None:
        """End a member that stopped answering, process and all, so that its bundle is free."""

    # --- calls every member answers before the caller goes on ---------------------------------

    @abstractmethod
    def join(self, ranked: list[tuple[int, Member]], mesh: Mesh, shares: list[int], store: StoreAddress,
             generation: int, faults: list[str]) -> list[JoinReport]:
        """Every (rank, member) forms ``generation``'s groups at ``store`` (a collective)."""

    @abstractmethod
    def sync_state(self, sources: list[tuple[Member, int]]) -> list[int]:
        """Every member takes its slot's state from the rank paired with it; their committed steps."""

    @abstractmethod
    def skip_step(self, members: list[Member], step: int) -> list[int]:
        """Count ``step`` as done without applying it; their committed steps."""

    @abstractmethod
    def evaluate(self, members: list[Member], timeout: float) -> list[EvalReport]:
        """The held-out loss of the committed parameters (a collective)."""

    @abstractmethod
    def save(self, members: list[Member], ckpt_dir: str) -> list[ShardReport]:
        """Each member writes its shard into ``ckpt_dir``."""

    @abstractmethod
    def start_save(self, members: list[Member], ckpt_dir: str) -> list[float]:
        """Each member snapshots its shard and writes it into ``ckpt_dir`` in the background; the seconds
        each snapshot took. Each member's step reports carry the write's result once it is done."""

    @abstractmethod
    def finish_save(self, members: list[Member]) -> list[Optional[BackgroundSave]]:
        """Each member's background save, once it has finished (they are waited for)."""

    @abstractmethod
    def load(self, members: list[Member], ckpt_dir: str) -> None:
        """Each member loads its part of the checkpoint at ``ckpt_dir``."""

    @abstractmethod
    def state_digest(self, members: list[Member]) -> list[str]:
        """A digest of each member's parameters and optimizer state."""

    # --- calls whose replies are collected later ----------------------------------------------

    @abstractmethod
    def send_step(self, members: list[Member], step: int, trace: bool, hold: bool = False) -> list:
        """Send ``run_step``; its replies (raytrain.reports.StepReport) come through ``collect``. ``hold``:
        a member told to leave does not vote to go (its replacement is starting)."""

    @abstractmethod
    def send_commit_prepared(self, members: list[Member], step: int) -> list:
        """Send the roll-forward of ``step``; its replies (committed steps) come through ``collect``."""

    @abstractmethod
    def send_leave(self, members: list[Member]) -> None:
        """Ask members to drop their process groups now (no reply is awaited)."""

    @abstractmethod
    def collect(self, members: list[Member], replies: list, timeout: float,
                settle_s: Optional[float] = None) -> list[Outcome]:
        """Every member's outcome, waiting up to ``timeout`` in all; with ``settle_s``, only that long
        after the first member reported a failed step."""


def lost_members(worker_group: WorkerGroup, outcomes: list[Outcome]) -> list[Member]:
    """The members an operation lost: dead ones, and silent ones, which are killed so that their
    bundle is free for a replacement (a hung actor would hold it for ever)."""
    for o in outcomes:
        if o.silent:
            worker_group.kill_hung(o.member)
    return [o.member for o in outcomes if not o.answered]


def spawn_in_granted(worker_group: WorkerGroup, placements: list, slots: list[tuple[int, int, int]],
                     timeout: float) -> list[Member]:
    """Start one replica's workers (one per (shard, stage, tp) slot) in every replica placement of ``placements``
    (raytrain.control.crew.ReplicaPlacement, with its ready token) that the cluster has granted within
    ``timeout``; those leave ``placements``."""
    members = []
    for replica, ready in worker_group.granted(placements, timeout):
        placements.remove((replica, ready))
        members += [worker_group.spawn(s, *replica.where(i), shard=f, tp=t) for i, (f, s, t) in enumerate(slots)]
    return members
