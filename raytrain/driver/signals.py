"""SIGINT and SIGTERM stop a run gracefully: at the next step boundary, after a checkpoint.

A scheduler that preempts a job (Kubernetes, Slurm, a spot reclaim) sends SIGTERM and waits a grace
period; Ctrl-C sends SIGINT. The first signal asks the run to stop at a step boundary and write a
checkpoint. The same signal again within SAME_SIGNAL_WINDOW_S is that same request: coreutils
``timeout`` signals its child and then the child's process group, and schedulers signal every process
of a job, so the driver often gets one request twice, microseconds apart. A signal after the window
(or another one) aborts at once: the workers are still stopped, and nothing committed is lost. The
CLI then exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) either way.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from enum import Enum
from typing import Callable, Optional, TextIO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

SAME_SIGNAL_WINDOW_S = 1.0
"""A stop signal repeated within this long of the first one is the same request, not a second one."""

_READER_JOIN_S = 1.0
"""How long leaving StopOnSignal waits for its reader thread, which ends as soon as its pipe closes."""


class Verdict(str, Enum):
    """What one delivered stop signal means, given the first one of the run."""

    STOP = "stop"
    """The first: stop at the next step boundary after a checkpoint."""
    SAME = "same"
    """The first one's signal again within SAME_SIGNAL_WINDOW_S of it: that request, already under way."""
    ABORT = "abort"
    """Any later one, or another signal: abort without waiting for the step boundary."""


def judge(first: Optional[tuple[int, float]], signum: int, at: float,
          window_s: float = SAME_SIGNAL_WINDOW_S) -> Verdict:
    """The verdict on signal ``signum`` delivered at ``at`` (seconds, a monotonic clock), after ``first``
    (the first stop signal's number and time; None when this is the first)."""
    if first is None:
        return Verdict.STOP
    first_signum, first_at = first
    return Verdict.SAME if signum == first_signum and at - first_at < window_s else Verdict.ABORT


class Aborted(KeyboardInterrupt):
    """A stop signal that aborts: the run is abandoned without waiting for the step boundary.

    ``checkpoint`` is the last one the run committed (None when it published none and resumed from none),
    ``steps`` its step; ``run_dir`` the run's directory (None when the run had not started)."""

    def __init__(self, reason: str, checkpoint: Optional[str] = None, steps: int = 0,
                 run_dir: Optional[str] = None):
        super().__init__(f"{reason} again: aborting without waiting for the step boundary")
        self.reason, self.checkpoint, self.steps, self.run_dir = reason, checkpoint, steps, run_dir

    def summary(self) -> dict:
        """The JSON object the CLI prints as its last line of stdout for an aborted run."""
        return {"steps": self.steps, "checkpoint": self.checkpoint, "run_dir": self.run_dir,
                "stopped": self.reason, "aborted": True}


