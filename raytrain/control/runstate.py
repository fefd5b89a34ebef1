"""The coordinator's states, each a value carrying what its handler needs (raytrain.control.coordinator).

A handler receives its state and returns the next one: REPAIRING gets the workers that were lost,
what they were doing and the survivors' replies; DRAINING the workers told to leave and their
notices; GROWING gets the decision to grow. Nothing else
passes between states except what the run has committed (raytrain.control.ledger.Ledger).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from raytrain.control.membership import Member
from raytrain.control.policy import Decision
from raytrain.reports import DrainNotice, StepReport


class RunState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    EVALUATING = "evaluating"
    REPAIRING = "repairing"
    DRAINING = "draining"
    GROWING = "growing"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


class Interrupted(str, Enum):
    """What lost workers were doing: a REPAIRING at the same step goes back to it."""

    STEP = "step"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"
    GROW = "grow"


@dataclass(frozen=True)
class State:
    kind: ClassVar[RunState]


@dataclass(frozen=True)
class Starting(State):
    kind = RunState.STARTING


@dataclass(frozen=True)
class Running(State):
    kind = RunState.RUNNING


@dataclass(frozen=True)
class Evaluating(State):
    kind = RunState.EVALUATING


@dataclass(frozen=True)
class Checkpointing(State):
    kind = RunState.CHECKPOINTING


@dataclass(frozen=True)
class Repairing(State):
    kind = RunState.REPAIRING
    lost: tuple[Member, ...]
    interrupted: Interrupted
    reports: tuple[StepReport, ...] = field(default=())
    """The survivors' replies of the failed step (empty unless a step was interrupted)."""


@dataclass(frozen=True)
class Draining(State):
    """At a step boundary: workers told to leave (raytrain.worker.drain) go, and the run re-forms without them."""

    kind = RunState.DRAINING
    leaving: tuple[Member, ...]
    notices: tuple[DrainNotice, ...]


@dataclass(frozen=True)
class Growing(State):
    kind = RunState.GROWING
    decision: Decision


@dataclass(frozen=True)
class Stopping(State):
    kind = RunState.STOPPING


@dataclass(frozen=True)
class Finished(State):
    kind = RunState.FINISHED


@dataclass(frozen=True)
class Failed(State):
    """The run raised out of ``Coordinator.run`` (the exception says why)."""

    kind = RunState.FAILED
