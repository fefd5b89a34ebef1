"""Liveness apart from progress: every worker proves it is alive once a second (a thread of its own calls
the coordinator's ``beat``), whatever its step is doing, so a worker that stops beating for
elastic.detect_timeout_s is hung in any phase (SIGSTOPped, a paused VM, a process stuck in the kernel),
and is killed and repaired; a slow worker keeps beating and is given resources.step_timeout_s.

The coordinator's threads record the beats (``Heartbeats.beat``); its worker group reads them while it waits
for replies (raytrain.control.workergroup). A beat's answer is the newest generation aborted: once a member
of a generation is lost, its survivors abort their process groups of it (raytrain.worker.heartbeat).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

class Heartbeats:
    """The last beat of each worker, by its beat id (``Member.beat_id``: unique in the run, where pids repeat
    across nodes), written by the coordinator's beat calls, read by the thread that waits for replies."""

    def __init__(self):
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self.aborted: Optional[int] = None
        """The newest generation a member of which was lost: its survivors abort their groups of it."""
        self.leaving: dict[int, str] = {}
        """Why each worker whose beats said it was told to leave was told ("SIGTERM", "node drain"), by beat id,
        until looked at (``told_to_leave``)."""

    def beat(self, beat_id: int, leaving: Optional[str] = None) -> Optional[int]:
        """Record the beat (and why the worker was told to leave, if it was); the newest generation to abort
        (None: none)."""
        with self._lock:
            self._last[beat_id] = time.monotonic()
            if leaving:
                self.leaving[beat_id] = leaving
        return self.aborted

    def told_to_leave(self) -> dict[int, str]:
        """The beat ids that said they were told to leave since the last call (each says so once a second),
        with why."""
        with self._lock:
            told, self.leaving = self.leaving, {}
        return told

    def abort(self, generation: int) -> None:
        """Tell every survivor of ``generation`` (at its next beat) to abort its process groups of it."""
        self.aborted = generation if self.aborted is None else max(self.aborted, generation)

    def silent_s(self, beat_id: Optional[int]) -> float:
        """Seconds since the worker's last beat; 0 for one that never beat (it is starting: the calls'
        own timeouts bound it)."""
        with self._lock:
            last = self._last.get(beat_id) if beat_id is not None else None
        return 0.0 if last is None else time.monotonic() - last
