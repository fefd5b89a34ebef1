"""Connecting the driver to Ray, or starting an embedded Ray: every wait bounded, every failure a sentence.

With ``RAY_ADDRESS`` set the driver joins that cluster. Ray itself retries an address that does not
answer for many minutes, printing only C++ warnings, so the address is probed first (a TCP connect:
a refused or silent port fails in seconds) and ``ray.init`` runs under a bound of its own for what a
probe cannot see (a port that accepts but is not Ray's). Either failure is a ``ClusterUnreachable``,
which names ``RAY_ADDRESS`` and the fix; the CLI exits with 3 as for any resource the cluster cannot
grant.

With ``RAY_ADDRESS`` unset the driver always starts a fresh embedded Ray (``address="local"``):
a bare ``ray.init()`` would instead join the cluster named in ``/tmp/ray/ray_current_cluster``, a
file that outlives a killed cluster, and hang on it.

A driver started by ``ray job submit`` runs in a temporary copy of the job's working directory, so
its relative ``run.dir`` is resolved under ~/raytrain instead (``run_root``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import ray

from raytrain.compat import RAY_WORKER_LOGGER, ray_processes_in_a_session_of_their_own, resolve_auto_ray_address
from raytrain.driver import reaper
from raytrain.driver.placement import ResourcesUnavailable

PROBE_TIMEOUT_S = 5.0
"""How long the TCP probe of RAY_ADDRESS's host:port waits for an answer."""

CLEAN_UP_POLL_S = 0.2
"""How often ``while_reachable`` probes the embedded Ray's GCS while a clean-up call runs."""

CONNECT_TIMEOUT_ENV = "RAYTRAIN_CONNECT_TIMEOUT_S"
CONNECT_TIMEOUT_S = float(os.environ.get(CONNECT_TIMEOUT_ENV, "60"))
"""How long ``ray.init`` may take to join a cluster whose port answered (overridden by the
environment variable above: a loaded head can be slow to answer, a test wants a short bound)."""

JOB_DRIVER_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in the environment of a ``ray job submit`` driver only (not in its
tasks' or actors'): how a driver knows it runs as a Ray job."""

JOB_RUN_PARENT = "~/raytrain"
"""Where a Ray job's relative ``run.dir`` lives: the job's own working directory is a temporary copy
of ``--working-dir`` that nobody looks into and Ray deletes."""

_FIX = ("start the cluster first (`ray start --head`) and point RAY_ADDRESS at it, "
        "or unset RAY_ADDRESS to train on an embedded local Ray")


class ClusterUnreachable(ResourcesUnavailable):
    """RAY_ADDRESS names no reachable Ray cluster (nothing answers, or not within CONNECT_TIMEOUT_S)."""


_embedded = False  # whether this process started the Ray it is connected to


def embedded() -> bool:
    """Whether the connected Ray is the embedded one this process started: one node that never grows."""
    return _embedded and ray.is_initialized()


def ensure_ray(min_cpus: int = 0) -> None:
    """Connect to RAY_ADDRESS when set; otherwise start an embedded local Ray sized to the machine
    (at least ``min_cpus`` CPU slots). Joining is bounded: ClusterUnreachable when RAY_ADDRESS names no
    cluster that answers within PROBE_TIMEOUT_S, or that Ray does not join within CONNECT_TIMEOUT_S."""
    if ray.is_initialized():
        return
    kept = _callers_sigterm_handler()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _probe(address)
        _init_bounded(address)
    else:
        global _embedded
        with ray_processes_in_a_session_of_their_own():  # a signal to the driver's group spares them
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus) if min_cpus else None,
                     include_dashboard=False)
        _embedded = True
        reaper.start()  # nothing of this embedded Ray outlives the driver, even a SIGKILLed one
    if kept is not None:
        signal.signal(signal.SIGTERM, kept)


def _callers_sigterm_handler() -> Optional[Callable]:
    """The SIGTERM handler that this process's caller installed (the CLI's: raytrain.driver.signals), which
    ``ray.init`` would replace with its own (exit at once); None when there is none or not the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    return handler if callable(handler) else None


