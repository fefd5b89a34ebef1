"""The coordinator's states and the progress they hand each other (raytrain.control.coordinator, raytrain.control.repair)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from raytrain.control.membership import Member
from raytrain.control.steps import StepCall


class RunState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    EVALUATING = "evaluating"
    REPAIRING = "repairing"
    GROWING = "growing"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Progress:
    """Where the run is: what the states hand each other."""

    step: int = 0
    """Committed steps: the next step to run."""
    call: Optional[StepCall] = None
    """The step in flight, if any."""
    row: Optional[dict] = None
    """A committed step's metrics row, held until its held-out loss (if due) and its checkpoint's path are known."""
    lost: list[Member] = field(default_factory=list)
    """Workers lost, for REPAIRING; ``reports`` are the survivors' replies of the failed step."""
    reports: list[dict] = field(default_factory=list)
    during: str = "step"
    """What the lost workers were doing: step, checkpoint, eval or grow."""
