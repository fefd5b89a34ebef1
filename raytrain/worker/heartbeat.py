"""A worker's proof that it is alive, sent from a thread of its own (raytrain.control.liveness reads it): it
keeps beating while the step computes, waits in a collective or reads data, and stops only when the process
does (SIGSTOP, a paused VM, a process stuck in the kernel)."""

from __future__ import annotations

import os
import threading
from typing import Any

from raytrain.config.prepared import HEARTBEAT_S


class Heartbeat:
    """Calls ``target.beat(pid)`` (the coordinator's) every HEARTBEAT_S until ``stop``; an unreachable
    coordinator (it is gone: this worker goes with it) is not an error."""

    def __init__(self, target: Any):
        self._target, self._stopped = target, threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="raytrain-heartbeat").start()

    def _beat(self) -> None:
        pid = os.getpid()
        while not self._stopped.is_set():
            try:
                self._target.beat.remote(pid)
            except Exception:  # noqa: BLE001 -- the coordinator is gone; this process ends with it
                pass
            self._stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stopped.set()
