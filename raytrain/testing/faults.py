"""Fault injection for tests and chaos runs: SIGKILL a worker's own process at a chosen point.

A fault names a worker's slot and a moment: ``replica:stage@step:phase``, e.g. ``1:0@3:backward``
kills the worker at replica 1, stage 0 when it reaches phase ``backward`` of step 3 (0-based); with
parallel.fsdp > 1, ``replica:shard:stage@step:phase`` names a shard (``replica:stage`` is shard 0).
Set them with ``--set elastic.faults='["1:0@3:backward"]'``. Each fault fires at most once: after a
repair the coordinator drops the faults at or before the step that failed.

Phases: ``forward`` (before the first forward of the step), ``backward`` (before the first
backward), ``allreduce`` (while its dp peers are all-reducing gradients), ``optimizer`` (after all
workers voted to commit, before this one stepped), ``checkpoint`` (half-way through writing its
shard; ``step`` is then the checkpoint's step), ``eval`` (at the start of the held-out loss computed
once ``step`` steps are committed, eval.every), ``join`` (while re-forming groups during a repair:
a failure during repair; ``step`` is the step the run resumes at). ``pause`` does not kill: the
worker stops itself (SIGSTOP) at the start of the step, as a hung machine would, until something
sends it SIGCONT; tests use it to hold a run at a known step while they act from outside.
``oom`` does not kill either: at the start of the step the worker's next allocation really fails
(its address space is capped just above what it maps, RLIMIT_AS, for one torch allocation; nothing is
touched), as a worker out of memory fails; the coordinator must take it out of the run.
``sigterm`` does not kill: at the start of the step the worker sends itself SIGTERM, a preemption
notice (raytrain.worker.drain): it finishes the step, and the run must drain it at a boundary.

A worker calls its ``PhaseHook`` at each of these points (raytrain.worker.stage); the hook does nothing
unless ``phase_hook`` gave it faults for that worker's slot. The executor holds no fault logic.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from typing import Optional

from raytrain.config.errors import config_error

PHASES = ("forward", "backward", "allreduce", "optimizer", "checkpoint", "eval", "join", "pause", "oom", "sigterm")
STEP_PHASES = ("pause", "forward", "backward", "allreduce", "optimizer")
"""The phases inside ``run_step``: a step the coordinator may have sent ahead of the previous reply."""

REPLY_READ_TIMEOUT_S = 60.0
"""Bound on a step fault's wait for the caller to read the previous step's reply (it always does
unless the caller itself is gone); after it the fault fires anyway."""
ACK_CONNECT_TIMEOUT_S = 5.0
"""Bound on the caller's connection back to a worker that waits for it (see ``ReplyAck``)."""


@dataclass(frozen=True)
class Fault:
    replica: int
    stage: int
    step: int
    phase: str
    shard: int = 0

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            where, _, when = text.partition("@")
            place = [int(v) for v in where.split(":")]
            if len(place) not in (2, 3):
                raise ValueError(where)
            replica, stage, shard = (place[0], place[1], 0) if len(place) == 2 else (place[0], place[2], place[1])
            step, phase = when.split(":")
            fault = cls(replica, stage, int(step), phase, shard)
        except ValueError:
            shape = ("an entry looks like 'replica:stage@step:phase' (or 'replica:shard:stage@step:phase' with "
                     "parallel.fsdp > 1), e.g. '1:0@3:backward'")
            raise config_error("elastic.faults", text, shape) from None
        if fault.phase not in PHASES:
            raise config_error("elastic.faults", text, f"phase must be one of {', '.join(PHASES)}")
        return fault

    def __str__(self) -> str:
        where = f"{self.replica}:{self.shard}:{self.stage}" if self.shard else f"{self.replica}:{self.stage}"
        return f"{where}@{self.step}:{self.phase}"


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no exception handlers, exactly like a lost machine."""
    os.kill(os.getpid(), signal.SIGKILL)


OOM_MARGIN_BYTES = 64 << 20
"""How far above its mapped size an ``oom`` fault caps the worker's address space."""


def fail_allocation() -> None:
    """Make an allocation of this process really fail: cap its address space (RLIMIT_AS) just above what
    it maps now, ask torch's allocator for more than the margin, and restore the limit at once. The
    failed mapping never had a page, so no memory is used; torch raises its allocator's RuntimeError."""
    import resource

    import torch

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _mapped_bytes() + OOM_MARGIN_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        torch.empty(4 * OOM_MARGIN_BYTES, dtype=torch.uint8)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    raise MemoryError("an oom fault's allocation did not fail under RLIMIT_AS")


