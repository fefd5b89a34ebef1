"""A worker's proof that it is alive, sent from a thread of its own (raytrain.control.liveness reads it): it
keeps beating while the step computes, waits in a collective or reads data, and stops only when the process
does (SIGSTOP, a paused VM, a process stuck in the kernel).

Each beat's answer is the newest generation the coordinator aborted (a member of it was lost): the thread
hands it to ``on_abort``, which aborts this worker's process groups of that generation, so that a
collective blocked on the lost peer returns (NCCL's ncclCommAbort) instead of holding the survivor until
its timeout."""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

from raytrain.config.prepared import HEARTBEAT_S


class Heartbeat:
    """Calls ``target.beat(beat_id, leaving())`` (the coordinator's) every HEARTBEAT_S until ``stop``, and
    ``on_abort(n)`` whenever its answer names a generation ``n`` to abort; an unreachable coordinator (it is
    gone: this worker goes with it) is not an error. ``leaving``: why this worker was told to leave ("SIGTERM",
    "node drain"), None if it was not (a standby runs no steps, so its beat is how the coordinator hears of it)."""

    def __init__(self, target: Any, beat_id: int, on_abort: Callable[[int], None] = lambda generation: None,
                 leaving: Callable[[], Optional[str]] = lambda: None):
        self._target, self._beat_id, self._on_abort, self._leaving = target, beat_id, on_abort, leaving
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="raytrain-heartbeat").start()

    def _beat(self) -> None:
        import ray

        answer = None
        while not self._stopped.is_set():
            aborted = None
            try:
                if answer is not None and ray.wait([answer], timeout=0)[0]:
                    aborted = ray.get(answer)
                answer = self._target.beat.remote(self._beat_id, self._leaving())
            except ray.exceptions.RayError:  # the coordinator is gone; this process ends with it
                answer = None
            if aborted is not None:
                try:
                    self._on_abort(aborted)
                except Exception as e:  # noqa: BLE001 -- in this worker's log; the next beat goes out all the same
                    print(f"raytrain: aborting the process groups of generation {aborted} failed: {e!r}",
                          file=sys.stderr, flush=True)
            self._stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stopped.set()
