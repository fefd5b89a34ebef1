"""SIGINT and SIGTERM during a sweep: Tune stops the trials and saves its state, so ``--resume``
continues it (``SweepStop``, installed by the CLI around ``run_sweep``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

CLUSTER_POLL_S = 0.5
"""While a sweep stops: how often it checks that Ray is still there."""

TUNE_LOGGER = "ray.tune.tune"
TUNE_STOP_NOTES = ("Stop signal received", "Experiment has been interrupted", "Trials did not complete")
"""Tune's own log lines about a stop: replaced by raytrain's, which name the CLI's ``--resume`` command."""
class SweepStop(logging.Filter):
    """SIGINT or SIGTERM stops a sweep as Ctrl-C stops a Tune run: Tune stops the trials and saves its
    experiment state, so ``--resume`` continues it; ``reason`` records the signal for the exit code.

    Tune's own SIGINT handler is turned off (its documented TUNE_DISABLE_SIGINT_HANDLER) because it
    ignores SIGTERM and keeps no record of the signal; this handler passes the first signal on to
    the handler Tune installs for its other stop signal, SIGUSR1. A second signal aborts at once
    (KeyboardInterrupt), as does a first one before Tune has started. Main thread only."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.reason: Optional[str] = None
        self._previous: dict = {}
        self._env: Optional[str] = None
        self._reporting = False
        self.resume_command: Optional[str] = None
        """Printed when the sweep cannot report (Ray ended with the signal)."""

    def __enter__(self) -> "SweepStop":
        if threading.current_thread() is threading.main_thread():
            self._env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
            self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
            self.install()
            logging.getLogger(TUNE_LOGGER).addFilter(self)
        return self

    def install(self) -> None:
        """(Re)install the handlers: call again once Ray has started, as ``ray.init`` puts its own
        SIGTERM handler (a stack dump, then abort) in place of Python's."""
        if self._previous:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        if self._previous:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            if self._env is None:
                os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
            else:
                os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = self._env
            logging.getLogger(TUNE_LOGGER).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TUNE_STOP_NOTES)

    def reporting(self) -> None:
        """Tune has returned: a signal now only waits for the report (seconds), never interrupts it."""
        self._reporting = True

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._reporting:
            self.stream.write(f"\n[raytrain] {name}: the sweep has stopped; finishing its report\n")
            return
        if self.reason is not None:
            raise KeyboardInterrupt(f"aborted by a second {name}, without waiting for Tune to save its state")
        self.reason = name
        tune_stop = signal.getsignal(signal.SIGUSR1)
        if not callable(tune_stop) or tune_stop is self._previous.get(signal.SIGUSR1):
            raise KeyboardInterrupt(f"stopped by {name} before Tune started")
        self.stream.write(f"\n[raytrain] {name}: stopping the sweep; Tune saves its state so that --resume "
                          "continues it; send it again to abort now\n")
        self.stream.flush()
        threading.Thread(target=self._watch_cluster, name="raytrain-sweep-stop", daemon=True).start()
        tune_stop(signal.SIGUSR1, frame)

    def _watch_cluster(self) -> None:
        """While Tune stops: a signal to every process of the job (Slurm's, systemd's control group) ends an
        embedded Ray too, and Tune's clean-up then blocks a minute on each call to it; exit at once."""
        from raytrain.driver.connect import cluster_reachable, embedded
        from raytrain.driver.signals import exit_code

        while not self._reporting:
            time.sleep(CLUSTER_POLL_S)
            if not self._reporting and embedded() and not cluster_reachable():
                hint = f"; continue it with: {self.resume_command}" if self.resume_command else ""
                self.stream.write(f"raytrain: sweep stopped by {self.reason}, which also ended Ray; Tune's last "
                                  f"saved state is kept{hint}\n")
                self.stream.flush()
                os._exit(exit_code(self.reason))