def _mapped_bytes() -> int:
    """This process's mapped address space (VmSize)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def kill_process(pid: int) -> None:
    """SIGKILL another process (a worker, by the pid it reported) from outside."""
    os.kill(pid, signal.SIGKILL)


class FaultPlan:
    """The faults of a run, as the coordinator hands them to each generation."""

    @staticmethod
    def remaining(faults: list[str], failed_step: int, keep_join: bool = True) -> list[str]:
        """Faults still to come after a failure at ``failed_step`` (earlier ones fired or are moot).

        A ``join`` fault of that step is kept (it fires during this repair) unless ``keep_join`` is off.
        """
        parsed = [(text, Fault.parse(text)) for text in faults]
        return [text for text, f in parsed
                if f.step > failed_step or (keep_join and f.step == failed_step and f.phase == "join")]


# --- the hook a worker calls ----------------------------------------------------------------------


class PhaseHook:
    """A worker's phase points, as a seam: this one does nothing. ``phase_hook`` makes one that kills."""

    def __call__(self, phase: str, step: int, file: Optional[str] = None) -> None:
        """The worker reached ``phase`` of ``step``; ``file`` is the checkpoint file it is about to write."""

    def reply(self, step: int, result):
        """What the worker's actor returns to the caller of ``run_step(step)``: ``result`` itself here."""
        return result


class FaultHook(PhaseHook):
    """Kills the worker at the (step, phase) points of its faults.

    A step fault fires only once the caller has read this worker's reply to the step before: the
    coordinator may send a step before that reply left the process (a worker runs it as soon as the
    previous one returns), and a kill microseconds after the return would take the reply with it,
    making the fault strike the step before in effect. ``reply`` arms that wait (``ReplyAck``).
    """

    def __init__(self, faults: list[Fault]):
        self._due = {(f.step, f.phase) for f in faults}
        self._acks: dict[int, ReplyAck] = {}  # step -> the ack of the reply to the step before it

    def __call__(self, phase: str, step: int, file: Optional[str] = None) -> None:
        if phase == "forward" and (step, "pause") in self._due:
            self._wait_for_reply(step)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until someone sends SIGCONT
        if phase == "forward" and (step, "sigterm") in self._due:
            self._due.discard((step, "sigterm"))
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: the worker drains (raytrain.worker.drain)
        if phase == "forward" and (step, "oom") in self._due:
            self._due.discard((step, "oom"))
            fail_allocation()
        if (step, phase) not in self._due:
            return
        if phase == "checkpoint" and file is not None:
            from raytrain import checkpoint

            checkpoint.write_bytes(file, b"half a shard")  # what a crash half-way through the write leaves
        if phase in STEP_PHASES:
            self._wait_for_reply(step)
        kill_self()

    def _wait_for_reply(self, step: int) -> None:
        """Until the caller has read the reply to the step before ``step`` (see the class docstring)."""
        ack = self._acks.pop(step, None)
        if ack is not None:
            ack.wait(REPLY_READ_TIMEOUT_S)

    def reply(self, step: int, result):
        if not any((step + 1, phase) in self._due for phase in STEP_PHASES):
            return result
        self._acks[step + 1] = ack = ReplyAck()
        return ack.attach(result)


def phase_hook(faults: list[str], replica: int, stage: int, shard: int = 0) -> PhaseHook:
    """The hook for the worker at (replica, stage, shard): one that kills it where ``faults`` say, if any do."""
    mine = [f for f in map(Fault.parse, faults) if (f.replica, f.stage, f.shard) == (replica, stage, shard)]
    return FaultHook(mine) if mine else PhaseHook()


# --- knowing that the caller has read a reply ---------------------------------------------------


class ReplyAck:
    """Learn when the caller has read one reply: the reply connects back here as it is deserialised.

    Ray deserialises an actor method's result in the caller's process, when the caller gets it; so
    a result whose unpickling opens a connection to this worker proves that the caller holds it.
    Unpickled, the reply is the report it carried. Nothing here sleeps or guesses a delay.
    """

    def __init__(self):
        self._server = socket.create_server(("", 0))  # every interface: the caller may be on another node
        self.address = (_node_address(), self._server.getsockname()[1])

    def attach(self, result):
        return _AckingReply(result, self.address)

    def wait(self, timeout_s: float) -> bool:
        """Block until the reply was read (True) or ``timeout_s`` passed (False)."""
        self._server.settimeout(timeout_s)
        try:
            conn, _ = self._server.accept()
            conn.close()
            return True
        except TimeoutError:
            return False
        finally:
            self._server.close()


class _AckingReply:
    """A reply that, unpickled in the caller, connects back to the worker and becomes the reply itself."""

    def __init__(self, result, address: tuple[str, int]):
        self.result, self.address = result, address

    def __reduce__(self):
        return _acknowledge, (self.result, self.address)


def _acknowledge(result, address: tuple[str, int]):
    """Runs in the caller as it deserialises the reply: tell the worker, return the reply itself."""
    try:
        socket.create_connection(address, timeout=ACK_CONNECT_TIMEOUT_S).close()
    except OSError:
        pass  # the worker is gone already: nobody waits for this
    return result


def _node_address() -> str:
    """This machine's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
