"""The coordinator's only contact with Ray: the worker protocol (raytrain.control.protocol) over
worker actors in placement-group bundles. Tests put a fake implementing the same protocol in its
place (tests/helpers.py), so the coordinator's decisions are tested in milliseconds without processes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import signal
import time
from typing import Any, Callable, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.config.prepared import Slot, WorkerSpec
from raytrain.control.liveness import Heartbeats
from raytrain.control.membership import Member
from raytrain.control.protocol import (SETUP_TIMEOUT_S, Outcome, StepFailed, WorkerGroup, WorkersLost,
                                       lost_members)
from raytrain.reports import BackgroundSave, EvalReport, JoinReport, ShardReport, StepReport
from raytrain.reports.oom import (NodeMemory, OutOfMemory, WorkerOutOfMemory, error_line, is_out_of_memory,
                                  kernel_killed, node_memory)


class RayWorkerGroup(WorkerGroup):
    """Worker actors of one class (raytrain.worker.actor.StageWorker), each on one placement-group bundle."""

    def __init__(self, worker_cls, options: dict, spec: WorkerSpec, placement_prefix: str = "raytrain-replacement ",
                 hung: Optional["Hung"] = None):
        """``spec``: what every worker is started with, beside its slot; ``placement_prefix``: what
        spawn_elsewhere's placement groups' names start with (replacement_prefix); ``hung``: which workers
        stopped beating (raytrain.control.liveness), killed while a call waits for them."""
        self.worker_cls = ray.remote(worker_cls) if not hasattr(worker_cls, "remote") else worker_cls
        self.options, self.spec, self.hung = options, spec, hung
        self.generation: Optional[int] = None  # the generation last joined
        self.placement_prefix = placement_prefix
        self._placement_numbers = itertools.count()  # never reused: Ray refuses a second live group of a name
        self._beat_ids = itertools.count(1)
        """Each worker's name in its heartbeats: unique in the run, where pids repeat across nodes."""
        self.own_placements: list = []
        """Placement groups of spawn_elsewhere's workers, removed by close (a placement group lives as
        long as the job that made it, which outlives the run when the driver embeds it; should this
        coordinator die first, the driver removes them by their names: remove_replacement_placements)."""

    def spawn(self, stage: int, placement, bundle: int, shard: int = 0, tp: int = 0) -> Member:
        beat_id = next(self._beat_ids)
        handle = self.worker_cls.options(
            **self.options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle),
        ).remote(self.spec, Slot(stage, shard, tp), beat_id)
        return Member(handle, stage, placement, bundle, ready=handle.pid.remote(), shard=shard, tp=tp, beat_id=beat_id)

    def spawn_elsewhere(self, stage: int, shard: int = 0, tp: int = 0) -> Member:
        bundle = {"CPU": self.options["num_cpus"]}
        if self.options.get("num_gpus"):
            bundle["GPU"] = self.options["num_gpus"]
        placement = placement_group([bundle], name=f"{self.placement_prefix}{os.getpid()}-{next(self._placement_numbers)}")
        self.own_placements.append(placement)
        return self.spawn(stage, placement, 0, shard=shard, tp=tp)

    def cancel_elsewhere(self, member: Member) -> None:
        self.kill(member)
        if any(member.placement is placement for placement in self.own_placements):
            self.own_placements = [p for p in self.own_placements if p is not member.placement]
            remove_placement_group(member.placement)

    def close(self) -> None:
        for placement in self.own_placements:
            remove_placement_group(placement)
        self.own_placements = []

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
        except ray.exceptions.OutOfMemoryError as e:  # killed for memory while starting: a death
            member.oom = member.oom or memory_loss(e, member)
            return None
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:
                raise StepFailed(f"a worker of stage {member.stage} failed to start: {worker_error(e)}") from None
            member.oom = member.oom or memory_loss(e, member)
            return None

    def collect(self, members: list[Member], replies: list, timeout: float,
                settle_s: Optional[float] = None) -> list[Outcome]:
        """Every member's outcome, waiting up to ``timeout`` in all; with ``settle_s``, only that long
        after the first member reported a failed step (``ok`` false): its collectives failed against
        a peer, and a peer still silent once the others' have timed out is hung, not slow."""
        ready = _wait_settled(replies, timeout, settle_s, lambda ready, pending: self._watch(members, replies, ready,
                                                                                                pending))
        outcomes = []
        for m, ref in zip(members, replies):
            if ref not in ready:
                outcomes.append(Outcome(m, silent=True))
                continue
            try:
                outcomes.append(Outcome(m, ray.get(ref)))
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:
                m.oom = m.oom or memory_loss(e, m)
                outcomes.append(Outcome(m, dead=True))
            except ray.exceptions.RayTaskError as e:
                oom = memory_loss(e, m)
                if oom is None:
                    outcomes.append(Outcome(m, error=e))
                    continue
                # Its state is undefined after a failed allocation: it leaves the run, like a lost worker.
                m.oom = m.oom or oom
                self.kill(m)
                outcomes.append(Outcome(m, dead=True))
        return outcomes

    # --- calls every member answers before the caller goes on ----------------------------------

    def join(self, ranked: list[tuple[int, Member]], mesh: Mesh, shares: list[int], store: StoreAddress,
             generation: int, faults: list[str]) -> list[JoinReport]:
        members = [m for _, m in ranked]
        self.generation = generation  # a member lost from now on aborts this one
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

    def start_save(self, members: list[Member], ckpt_dir: str) -> list[float]:
        replies = [m.handle.start_save.remote(ckpt_dir) for m in members]
        return self._answers("start_save", members, replies, SETUP_TIMEOUT_S)

    def finish_save(self, members: list[Member]) -> list[Optional[BackgroundSave]]:
        replies = [m.handle.finish_save.remote() for m in members]
        return self._answers("finish_save", members, replies, SETUP_TIMEOUT_S)

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

    def send_step(self, members: list[Member], step: int, trace: bool, hold: bool = False) -> list:
        return [m.handle.run_step.remote(step, trace, hold) for m in members]

    def send_commit_prepared(self, members: list[Member], step: int) -> list:
        return [m.handle.commit_prepared.remote(step) for m in members]

    def send_leave(self, members: list[Member]) -> None:
        for m in members:
            m.handle.leave.remote()

    def _watch(self, members: list[Member], replies: list, ready: list, pending: list) -> None:
        """While a call waits: kill the members whose reply is pending and whose heartbeat stopped (``Hung``),
        once each, and once a member is lost (killed so, or its actor dead) have the generation's survivors
        abort their process groups, so that a collective blocked on it returns (raytrain.control.liveness)."""
        if self.hung is None:
            return
        waiting = [m for m, ref in zip(members, replies) if ref in pending and m.hung is None]
        killed = self.hung.found(waiting)
        for m, silent_s in killed:
            m.hung = round(silent_s, 1)
            self.kill_hung(m)
        if self.generation is not None and (killed or any(_loss_in(ref) == "died" for ref in ready)):
            self.hung.heartbeats.abort(self.generation)

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
        """The (replica placement, ready ref) requests Ray has granted within ``timeout``."""
        if not requests:
            return []
        ready, _ = ray.wait([r for _, r in requests], num_returns=len(requests), timeout=timeout)
        return [(pg, r) for pg, r in requests if r in ready]