def cluster_reachable() -> bool:
    """Whether the connected cluster's GCS still accepts a TCP connection (within PROBE_TIMEOUT_S).

    A SIGTERM to every process of the job (Slurm's and systemd's control groups) also ends an embedded
    Ray's GCS; every Ray call that needs it (removing a placement group, killing an actor, shutting
    down) then blocks for a minute before Ray gives up. The driver asks this first and skips them.
    """
    target = _host_port(ray.get_runtime_context().gcs_address) if ray.is_initialized() else None
    if target is None:
        return False
    try:
        socket.create_connection(target, timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def while_reachable(call: Callable[..., Any], *args) -> bool:
    """``call(*args)`` (a clean-up call to Ray), given up should the embedded Ray's GCS stop answering
    meanwhile; whether it ran to its end (its exception is raised here). A signal to the driver's whole
    process group ends the embedded Ray at any moment, also just after a probe said it answers, and a
    call to it then blocks a minute before Ray ends the process with code 1. The GCS is probed every
    CLEAN_UP_POLL_S while the call runs in a helper thread (daemon: it does not hold the process at exit)."""
    if not embedded():
        call(*args)
        return True
    outcome: dict = {}

    def run():
        try:
            call(*args)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    if not cluster_reachable():
        return False
    thread = threading.Thread(target=run, name="raytrain-ray-clean-up", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(CLEAN_UP_POLL_S)
        if thread.is_alive() and not cluster_reachable():
            return False
    if "error" in outcome:
        raise outcome["error"]
    return True


def shutdown_embedded() -> bool:
    """Stop the embedded Ray, if this process started one; False when its GCS stopped answering first (a
    signal to the whole process group ended it: the reaper stops whatever of it is left), or when a join
    was given up with its ``ray.init`` still running: the process must then end without the interpreter's
    teardown, which that thread, inside Ray's C++ client, can crash (SIGSEGV instead of the exit code)."""
    if _abandoned_joins:
        return False
    return not embedded() or while_reachable(ray.shutdown)


def running_as_job() -> bool:
    """True in the driver of a ``ray job submit`` job."""
    return JOB_DRIVER_ENV in os.environ


def run_root(run_dir: str) -> str:
    """``run.dir`` as an absolute path. In a Ray job a relative ``run.dir`` (the default ``runs``)
    lies under ~/raytrain instead of inside the job's temporary working-dir copy."""
    path = os.path.expanduser(run_dir)
    if running_as_job():
        path = os.path.join(os.path.expanduser(JOB_RUN_PARENT), path)  # an absolute path stays as it is
    return os.path.abspath(path)


def _probe(address: str) -> None:
    """Fail in seconds when RAY_ADDRESS's host:port refuses or ignores a TCP connection."""
    target = _host_port(address)
    if target is None:
        return  # a form this probe does not know: the bounded ray.init still catches it
    host, port = target
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        reason = f"no answer within {PROBE_TIMEOUT_S:g}s" if isinstance(e, socket.timeout) else e.strerror or str(e)
        where = f"{host}:{port}" + (", the cluster auto found on this machine" if address == "auto" else "")
        raise ClusterUnreachable(
            f"RAY_ADDRESS={address}: no Ray cluster answers at {where} ({reason}); {_FIX}") from None


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """The host and port that RAY_ADDRESS points at: ``host:port``, ``ray://host:port``, or for
    ``auto`` the cluster Ray would pick (the only Ray running on this machine, else the last one
    ``ray start`` started, as its ray_current_cluster file says). None if unknown."""
    if address == "auto":
        try:
            address = resolve_auto_ray_address()
        except ConnectionError:
            raise ClusterUnreachable(
                f"RAY_ADDRESS=auto: no running Ray cluster found on this machine; {_FIX}") from None
        if address is None:
            return None
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


_abandoned_joins: list[threading.Thread] = []
"""The ``ray.init`` threads that ``_init_bounded`` gave up on (see shutdown_embedded)."""


def _init_bounded(address: str) -> None:
    """``ray.init()`` (which reads RAY_ADDRESS) in a helper thread, given up after CONNECT_TIMEOUT_S.

    A thread that never returns is left behind (daemon: it does not hold the process at exit).
    ray.init installs its SIGTERM handler only from the main thread, so this installs the same one.
    """
    outcome: dict = {}

    def init():
        try:
            ray.init()
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init would set
    quiet = _DropMessage("SIGTERM handler is not set")
    logging.getLogger(RAY_WORKER_LOGGER).addFilter(quiet)
    try:
        thread = threading.Thread(target=init, name="raytrain-ray-init", daemon=True)
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
    finally:
        logging.getLogger(RAY_WORKER_LOGGER).removeFilter(quiet)
    if thread.is_alive():
        _abandoned_joins.append(thread)
        raise ClusterUnreachable(
            f"RAY_ADDRESS={address}: Ray did not join a cluster there within {CONNECT_TIMEOUT_S:g}s "
            f"({CONNECT_TIMEOUT_ENV}); is it the cluster's GCS address (the one in the `ray start "
            f"--address=...` line that `ray start --head` prints)? Otherwise {_FIX}")
    error = outcome.get("error")
    if isinstance(error, ConnectionError):
        raise ClusterUnreachable(f"RAY_ADDRESS={address}: {error}; {_FIX}") from error
    if error is not None:
        raise error


class _DropMessage(logging.Filter):
    """Drops log records that start with one message."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)
