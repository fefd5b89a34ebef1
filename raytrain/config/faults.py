"""``elastic.faults``: where and when to fail a worker, for tests and chaos runs.

A fault names a worker's slot and a moment: ``replica:stage@step:phase``, e.g. ``1:0@3:backward``
kills the worker at replica 1, stage 0 when it reaches phase ``backward`` of step 3 (0-based); with
parallel.fsdp > 1, ``replica:shard:stage@step:phase`` names a shard (``replica:stage`` is shard 0).
Set them with ``--set elastic.faults='["1:0@3:backward"]'``. Each fault fires at most once: after a
repair the coordinator drops the faults at or before the step that failed (``remaining_faults``).

Phases: ``forward`` (before the first forward of the step), ``backward`` (before the first
backward), ``allreduce`` (while its dp peers are all-reducing gradients; its buckets may have gone out
as its backward filled them, so in a purely data-parallel run the peers may complete the step and the
repair roll it forward, or fail it and retry), ``optimizer`` (after all
workers voted to commit, before this one stepped), ``checkpoint`` (half-way through writing its
shard; ``step`` is then the checkpoint's step), ``eval`` (at the start of the held-out loss computed
once ``step`` steps are committed, eval.every), ``join`` (while re-forming groups during a repair:
a failure during repair; ``step`` is the step the run resumes at). ``pause`` does not kill: the
worker stops itself (SIGSTOP) at the start of the step, as a hung machine would, until something
sends it SIGCONT; tests use it to hold a run at a known step while they act from outside.
``freeze_data`` and ``freeze_allreduce`` stop it the same way while it reads the step's samples, or as
its peers all-reduce (it sends no more than the buckets its backward launched): a worker hung in a
data read, or in a collective.
``oom`` does not kill either: at the start of the step the worker's next allocation really fails
(its address space is capped just above what it maps, RLIMIT_AS, for one torch allocation; nothing is
touched), as a worker out of memory fails; the coordinator must take it out of the run.
``sigterm`` does not kill: at the start of the step the worker sends itself SIGTERM, a preemption
notice (raytrain.worker.drain): it finishes the step, and the run must drain it at a boundary.

This module is the spec alone, pure, for the config's checks and the coordinator; the worker acts on
it through its phase hook (raytrain.worker.phases).
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain.config.errors import config_error

FREEZES = {"pause": "forward", "freeze_data": "data", "freeze_allreduce": "allreduce"}
"""A fault that stops the worker (SIGSTOP) -> the phase point where it stops."""
PHASES = ("forward", "backward", "allreduce", "optimizer", "checkpoint", "eval", "join", "oom", "sigterm", *FREEZES)
STEP_PHASES = ("pause", "freeze_data", "forward", "backward", "allreduce", "freeze_allreduce", "optimizer")
"""The phases inside ``run_step``: a step the coordinator may have sent ahead of the previous reply."""


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


def remaining_faults(faults: list[str], failed_step: int, keep_join: bool = True) -> list[str]:
    """The faults of ``faults`` still to come after a failure at ``failed_step`` (earlier ones fired or are
    moot), as the coordinator hands them to each generation.

    A ``join`` fault of that step is kept (it fires during this repair) unless ``keep_join`` is off.
    """
    parsed = [(text, Fault.parse(text)) for text in faults]
    return [text for text, f in parsed
            if f.step > failed_step or (keep_join and f.step == failed_step and f.phase == "join")]
