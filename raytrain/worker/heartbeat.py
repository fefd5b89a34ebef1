"""A worker's proof that it is alive, sent from a thread of its own (raytrain.control.liveness reads it): it
keeps beating while the step computes, waits in a collective or reads data, and stops only when the process
does (SIGSTOP, a paused VM, a process stuck in the kernel).

Each beat's answer is the newest generation the coordinator aborted (a member of it was lost): the thread
hands it to ``on_abort``, which aborts this worker's process groups of that generation, so that a
collective blocked on the lost peer returns (NCCL's ncclCommAbort) instead of holding the survivor until
its timeout."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from raytrain.config.prepared import HEARTBEAT_S


class Heartbeat:
    """Calls ``target.beat(pid)`` (the coordinator's) every HEARTBEAT_S until ``stop``, and ``on_abort(n)``
    whenever its answer names a generation ``n`` to abort; an unreachable coordinator (it is gone: this
    worker goes with it) is not an error."""

    def __init__(self, target: Any, on_abort: Callable[[int], None] = lambda generation: None):
        self._target, self._on_abort, self._stopped = target, on_abort, threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="raytrain-heartbeat").start()

    def _beat(self) -> None:
        import ray

        pid, answer = os.getpid(), None
        while not self._stopped.is_set():
            try:
                if answer is not None and ray.wait([answer], timeout=0)[0]:
                    aborted = ray.get(answer)
                    if aborted is not None:
                        self._on_abort(aborted)
                answer = self._target.beat.remote(pid)
            except Exception:  # noqa: BLE001 -- the coordinator is gone; this process ends with it
                answer = None
            self._stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stopped.set()