POLL_S = 0.5
"""How often a wait with ``settle_s`` looks at the replies that have come."""


class Hung:
    """Which workers stopped beating for longer than elastic.detect_timeout_s (raytrain.control.liveness)."""

    def __init__(self, heartbeats: Heartbeats, detect_timeout_s: float):
        self.heartbeats, self.detect_timeout_s = heartbeats, detect_timeout_s

    def found(self, members: list[Member]) -> list[tuple[Member, float]]:
        """Of ``members``, those silent too long, with their seconds of silence."""
        silent = [(m, self.heartbeats.silent_s(m.beat_id)) for m in members]
        return [(m, s) for m, s in silent if s > self.detect_timeout_s]


def _wait_settled(refs: list, timeout: float, settle_s: Optional[float],
                  on_poll: Callable[[list, list], None] = lambda ready, pending: None) -> list:
    """The refs ready within ``timeout``, or (with ``settle_s``) within ``settle_s`` of the first failed reply;
    ``on_poll(ready refs, pending refs)`` every POLL_S meanwhile (the silent are killed there).

    With ``settle_s``, a loss (a failed reply or a dead worker) also extends the wait to ``settle_s`` after it:
    a survivor blocked in a collective with the lost peer returns only when its group times out
    (elastic.detect_timeout_s; gloo's abort cannot interrupt it), and is alive (it beats) until then, so
    ``timeout`` (resources.step_timeout_s) running out first must not have it killed as hung."""
    deadline, failed_at, looked_at = time.monotonic() + timeout, None, set()
    while True:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=min(POLL_S, timeout))
        now = time.monotonic()
        if not pending or now >= deadline or (failed_at is not None and now - failed_at >= settle_s):
            return ready
        on_poll(ready, pending)
        new = [ref for ref in ready if ref not in looked_at]
        looked_at.update(new)
        if settle_s is None or not new:
            continue
        losses = {_loss_in(ref) for ref in new}  # each reply read once: this runs for every step
        first_failure = failed_at is None and "failed" in losses
        if first_failure:
            failed_at = now
        if first_failure or "died" in losses:
            deadline = max(deadline, now + settle_s)


