"""A worker told to leave: SIGTERM, or its node draining, is a notice, not a crash.

Clouds warn before they take a machine (a SIGTERM, then a grace period: about 30 s on GKE, up to
120 s on AWS spot), and ``ray stop`` sends one too; Ray passes a cloud's preemption notice on as a
node drain with a deadline (``ray drain-node``), which each worker checks for its own node at most
every NODE_POLL_S, after a step. A worker told either way finishes the step it is in and reports
the notice with that step's reply (``StepReport.draining``); the coordinator then
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
NODE_POLL_S = 1.0
"""How often a worker asks Ray whether its node is draining (Ray Train V2 polls every 5 s)."""


class DrainWatch:
    """Turns this process's SIGTERM, or its node's drain (``node_id``: Ray's hex id), into a ``notice``;
    a second SIGTERM exits at once."""

    def __init__(self, grace_s: float, node_id: Optional[str] = None):
        self.grace_s = grace_s
        self.node_id = node_id
        self.notice: Optional[DrainNotice] = None
        self._next_poll = 0.0
        signal.signal(signal.SIGTERM, self._on_sigterm)  # the actor's constructor runs on its main thread

    def check_node(self) -> None:
        """Note a drain of this worker's node, asking Ray at most every NODE_POLL_S."""
        if self.notice is not None or self.node_id is None or time.monotonic() < self._next_poll:
            return
        from raytrain.compat import draining_nodes

        self._next_poll = time.monotonic() + NODE_POLL_S
        deadline_ms = draining_nodes().get(self.node_id)
        if deadline_ms is not None:
            self.notice = DrainNotice("node drain", time.time(), deadline_ms / 1000 if deadline_ms else None)

    def _on_sigterm(self, signum, frame) -> None:
        if self.notice is not None:
            os._exit(EXIT_CODE)  # told twice: no more grace
        now = time.time()
        self.notice = DrainNotice("SIGTERM", now, now + self.grace_s)
        timer = threading.Timer(self.grace_s, os._exit, args=(EXIT_CODE,))
        timer.daemon = True
        timer.start()
