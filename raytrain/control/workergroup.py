"""The coordinator's only contact with Ray: the worker protocol (raytrain.control.protocol) over
worker actors in placement-group bundles. Tests put a fake implementing the same protocol in its
place (tests/helpers.py), so the coordinator's decisions are tested in milliseconds without processes.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.control.membership import Member
from raytrain.control.protocol import (SETUP_TIMEOUT_S, Outcome, StepFailed, WorkerGroup, WorkersLost,
                                       lost_members)
from raytrain.reports import EvalReport, JoinReport, ShardReport, StepReport


class RayWorkerGroup(WorkerGroup):
    """Worker actors of one class (raytrain.worker.actor.StageWorker), each on one placement-group bundle."""

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

    def collect(self, members: list[Member], replies: list, timeout: float,
                settle_s: Optional[float] = None) -> list[Outcome]:
        """Every member's outcome, waiting up to ``timeout`` in all; with ``settle_s``, only that long
        after the first member reported a failed step (``ok`` false): its collectives failed against
        a peer, and a peer still silent once the others' have timed out is hung, not slow."""
        ready = _wait_settled(replies, timeout, settle_s)
        outcomes = []
        for m, ref in zip(members, replies):
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

    # --- calls every member answers before the caller goes on ----------------------------------

    def join(self, ranked: list[tuple[int, Member]], mesh: Mesh, shares: list[int], store: StoreAddress,
             generation: int, faults: list[str]) -> list[JoinReport]:
        members = [m for _, m in ranked]
        replies = [m.handle.join.remote(rank, mesh, shares, store, generation, faults) for rank, m in ranked]
        return self._answers("join", members, replies, SETUP_TIMEOUT_S)

    def sync_state(self, sources: list[tuple[Member, int]]) -> list[int]:
        members = [m for m, _ in sources]
        replies = [m.handle.sync_state.remote(src_rank) for m, src_rank in sources]
        return self._answers("sync_state", members, replies, SETUP_TIMEOUT_S)

    def skip_step(self, members: list[Member], step: int) -> list[int]:
        replies = [m.handle.skip_step.remote(step) for m in members]
        return self._answers("skip_step", members, replies, SETUP_TIMEOUT_S)

    def evaluate(self, members: list[Member], timeout: float) -> list[EvalReport]:
        replies = [m.handle.evaluate.remote() for m in members]
        return self._answers("evaluate", members, replies, timeout)

    def save(self, members: list[Member], ckpt_dir: str) -> list[ShardReport]:
        replies = [m.handle.save.remote(ckpt_dir) for m in members]
        return self._answers("save", members, replies, SETUP_TIMEOUT_S)

    def load(self, members: list[Member], ckpt_dir: str) -> None:
        replies = [m.handle.load.remote(ckpt_dir) for m in members]
        self._answers("load", members, replies, SETUP_TIMEOUT_S)

    def state_digest(self, members: list[Member]) -> list[str]:
        replies = [m.handle.state_digest.remote() for m in members]
        return self._answers("state_digest", members, replies, SETUP_TIMEOUT_S)

    def _answers(self, what: str, members: list[Member], replies: list, timeout: float) -> list:
        """Every member's answer; WorkersLost names the dead (a live member whose call failed
        because a peer died is not an error of its own), else StepFailed for an exception."""
        outcomes = self.collect(members, replies, timeout)
        dead = lost_members(self, outcomes)
        if dead:
            raise WorkersLost(dead)
        errors = [o for o in outcomes if o.error is not None]
        if errors:
            raise StepFailed(f"a worker of stage {errors[0].member.stage} failed in {what}: "
                             f"{worker_error(errors[0].error)}")
        return [o.value for o in outcomes]

    # --- calls whose replies are collected later -----------------------------------------------

    def send_step(self, members: list[Member], step: int, trace: bool) -> list:
        return [m.handle.run_step.remote(step, trace) for m in members]

    def send_commit_prepared(self, members: list[Member], step: int) -> list:
        return [m.handle.commit_prepared.remote(step) for m in members]

    def send_leave(self, members: list[Member]) -> None:
        for m in members:
            m.handle.leave.remote()

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
    return isinstance(value, StepReport) and not value.ok


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


def worker_error(error: Exception) -> str:
    """The worker's own exception line (``ValueError: ...``) out of Ray's wrapped traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if ":" in line and not line.startswith("File ")),
                lines[-1] if lines else "")