def _loss_in(ref) -> Optional[str]:
    """What a ready reply says of a loss: ``failed``, a worker's own report of a failed step (a collective
    that failed against a peer; or a worker out of memory, which left its groups: its peers fail now);
    ``died``, its actor's death (its healthy peers may still be computing towards the collective where they
    will notice, however long their step takes); None, neither."""
    try:
        value = ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError):
        return "died"
    except ray.exceptions.RayTaskError as e:
        return "failed" if memory_loss(e, None) is not None else None
    except ray.exceptions.RayError:
        return None
    return "failed" if isinstance(value, StepReport) and not value.ok else None


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


MEMORY_MONITOR = re.compile(r"killed due to the node running low on memory")
"""Ray's memory monitor's words for a worker it killed (in an OutOfMemoryError, or an ActorDiedError's
cause when the actor's death is reported before its task's)."""
RAY_NODE_MEMORY = re.compile(r"Memory on the node \(IP: (?P<ip>[^,]+), ID: [^)]*\)(?: where the task .*? was running)? "
                             r"was (?P<used>[\d.]+)\s*GB(?: used)? / (?P<total>[\d.]+)\s*GB", re.S)
"""The node's memory at the kill in that message: ``was 22.3GB used / 23.5GB limit`` (Ray 2.56 on),
``where the task (...) was running was 32.53GB / 33.28GB`` (before)."""


def memory_loss(error: Exception, member: Optional[Member]) -> Optional[OutOfMemory]:
    """Whether a call's Ray error says its worker ran out of memory, and how; None when it did not (or
    nothing can tell). Ray's memory monitor names itself; a worker's own failed allocation comes as
    its exception (raytrain.worker.actor raises WorkerOutOfMemory with its node's memory); a plain
    death is the kernel's OOM killer only where this node's kernel log names the worker's pid."""
    text = str(error)
    if isinstance(error, ray.exceptions.OutOfMemoryError) or (
            isinstance(error, ray.exceptions.RayActorError) and MEMORY_MONITOR.search(text)):
        return killed_by_ray_monitor(text)
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, WorkerOutOfMemory):
            return OutOfMemory("allocation failed", cause.error, node=cause.node, memory=cause.memory)
        if isinstance(cause, BaseException) and is_out_of_memory(cause):
            return OutOfMemory("allocation failed", error_line(cause))
        return None
    if (isinstance(error, ray.exceptions.ActorDiedError) and "ray.kill" not in text and member is not None
            and member.pid and kernel_killed(member.pid)):
        return OutOfMemory("kernel oom killer", f"the kernel's log: Killed process {member.pid}",
                           node=ray.util.get_node_ip_address(), memory=node_memory())
    return None


def killed_by_ray_monitor(message: str) -> OutOfMemory:
    """An OutOfMemory from Ray's memory monitor's message, with the node's memory at the kill."""
    found = RAY_NODE_MEMORY.search(message)
    memory, node = None, ""
    if found:
        total, used = float(found["total"]), float(found["used"])
        memory = NodeMemory(round(total * 1024), round(max(total - used, 0.0) * 1024), "Ray's memory monitor at the kill")
        node = found["ip"]
    line = next((ln.strip() for ln in message.splitlines() if MEMORY_MONITOR.search(ln)), message.strip()[:300])
    return OutOfMemory("ray memory monitor", line, node=node, memory=memory)


def replacement_prefix(cfg) -> str:
    """The start of the names of a run's replacement placement groups (RayWorkerGroup.spawn_elsewhere):
    a digest of its checkpoint.dir, which no two live runs share (raytrain.driver.lease), and which may
    be a URI holding credentials, not to be shown in names every user of the cluster can list."""
    return f"raytrain-replacement-{hashlib.sha1(str(cfg.checkpoint.dir).encode()).hexdigest()[:16]}-"


def remove_replacement_placements(prefix: str) -> None:
    """Remove the live placement groups whose names start with ``prefix`` (a lost coordinator's)."""
    for entry in ray.util.placement_group_table().values():
        if entry.get("name", "").startswith(prefix) and entry["state"] != "REMOVED":
            try:
                remove_placement_group(ray.util.get_placement_group(entry["name"]))
            except ValueError:  # removed meanwhile (by its coordinator), or not in this job's namespace
                continue


def worker_error(error: Exception) -> str:
    """The worker's own exception line (``ValueError: ...``) out of Ray's wrapped traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if ":" in line and not line.startswith("File ")),
                lines[-1] if lines else "")
