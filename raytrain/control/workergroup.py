"""The coordinator's only contact with Ray: start worker actors in placement-group bundles, call
them, learn who died. Tests put a fake with the same methods in its place (tests/helpers.py), so
the coordinator's decisions are tested in milliseconds without processes.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain.control.membership import Member

SETUP_TIMEOUT_S = 300.0
"""Bound on any call that is not a step: start-up, joining a generation, state transfer, a save."""


class StepFailed(RuntimeError):
    """A step failed for a reason other than a lost worker (a bug, bad data): not repairable."""


class WorkersLost(Exception):
    """Internal: these members died during an operation."""

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


class RayWorkerGroup:
    """Worker actors of one class, each on one placement-group bundle."""

    def __init__(self, worker_cls, options: dict, args_for_slot: Callable[[int, int], tuple]):
        """``args_for_slot(stage, shard)``: the worker constructor's arguments for that slot."""
        self.worker_cls = ray.remote(worker_cls) if not hasattr(worker_cls, "remote") else worker_cls
        self.options, self.args_for_slot = options, args_for_slot

    def spawn(self, stage: int, placement, bundle: int, shard: int = 0) -> Member:
        handle = self.worker_cls.options(
            **self.options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle),
        ).remote(*self.args_for_slot(stage, shard))
        return Member(handle, stage, placement, bundle, ready=handle.pid.remote(), shard=shard)

    def started(self, members: list[Member], timeout: float) -> list[Member]:
        """The members whose actor is up (or failed to start) within ``timeout``."""
        if not members:
            return []
        ready, _ = ray.wait([m.ready for m in members], num_returns=len(members), timeout=timeout)
        return [m for m in members if m.ready in ready]

    def pid(self, member: Member, timeout: float) -> Optional[int]:
        """A started member's pid; None if its actor died; StepFailed if its constructor raised."""
        try:
            return ray.get(member.ready, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise StepFailed(f"a worker of stage {member.stage} did not start within {timeout:g}s although its "
                             "resources were granted; check the worker's log (ray logs) and the node's "
                             "health") from None
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:
                raise StepFailed(f"a worker of stage {member.stage} failed to start: {worker_error(e)}") from None
            return None

    def submit(self, members: list[Member], method: str, *args) -> list:
        return [getattr(m.handle, method).remote(*args) for m in members]

    def collect(self, members: list[Member], refs: list, timeout: float,
                settle_s: Optional[float] = None) -> list[Outcome]:
        """Every member's outcome, waiting up to ``timeout`` in all; with ``settle_s``, only that long
        after the first member reported a failed step (``ok`` false): its collectives failed against
        a peer, and a peer still silent once the others' have timed out is hung, not slow."""
        ready = _wait_settled(refs, timeout, settle_s)
        outcomes = []
        for m, ref in zip(members, refs):
            if ref not in ready:
                outcomes.append(Outcome(m, silent=True))
                continue
            try:
                outcomes.append(Outcome(m, ray.get(ref)))
            except ray.exceptions.RayActorError:
                outcomes.append(Outcome(m, dead=True))
            except ray.exceptions.RayTaskError as e:
                outcomes.append(Outcome(m, error=e))
        return outcomes

    def call(self, calls: list[tuple[Member, str, tuple]], timeout: float) -> list:
        """Call every member and wait; WorkersLost names the dead (a live member whose call failed
        because a peer died is not an error of its own), else StepFailed for an exception."""
        members = [m for m, _, _ in calls]
        refs = [getattr(m.handle, method).remote(*args) for m, method, args in calls]
        outcomes = self.collect(members, refs, timeout)
        dead = lost_members(self, outcomes)
        if dead:
            raise WorkersLost(dead)
        errors = [o for o in outcomes if o.error is not None]
        if errors:
            raise StepFailed(f"a worker of stage {errors[0].member.stage} failed in {calls[0][1]}: "
                             f"{worker_error(errors[0].error)}")
        return [o.value for o in outcomes]

    def kill(self, member: Member) -> None:
        """End the member's actor (at the end of a run, or when it is lost)."""
        ray.kill(member.handle, no_restart=True)

    def kill_hung(self, member: Member) -> None:
        """End a member that stopped answering, actor and process: a stopped (SIGSTOP) or hung process
        does not act on ray.kill, and would keep its bundle's resources from a replacement for ever."""
        self.kill(member)
        if member.pid is not None:
            # On the member's node: a task in the member's own bundle (it needs no resources of it).
            _kill_process.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                member.placement, placement_group_bundle_index=member.bundle)).remote(member.pid)

    def granted(self, requests: list[tuple[Any, Any]], timeout: float) -> list[tuple[Any, Any]]:
        """The (placement group, ready ref) requests Ray has granted within ``timeout``."""
        if not requests:
            return []
        ready, _ = ray.wait([r for _, r in requests], num_returns=len(requests), timeout=timeout)
        return [(pg, r) for pg, r in requests if r in ready]


POLL_S = 0.5
"""How often a wait with ``settle_s`` looks at the replies that have come."""


def _wait_settled(refs: list, timeout: float, settle_s: Optional[float]) -> list:
    """The refs ready within ``timeout``, or within ``settle_s`` of the first failed reply."""
    if settle_s is None:
        return ray.wait(refs, num_returns=len(refs), timeout=timeout)[0]
    deadline, failed_at, looked_at = time.monotonic() + timeout, None, set()
    while True:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=min(POLL_S, timeout))
        now = time.monotonic()
        if not pending or now >= deadline or (failed_at is not None and now - failed_at >= settle_s):
            return ready
        new = [ref for ref in ready if ref not in looked_at]
        looked_at.update(new)
        if failed_at is None and any(_failed(ref) for ref in new):
            failed_at = now


def _failed(ref) -> bool:
    """Whether a reply is a worker's own report of a failed step (a collective that failed against a
    peer). A dead worker's reply is not: its healthy peers may still be computing towards the
    collective where they will notice, however long their step takes."""
    try:
        value = ray.get(ref)
    except ray.exceptions.RayError:
        return False
    return isinstance(value, dict) and value.get("ok") is False


@ray.remote(num_cpus=0)
def _kill_process(pid: int) -> None:
    """SIGKILL a Ray worker process of this node (``ray::`` in its command line: a reused pid is spared)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"ray::" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass  # gone already


def spawn_in_granted(group, placements: list, slots: list[tuple[int, int]], timeout: float) -> list[Member]:
    """Start one replica's workers (one per (shard, stage) slot) in every placement group of ``placements``
    that Ray has granted within ``timeout``; those leave ``placements``."""
    members = []
    for pg, ready in group.granted(placements, timeout):
        placements.remove((pg, ready))
        members += [group.spawn(s, pg, i, shard=f) for i, (f, s) in enumerate(slots)]
    return members


def lost_members(group, outcomes: list[Outcome]) -> list[Member]:
    """The members an operation lost: dead ones, and silent ones, which are killed so that their
    bundle is free for a replacement (a hung actor would hold it for ever)."""
    for o in outcomes:
        if o.silent:
            group.kill_hung(o.member)
    return [o.member for o in outcomes if o.dead or o.silent]


def worker_error(error: Exception) -> str:
    """The worker's own exception line (``ValueError: ...``) out of Ray's wrapped traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if ":" in line and not line.startswith("File ")),
                lines[-1] if lines else "")
