"""Where a run's wall time goes: goodput, the time in training steps that were committed and kept,
and badput, the rest, by cause (Google's ML Goodput; Meta's effective training time ratio).

The coordinator charges every second of its own life to one account: each state's handler its time
to the state's cause (evaluating to ``evaluation``, a save to ``checkpoint``, a repair or a grow to
``re_forming``), a committed step its time to goodput but for the wait for its batch (``data``) and
for compiling its layers (train.compile: ``start_up``). A repair charges the wait for replacements
(``waiting_for_capacity``) and a reload from the checkpoint (``state_transfer``) apart; a reload moves
the steps it undoes from goodput to ``work_redone``. A step lost with a worker is charged as work
redone up to a typical step's time and as ``detection`` beyond it (the time to notice the loss). The
driver adds the time before the coordinator's clock started (placement, the coordinator's start) to
``start_up``, and the life of coordinators that were lost to ``coordinator_restart``, so that goodput
and badput sum to the wall time from the launch (``Goodput``).

Pure: no torch, no Ray.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

CAUSES = ("start_up", "data", "checkpoint", "evaluation", "detection", "re_forming", "state_transfer",
          "waiting_for_capacity", "work_redone", "coordinator_restart", "other")
"""Badput by cause; ``other`` is the coordinator's own dispatch between steps."""
CAUSE_OF_STATE = {"starting": "start_up", "running": "other", "evaluating": "evaluation",
                  "checkpointing": "checkpoint", "stopping": "checkpoint", "repairing": "re_forming",
                  "draining": "re_forming", "growing": "re_forming"}
"""The account a state's handler time goes to, less what the handler charged itself."""


@dataclass
class TimeBook:
    """The coordinator's accounts, in seconds, from the start of its run (``start``) on."""

    clock: Callable[[], float] = time.perf_counter
    started: float = field(default=0.0)
    good_s: float = 0.0
    badput_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    _good_by_step: dict[int, float] = field(default_factory=dict)
    _charged: float = 0.0
    """Charged by name during the current handler (the rest of its time goes to its state's cause)."""
    _lost_redone: float = 0.0
    """The work-redone part of the last lost step, taken back should the repair roll the step forward."""

    def __post_init__(self):
        self.started = self.started or self.clock()

    def start(self) -> None:
        """The clock starts again (the coordinator's ``run``: what came before is the driver's start-up)."""
        self.started = self.clock()

    def charge(self, cause: str, seconds: float) -> None:
        self.badput_s[cause] += seconds
        self._charged += seconds

    def committed(self, step: int, seconds: float, data_s: float = 0.0, compile_s: float = 0.0) -> None:
        """A step ran to its commit in ``seconds``, ``data_s`` of them waiting for its batch and ``compile_s``
        compiling its layers (train.compile: start-up work done in the first step)."""
        data = min(max(data_s, 0.0), seconds)
        compiling = min(max(compile_s, 0.0), seconds - data)
        self.charge("data", data)
        self.charge("start_up", compiling)
        good = seconds - data - compiling
        self._good_by_step[step] = good
        self.good_s += good
        self._charged += good

    def lost_step(self, seconds: float) -> None:
        """A step that ran ``seconds`` and lost a worker: redone work up to a typical step, then detection."""
        typical = statistics.median(self._good_by_step.values()) if self._good_by_step else 0.0
        self._lost_redone = min(seconds, typical)
        self.charge("work_redone", self._lost_redone)
        self.charge("detection", seconds - self._lost_redone)

    def rolled_forward(self, step: int) -> None:
        """The repair committed the lost step after all (every worker had voted for it): its work counts."""
        self.badput_s["work_redone"] -= self._lost_redone
        self._good_by_step[step] = self._lost_redone
        self.good_s += self._lost_redone
        self._lost_redone = 0.0

    def rewind(self, step: int) -> None:
        """A reload to ``step``'s checkpoint: the steps from ``step`` on will run again."""
        undone = [s for s in self._good_by_step if s >= step]
        seconds = sum(self._good_by_step.pop(s) for s in undone)
        self.good_s -= seconds
        self.badput_s["work_redone"] += seconds

    def handled(self, state: str, seconds: float) -> None:
        """A state's handler took ``seconds``: what it did not charge by name goes to the state's cause."""
        self.badput_s[CAUSE_OF_STATE[state]] += max(0.0, seconds - self._charged)
        self._charged = 0.0

    def record(self) -> dict:
        """The accounts for the driver (RunSummary.time_book): seconds since the clock started."""
        return {"span_s": self.clock() - self.started, "good_s": self.good_s, "badput_s": dict(self.badput_s)}


@dataclass
class Goodput:
    """A run's goodput: committed training time over the wall time from the launch, and badput by cause."""

    wall_s: float
    good_s: float
    badput_s: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.good_s / self.wall_s if self.wall_s > 0 else 0.0

    @classmethod
    def of(cls, book: dict, wall_s: float, restart_s: float = 0.0) -> "Goodput":
        """From the last coordinator's ``book`` (TimeBook.record) and the driver's wall time from the launch.
        The time before that coordinator's clock started is start-up (placement, the coordinator actor's
        start), but for ``restart_s``: the life of coordinators that were lost, and their replacement's
        wait (the steps it redoes from the checkpoint are in that time)."""
        badput = {cause: max(0.0, s) for cause, s in book["badput_s"].items()}
        before = max(0.0, wall_s - book["span_s"])
        restart = min(max(0.0, restart_s), before)
        badput["coordinator_restart"] += restart
        badput["start_up"] += before - restart
        return cls(wall_s=wall_s, good_s=max(0.0, book["good_s"]), badput_s=badput)

    def record(self) -> dict:
        """For the summary JSON and metrics.jsonl: the ratio, the seconds, badput by cause (rounded)."""
        return {"goodput": round(self.ratio, 4), "wall_s": round(self.wall_s, 3), "good_s": round(self.good_s, 3),
                "badput_s": {cause: round(s, 3) for cause, s in self.badput_s.items() if s >= 0.0005}}

    def text(self) -> str:
        """One line: goodput and the three largest causes of badput."""
        worst = sorted(((s, c) for c, s in self.badput_s.items() if s >= 0.05), reverse=True)[:3]
        causes = ", ".join(f"{c.replace('_', ' ')} {s:.1f} s" for s, c in worst)
        return f"goodput {self.ratio:.1%} of {self.wall_s:.1f} s" + (f" (badput: {causes})" if causes else "")
