"""Fault injection for tests and chaos runs: SIGKILL a worker's own process at a chosen point.

A fault names a pipeline slot and a moment: ``replica:stage@step:phase``, e.g. ``1:0@3:backward``
kills the worker at replica 1, stage 0 when it reaches phase ``backward`` of step 3 (0-based).
Set them with ``--set elastic.faults='["1:0@3:backward"]'``. Each fault fires at most once: after a
repair the coordinator drops the faults at or before the step that failed.

Phases: ``forward`` (before the first forward of the step), ``backward`` (before the first
backward), ``allreduce`` (while its dp peers are all-reducing gradients), ``optimizer`` (after all
workers voted to commit, before this one stepped), ``checkpoint`` (half-way through writing its
shard; ``step`` is then the checkpoint's step), ``join`` (while re-forming groups during a repair:
a failure during repair; ``step`` is the step the run resumes at).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

REPLY_FLUSH_S = 0.2
"""A fault waits this long before it kills: replies this worker already sent (the previous step's,
which the coordinator may not have read yet while this step runs ahead) leave the process first,
as they would when a real crash strikes in the middle of a step rather than microseconds after a reply."""

PHASES = ("forward", "backward", "allreduce", "optimizer", "checkpoint", "join")


@dataclass(frozen=True)
class Fault:
    replica: int
    stage: int
    step: int
    phase: str

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            where, _, when = text.partition("@")
            replica, stage = (int(v) for v in where.split(":"))
            step, phase = when.split(":")
            fault = cls(replica, stage, int(step), phase)
        except ValueError:
            raise ValueError(f"elastic.faults entry {text!r} must look like 'replica:stage@step:phase', e.g. '1:0@3:backward'") from None
        if fault.phase not in PHASES:
            raise ValueError(f"elastic.faults entry {text!r}: phase must be one of {', '.join(PHASES)}")
        return fault

    def __str__(self) -> str:
        return f"{self.replica}:{self.stage}@{self.step}:{self.phase}"


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no exception handlers, exactly like a lost machine."""
    os.kill(os.getpid(), signal.SIGKILL)


def kill_process(pid: int) -> None:
    """SIGKILL another process (a worker, by the pid it reported) from outside."""
    os.kill(pid, signal.SIGKILL)


class FaultPlan:
    """The faults that concern one worker; ``maybe_fire`` kills the process when one matches."""

    def __init__(self, faults: list[str]):
        self.faults = [Fault.parse(f) for f in faults]

    def due(self, replica: int, stage: int, step: int, phase: str) -> bool:
        return any((f.replica, f.stage, f.step, f.phase) == (replica, stage, step, phase) for f in self.faults)

    def maybe_fire(self, replica: int, stage: int, step: int, phase: str) -> None:
        if self.due(replica, stage, step, phase):
            time.sleep(REPLY_FLUSH_S)
            kill_self()

    @staticmethod
    def remaining(faults: list[str], failed_step: int, keep_join: bool = True) -> list[str]:
        """Faults still to come after a failure at ``failed_step`` (earlier ones fired or are moot).

        A ``join`` fault of that step is kept (it fires during this repair) unless ``keep_join`` is off.
        """
        parsed = [(text, Fault.parse(text)) for text in faults]
        return [text for text, f in parsed
                if f.step > failed_step or (keep_join and f.step == failed_step and f.phase == "join")]
