"""A worker told to leave: SIGTERM is a notice, not a crash.

Clouds warn before they take a machine (a SIGTERM, then a grace period: about 30 s on GKE, up to
120 s on AWS spot), and ``ray stop`` sends one too. A worker that gets it finishes the step it is
in and reports the notice with that step's reply (``StepReport.draining``); the coordinator then
re-forms the run without it at the step boundary, with no step redone and no wait for a failure to
be detected (raytrain.control.drain). Should the coordinator never let it go, the worker exits on
its own when the grace period ends, and the run repairs the loss as any other.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from raytrain.reports import DrainNotice

EXIT_CODE = 128 + signal.SIGTERM
"""What a drained worker exits with when its grace period ends: a SIGTERM's."""


class DrainWatch:
    """Turns this process's SIGTERM into a ``notice``; a second SIGTERM exits at once."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.notice: Optional[DrainNotice] = None
        signal.signal(signal.SIGTERM, self._on_sigterm)  # the actor's constructor runs on its main thread

    def _on_sigterm(self, signum, frame) -> None:
        if self.notice is not None:
            os._exit(EXIT_CODE)  # told twice: no more grace
        now = time.time()
        self.notice = DrainNotice("SIGTERM", now, now + self.grace_s)
        timer = threading.Timer(self.grace_s, os._exit, args=(EXIT_CODE,))
        timer.daemon = True
        timer.start()
