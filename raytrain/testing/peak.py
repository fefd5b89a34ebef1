"""The peak of a process's anonymous resident memory over a block of code, sampled from /proc.

Checkpoint tests bound what a save or a load holds beyond the worker's own state. Python's
tracemalloc does not see torch's allocations, and the kernel's peak (VmHWM) counts file pages a
memory-mapped load touches, which the page cache can drop at will; anonymous memory (RssAnon) is
what a copy costs. A thread samples it every ``interval_s``; large copies live for milliseconds at
least, long enough to be seen. Linux only.
"""

from __future__ import annotations

import threading
import time
from typing import Optional


def anon_bytes() -> int:
    """This process's anonymous resident memory now, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon line (not Linux?)")


class PeakAnon:
    """``with PeakAnon() as p: ...`` then ``p.extra``: the largest rise of RssAnon above its value on entry."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakAnon":
        self.start = self.peak = anon_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.start
