"""The bound on a sweep that cannot go on: no trial running, and some still waiting.

Tune itself waits forever for resources that never come, and a synchronous PBT sweep whose trial
errored waits forever for that trial to reach the perturbation point. ``sweep.resources_wait_s``
bounds both: once no trial has been running for that long while trials are pending or paused,
the sweep stops and says which trials were waiting, and for what.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

from ray import tune
from ray.tune.stopper import Stopper

from raytrain.driver.placement import ResourcesUnavailable

WAITING = ("PENDING", "PAUSED")
"""Trial statuses that wait for the sweep to run them."""

_verdict: list[str] = []
"""The stall the running sweep's watch saw. Tune restores a sweep's callbacks from its pickled
state, so a resumed sweep's watch is not the object ``run_sweep`` made: it leaves its verdict
here (a process runs one sweep at a time)."""


def take_verdict() -> Optional[str]:
    """The stall the last sweep's watch saw (None if it went on), cleared as it is read."""
    return _verdict.pop() if _verdict else None


class StallWatch(tune.Callback):
    """Watches trial statuses after every step of Tune's loop; ``stalled`` names the wait once it
    has lasted ``wait_s`` seconds with no trial running."""

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.wait_s = wait_s
        self.clock = clock
        self.idle_since: Optional[float] = None
        self.stalled: Optional[str] = None

    def on_step_end(self, iteration, trials, **info):
        statuses = Counter(t.status for t in trials)
        if statuses["RUNNING"] or not any(statuses[s] for s in WAITING):
            self.idle_since = None  # running, or nothing left to run: not a stall
            return
        now = self.clock()
        if self.idle_since is None:
            self.idle_since = now
        elif self.stalled is None and now - self.idle_since >= self.wait_s:
            counts = ", ".join(f"{n} {status.lower()}" for status, n in sorted(statuses.items()))
            self.stalled = (f"for {self.wait_s:g} s (sweep.resources_wait_s) no trial could run ({counts}); "
                            + _why(statuses))
            _verdict[:] = [self.stalled]


def _why(statuses: Counter) -> str:
    if statuses["PAUSED"] and statuses["ERROR"]:
        return ("a synchronous PBT sweep (sweep.synch) waits for every trial to reach its checkpoint, and an "
                "errored one never does: see its error.txt")
    return "the cluster has no room for a waiting trial's workers: free it, or add nodes"


class SweepStalled(ResourcesUnavailable):
    """A sweep stopped by its stall watch (exit 3, as for a run whose workers were never granted)."""


class StopWhenStalled(Stopper):
    """Tune's stopper for the whole experiment: stop once the watch saw a stall."""

    def __init__(self, watch: StallWatch):
        self.watch = watch

    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.watch.stalled is not None
