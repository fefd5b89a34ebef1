"""The vocabulary pipeline schedules are written in: actions, where each model chunk sits, and how a schedule prints.

A schedule (``Schedule``) holds one ordered action list per pipeline worker. With parallel.virtual_stages > 1 a
worker hosts several model chunks, and an action names the chunk it runs on; ``Placement`` says which
pipeline stage each (worker, chunk) is, so a schedule's sends and receives know their peers.

Actions print compactly: ``F3`` forward micro-batch 3, ``B3`` backward, ``W3`` the weight half of a split
backward, ``>F3`` send activation to the next stage, ``<F3`` receive it, ``>B3`` send input gradient to the
previous stage, ``<B3`` receive it; on chunk 1 and later the chunk follows: ``F3c1``.
No Ray and no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class ActionKind(str, Enum):
    """What an action does. Its value is how it prints; a ``str`` so ``Action("F", 0)`` still reads well."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # the weight half of a split backward
    SEND_F = ">F"  # activation to the next stage
    RECV_F = "<F"  # activation from the previous stage
    SEND_B = ">B"  # input gradient to the previous stage
    RECV_B = "<B"  # output gradient from the next stage

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def peer(self) -> int:
        """Offset of the pipeline stage a message goes to or comes from (0 for compute)."""
        return {">F": 1, "<B": 1, "<F": -1, ">B": -1}.get(self.value, 0)

    @property
    def flow(self) -> str:
        """What a message carries: ``F`` activations, ``B`` gradients ("" for compute)."""
        return self.value[1:]


FORWARD, BACKWARD, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
COMPUTE = frozenset(k for k in ActionKind if k.is_compute)

Schedule = list[list["Action"]]  # schedule[worker] = that pipeline worker's ordered actions


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    mb: int
    chunk: int = 0
    """Which of the worker's model chunks it runs on (0 unless parallel.virtual_stages > 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))  # "F" (as schedules are written) -> FORWARD

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A schedule breaks a rule (ordering, matching or deadlock); the message names worker and action."""


@dataclass(frozen=True)
class Placement:
    """Which pipeline stage each worker's chunk is, for ``workers`` workers of ``chunks`` chunks each.

    Looped (Megatron's interleaving): chunk c of worker w is stage ``c * workers + w``, so the activations
    go round the workers ``chunks`` times. V (zero-bubble V): two chunks, worker w holds stages w and
    ``2 * workers - 1 - w``, so the first worker holds the first and the last stage and the last worker
    two neighbouring stages, whose hand-off stays on that worker.
    """

    workers: int
    chunks: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        assert not self.v_shape or self.chunks == 2, "the V placement has two chunks per worker"

    @classmethod
    def of_schedule(cls, schedule: str, workers: int, chunks: int = 1) -> Placement:
        """Where a schedule puts each worker's chunks: V for zero-bubble V and DualPipeV (with their two
        chunks), looped otherwise (a zbv run without a pipeline has one chunk)."""
        return cls(workers, chunks, v_shape=schedule in ("zbv", "dualpipev") and chunks == 2)

    @property
    def num_stages(self) -> int:
        return self.workers * self.chunks

    def stage(self, worker: int, chunk: int) -> int:
        """The pipeline stage of ``worker``'s chunk ``chunk``."""
        if self.v_shape and chunk == 1:
            return 2 * self.workers - 1 - worker
        return chunk * self.workers + worker

    def owner(self, stage: int) -> tuple[int, int]:
        """(worker, chunk) of pipeline stage ``stage``."""
        if self.v_shape:
            return (stage, 0) if stage < self.workers else (2 * self.workers - 1 - stage, 1)
        return stage % self.workers, stage // self.workers

    def neighbour(self, worker: int, chunk: int, offset: int) -> Optional[tuple[int, int]]:
        """(worker, chunk) of the stage ``offset`` (+1 or -1) away from this chunk's; None past either end."""
        stage = self.stage(worker, chunk) + offset
        return self.owner(stage) if 0 <= stage < self.num_stages else None

    def is_local(self, worker: int, chunk: int, offset: int) -> bool:
        """Whether the neighbouring stage ``offset`` away is on the same worker (a hand-off, no message)."""
        other = self.neighbour(worker, chunk, offset)
        return other is not None and other[0] == worker


def format_grid(schedule: Schedule, mark: Optional[tuple[int, int]] = None) -> str:
    """One row per worker, one column per action; ``mark=(worker, index)`` brackets a cell."""
    rows = []
    for s, acts in enumerate(schedule):
        cells = []
        for i, a in enumerate(acts):
            text = repr(a)
            cells.append(f"[{text}]" if mark == (s, i) else f" {text} ")
        width = 8 if any(a.chunk for a in acts) else 6
        rows.append(f"stage {s}: " + "".join(c.ljust(width) for c in cells))
    return "\n".join(rows)