class StopOnSignal:
    """While active (a context manager, in the main thread), records the first stop signal in ``reason``,
    takes the same signal again within ``window_s`` of it as that request, and raises Aborted for any other
    (its name also in ``aborted``). Elsewhere it does nothing.

    Python runs a signal's Python handler only between bytecodes of the main thread: two signals that
    arrive while it waits on Ray are handled late, and once for both. So each delivery is timed where the
    C-level handler reports it, on the wakeup fd (a byte per delivered signal): a reader thread wakes on
    each byte and notes it with the time (the handler notes any byte the thread has not yet taken).
    """

    def __init__(self, stream: TextIO, window_s: float = SAME_SIGNAL_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.stream, self.window_s, self.clock = stream, window_s, clock
        self.reason: Optional[str] = None
        self.aborted: Optional[str] = None
        """The signal that aborted the run (Ray may re-raise the KeyboardInterrupt as one of its own)."""
        self._first: Optional[tuple[int, float]] = None
        self._lock = threading.RLock()  # the handler may run again inside itself, the lock held
        self._previous: dict = {}
        self._wakeup: Optional[tuple[int, int]] = None  # (read end, write end) of the wakeup pipe
        self._previous_wakeup_fd = -1
        self._reader: Optional[threading.Thread] = None

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._wakeup = os.pipe()
            os.set_blocking(self._wakeup[0], False)
            os.set_blocking(self._wakeup[1], False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
            self._reader = threading.Thread(target=self._read, name="raytrain-stop-signals", daemon=True)
            self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            os.close(self._wakeup[1])  # the reader sees the end of the pipe and returns
            if self._reader is not None:
                self._reader.join(_READER_JOIN_S)
            if self._reader is None or not self._reader.is_alive():
                os.close(self._wakeup[0])
            self._wakeup = None

    def _read(self) -> None:
        """The reader thread: note each stop signal as its byte arrives, until the pipe is closed."""
        read_end = self._wakeup[0]
        while True:
            select.select([read_end], [], [])
            if not self._take():
                return

    def _take(self) -> bool:
        """Note every stop signal whose byte is in the pipe, timed now; False once the pipe is closed."""
        lines = []
        with self._lock:
            at, open_ = self.clock(), True
            while True:
                try:
                    chunk = os.read(self._wakeup[0], 512) if self._wakeup is not None else b""
                except BlockingIOError:
                    break
                if not chunk:
                    open_ = False
                    break
                lines += [self._note(byte, at) for byte in chunk if byte in STOP_SIGNALS]
        self._say(lines)
        return open_

    def _note(self, signum: int, at: float) -> Optional[str]:
        """Record one delivered stop signal (the lock held); the line to tell the person, if any."""
        name = signal.Signals(signum).name
        verdict = judge(self._first, signum, at, self.window_s)
        if verdict is Verdict.STOP:
            self._first, self.reason = (signum, at), name
            return (f"[raytrain] {name}: stopping at the next step boundary after a checkpoint; send it again "
                    f"to abort now (a repeat within {self.window_s:g} s is the same request)")
        if verdict is Verdict.SAME:
            return f"[raytrain] {name} again {at - self._first[1]:.3f} s later: the same stop request"
        self.aborted = self.aborted or name
        return None

    def _say(self, lines: list) -> None:
        for line in filter(None, lines):
            self.stream.write(f"\n{line}\n")
        self.stream.flush()

    def _handle(self, signum: int, frame) -> None:
        self._take()
        if self._first is None:  # its byte was lost (a full pipe): this call is the delivery
            with self._lock:
                line = self._note(signum, self.clock())
            self._say([line])
        if self.aborted is not None:
            raise Aborted(self.aborted)


STILL_STOPPING_S = 15.0
"""While a stop waits for its step boundary, how often the driver says what it waits for."""


class StillStopping:
    """After a stop signal, a line every STILL_STOPPING_S while no step has ended since: the step the stop waits
    for, and what ends a step that never does (a worker silent for elastic.detect_timeout_s is declared hung;
    the signal again aborts at once). A frozen worker otherwise leaves the person looking at a quiet terminal."""

    def __init__(self, reason: str, detect_timeout_s: float, stream: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic):
        self.reason, self.detect_timeout_s, self.stream, self.clock = reason, detect_timeout_s, stream, clock
        self._since = self._said = clock()
        self._steps: Optional[int] = None

    def check(self, steps: int) -> None:
        """``steps``: the steps committed so far; a new one restarts the wait."""
        now = self.clock()
        if steps != self._steps:
            self._steps, self._since, self._said = steps, now, now
            return
        if now - self._said >= STILL_STOPPING_S:
            self._said = now
            self.stream.write(f"[raytrain] {self.reason}: still stopping after {now - self._since:.0f} s: step "
                              f"{steps + 1} has not ended; a worker silent for elastic.detect_timeout_s="
                              f"{self.detect_timeout_s:g} s is declared hung and the run then stops at the step "
                              f"boundary; send {self.reason} again to abort now\n")
            self.stream.flush()


class ProcessSignals:
    """For the CLI's process, outside a run (where StopOnSignal takes over and then gives these handlers
    back): a stop signal never ends it with a traceback, nor before its summary line is out.

    Until the command's run has ended, SIGINT and SIGTERM raise Aborted (nothing runs yet that a step
    boundary could save, or the run itself reports the abort). From ``ended()`` they are only noted, while
    the summary is written; from ``reported(code)`` they end the process at once with ``code`` (a signal
    noted in between, at once then), since all that is left is tearing Ray down. Main thread only."""

    def __init__(self):
        self.code: Optional[int] = None
        self._ended = False
        self._noted = False
        self._previous: dict = {}

    def __enter__(self) -> "ProcessSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def ended(self) -> None:
        """The run has ended: a signal from now on waits for the summary line."""
        self._ended = True

    def reported(self, code: int) -> None:
        """The summary line is out: a signal from now on (or one noted since ``ended``) exits with ``code``."""
        self.code = code
        if self._noted:
            self._exit_now()

    def _handle(self, signum: int, frame) -> None:
        if self.code is not None:
            self._exit_now()
        if not self._ended:
            raise Aborted(signal.Signals(signum).name)
        self._noted = True

    def _exit_now(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code)


def exit_code(reason: str) -> int:
    """128 + the signal's number, the shell's convention for a process ended by that signal."""
    return 128 + signal.Signals[reason].value
