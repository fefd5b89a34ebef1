"""SIGINT and SIGTERM stop a run gracefully: at the next step boundary, after a checkpoint.

A scheduler that preempts a job (Kubernetes, SLURM, a spot reclaim) sends SIGTERM and waits a grace
period; Ctrl-C sends SIGINT. The first signal asks the run to stop at a step boundary and write a
checkpoint; a second one aborts at once (the workers are still stopped, nothing committed is lost).
The CLI then exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional, TextIO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    """While active (a context manager, in the main thread), records the first stop signal in
    ``reason``; the second raises KeyboardInterrupt. Elsewhere it does nothing."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.reason: Optional[str] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:
            raise KeyboardInterrupt(f"{name} again: aborting without waiting for the step boundary")
        self.reason = name
        self.stream.write(f"\n[raytrain] {name}: stopping at the next step boundary after a checkpoint; "
                          f"send it again to abort now\n")
        self.stream.flush()


def exit_code(reason: str) -> int:
    """128 + the signal's number, the shell's convention for a process ended by that signal."""
    return 128 + signal.Signals[reason].value
