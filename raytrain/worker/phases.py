"""The phase points of a worker, as a seam for fault injection.

A stage calls its ``PhaseHook`` at each phase point of raytrain.config.faults.PHASES (raytrain.worker.stage,
raytrain.worker.executor); the hook does nothing unless ``phase_hook`` armed it with ``elastic.faults``
for that worker's slot. Then it kills the worker's own process (SIGKILL: no cleanup, no exception
handlers, exactly like a lost machine), stops it (``pause``: SIGSTOP), makes its next allocation fail
(``oom``) or sends it a preemption notice (``sigterm``), as the fault spec says. The executor holds no
fault logic.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from raytrain.config.faults import FREEZES, STEP_PHASES, Fault
from raytrain.reports.ack import ReplyAck

REPLY_READ_TIMEOUT_S = 60.0
"""Bound on a step fault's wait for the caller to read the previous step's reply (it always does
unless the caller itself is gone); after it the fault fires anyway."""
OOM_MARGIN_BYTES = 64 << 20
"""How far above its mapped size an ``oom`` fault caps the worker's address space."""


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
        for freeze, where in FREEZES.items():
            if phase == where and (step, freeze) in self._due:
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


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no exception handlers, exactly like a lost machine."""
    os.kill(os.getpid(), signal.SIGKILL)


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
