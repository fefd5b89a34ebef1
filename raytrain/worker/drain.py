"""A worker told to leave: SIGTERM, or its node draining, is a notice, not a crash.

Clouds warn before they take a machine (a SIGTERM, then a grace period: about 30 s on GKE, up to
120 s on AWS spot), and ``ray stop`` sends one too; Ray passes a cloud's preemption notice on as a
node drain with a deadline (``ray drain-node``), which each worker's watcher thread checks for its
own node every NODE_POLL_S (in a thread: a step never waits on Ray's control plane). A worker told
either way finishes the step it is in and its reply carries the notice (``StepReport.draining``). If
the coordinator holds notices (elastic.replace_at_notice: the step says so), the worker trains on
while a replacement starts elsewhere, and the coordinator picks the boundary where it goes; if not,
it says so in that step's vote, so that every worker knows the step's end is the boundary and skips
a step the coordinator had sent ahead (raytrain.worker.stage). Either way the run re-forms without
it at that boundary, with no step redone and no wait for a failure to be detected
(raytrain.control.drain). Should the coordinator never let it go, the worker exits on its
own when the grace period ends, and the run repairs the loss as any other. A notice whose deadline
comes sooner than a step takes (the last step's time) cannot reach a boundary: the worker leaves at
once, so its peers see the loss now rather than when the deadline cuts the step, and the run
repairs it as a crash (a ``repair`` event, the step redone). Ray's own shutdown
also SIGTERMs its workers (``ray stop``, an embedded Ray whose every process was signalled): then the
worker's raylet, its parent, goes too, and the worker exits as soon as it has (PARENT_POLL_S).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from raytrain.reports import DrainNotice

EXIT_CODE = 128 + signal.SIGTERM
"""What a drained worker exits with when its grace period ends: a SIGTERM's."""
NODE_POLL_S = 1.0
"""How often a worker asks Ray whether its node is draining (Ray Train V2 polls every 5 s)."""
PARENT_POLL_S = 0.1
"""After a SIGTERM, how often a worker checks that its raylet (the process that started it) lives on."""


class DrainWatch:
    """Turns this process's SIGTERM, or its node's drain (``node_id``: Ray's hex id), into a ``notice``;
    a second SIGTERM exits at once."""

    def __init__(self, grace_s: float, node_id: Optional[str] = None):
        self.grace_s = grace_s
        self.notice: Optional[DrainNotice] = None
        self.step_s = 0.0  # how long this worker's last step took (the actor sets it): what a boundary is away
        self._parent = os.getppid()
        signal.signal(signal.SIGTERM, self._on_sigterm)  # the actor's constructor runs on its main thread
        if node_id is not None:
            threading.Thread(target=self._watch_node, args=(node_id,), daemon=True).start()

    def _watch_node(self, node_id: str) -> None:
        """Note a drain of this worker's node, asking Ray every NODE_POLL_S until one is noted."""
        from raytrain.compat import draining_nodes

        while self.notice is None:
            time.sleep(NODE_POLL_S)
            try:
                deadline_ms = draining_nodes().get(node_id)
            except Exception:  # noqa: BLE001 - Ray's control plane unreachable now: ask again later
                continue
            if deadline_ms is not None and self.notice is None:
                self._noticed(DrainNotice("node drain", time.time(), deadline_ms / 1000 if deadline_ms else None))

    def _on_sigterm(self, signum, frame) -> None:
        if self.notice is not None:
            os._exit(EXIT_CODE)  # told twice: no more grace
        now = time.time()
        self._noticed(DrainNotice("SIGTERM", now, now + self.grace_s))
        threading.Thread(target=self._exit_when_ray_goes, args=(now + self.grace_s,), daemon=True).start()

    def _noticed(self, notice: DrainNotice) -> None:
        """Keep ``notice`` for the next vote, or leave now when its deadline comes before a step could end."""
        left_s = notice.deadline - notice.noticed_at if notice.deadline is not None else None
        if left_s is not None and left_s < self.step_s:
            print(f"raytrain: told to leave ({notice.why}) with {left_s:.2f} s left, less than a step "
                  f"({self.step_s:.2f} s): leaving now; the run repairs the loss", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)
        self.notice = notice

    def _exit_when_ray_goes(self, deadline: float) -> None:
        """Exit once the grace period is over, or at once should the raylet go (Ray is shutting down)."""
        while time.time() < deadline and os.getppid() == self._parent:
            time.sleep(PARENT_POLL_S)
        os._exit(EXIT_CODE)
