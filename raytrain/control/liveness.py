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
    """The last beat of each worker process, by pid (written by the coordinator's beat calls, read by the
    thread that waits for replies)."""

    def __init__(self):
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self.aborted: Optional[int] = None
        """The newest generation a member of which was lost: its survivors abort their groups of it."""

    def beat(self, pid: int) -> Optional[int]:
        """Record the beat; the newest generation to abort (None: none)."""
        with self._lock:
            self._last[pid] = time.monotonic()
        return self.aborted

    def abort(self, generation: int) -> None:
        """Tell every survivor of ``generation`` (at its next beat) to abort its process groups of it."""
        self.aborted = generation if self.aborted is None else max(self.aborted, generation)

    def silent_s(self, pid: Optional[int]) -> float:
        """Seconds since the worker's last beat; 0 for one that never beat (it is starting: the calls'
        own timeouts bound it)."""
        with self._lock:
            last = self._last.get(pid) if pid is not None else None
        return 0.0 if last is None else time.monotonic() - last
