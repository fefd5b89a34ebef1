"""What a run has done, as the coordinator's states record it: the next step, the steps committed and
skipped, the repairs and their times, where the time went, the last checkpoint, and the metric rows on their way to the
driver. Every state writes it through these verbs, so that a reload that rewinds the run rewinds all
of it at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from raytrain import checkpoint
from raytrain.control.goodput import TimeBook


@dataclass
class Ledger:
    step: int = 0
    """Committed steps: the next step to run."""
    first_step: int = 0
    """The step this coordinator started at (a resumed run's checkpoint step)."""
    last_checkpoint: Optional[str] = None
    committed_steps: list[int] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    failures: int = 0
    """Repairs after lost workers (against elastic.max_failures)."""
    recovery_s: list[float] = field(default_factory=list)
    time: TimeBook = field(default_factory=TimeBook)
    """Where the run's time went (goodput, badput by cause): a reload's rewind moves undone steps' time."""
    waiting_row: Optional[dict] = None
    """A committed step's metrics row, waiting until its held-out loss (if due) and its checkpoint's path are known."""
    _rows: list[dict] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def commit(self, step: int, row: dict, skipped: bool = False) -> None:
        """``step`` is done everywhere (applied, rolled forward, or ``skipped`` as not finite); its row waits."""
        self.committed_steps.append(step)
        if "step_s" in row:  # a step the workers ran to its commit (not rolled forward, not skipped)
            self.time.committed(step, row["step_s"], row.get("data_s", 0.0), row.get("compile_s", 0.0))
        if skipped:
            self.skipped_steps.append(step)
        self.step, self.waiting_row = step + 1, row

    def rewind(self, step: int) -> None:
        """Every worker reloaded the checkpoint of ``step``: the steps after it will run again."""
        self.step = step
        self.committed_steps = [s for s in self.committed_steps if s < step]
        self.skipped_steps = [s for s in self.skipped_steps if s < step]
        self.time.rewind(step)

    def checkpointed(self, step: int) -> bool:
        """Whether the last checkpoint is of ``step``."""
        last = self.last_checkpoint
        return last is not None and checkpoint.read_manifest(last)["step"] == step

    def count_failure(self) -> int:
        self.failures += 1
        return self.failures

    def emit(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def take_rows(self) -> list[dict]:
        """Rows emitted since the last take (the driver's poll, from another thread)."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def flush_row(self, checkpoint_path: Optional[str]) -> None:
        """Emit the waiting row with the path of the checkpoint that has its step (None: none has)."""
        if self.waiting_row is not None:
            self.waiting_row["checkpoint"] = checkpoint_path
            self.emit(self.waiting_row)
            self.waiting_row = None
