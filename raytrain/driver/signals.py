"""SIGINT and SIGTERM stop a run gracefully: at the next step boundary, after a checkpoint.

A scheduler that preempts a job (Kubernetes, SLURM, a spot reclaim) sends SIGTERM and waits a grace
period; Ctrl-C sends SIGINT. The first signal asks the run to stop at a step boundary and write a
checkpoint; a second one aborts at once (the workers are still stopped, nothing committed is lost).
The CLI then exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional, TextIO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Aborted(KeyboardInterrupt):
    """A second stop signal: the run is abandoned without waiting for the step boundary."""

    def __init__(self, reason: str):
        super().__init__(f"{reason} again: aborting without waiting for the step boundary")
        self.reason = reason


class StopOnSignal:
    """While active (a context manager, in the main thread), records the first stop signal in
    ``reason``; the second raises Aborted. Elsewhere it does nothing.

    Python runs a signal's handler only between bytecodes of the main thread, and two signals that
    arrive meanwhile (a double Ctrl-C while the main thread waits on Ray) call it once. So the C-level
    handler's wakeup fd, which gets one byte per signal delivered, counts them.
    """

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.reason: Optional[str] = None
        self.aborted: Optional[str] = None
        """The signal that aborted the run (Ray may re-raise the KeyboardInterrupt as one of its own)."""
        self._previous: dict = {}
        self._wakeup: Optional[tuple[int, int]] = None  # (read end, write end) of the wakeup pipe
        self._previous_wakeup_fd = -1

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._wakeup = os.pipe()
            for fd in self._wakeup:
                os.set_blocking(fd, False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _delivered(self) -> int:
        """Stop signals delivered since the last call (at least the one being handled)."""
        data = b""
        while self._wakeup is not None:
            try:
                chunk = os.read(self._wakeup[0], 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return max(1, sum(1 for byte in data if byte in STOP_SIGNALS))

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None or self._delivered() > 1:
            self.aborted = name
            raise Aborted(name)
        self.reason = name
        self.stream.write(f"\n[raytrain] {name}: stopping at the next step boundary after a checkpoint; "
                          f"send it again to abort now\n")
        self.stream.flush()


def exit_code(reason: str) -> int:
    """128 + the signal's number, the shell's convention for a process ended by that signal."""
    return 128 + signal.Signals[reason].value
