"""A private Ray head bound to 127.0.0.1 with its own ports and temp dir, stopped by pid.

``ray stop`` would stop every Ray on the machine (the test session's too), so this starts
``ray start --head --block`` in a new process group and, on exit, kills that group and any process
whose command line names this cluster's temp dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

START_TIMEOUT_S = 90.0


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


KILL_TIMEOUT_S = 20.0
"""How long stopping a private cluster may take: SIGKILL, then wait for the processes to go."""


def pids_using(*texts: str) -> list[int]:
    """Pids of the processes whose command line or environment names one of ``texts``."""
    needles = [t.encode() for t in texts]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{part}", "rb") as f:
                    blob = f.read()
            except OSError:
                continue
            if any(n in blob for n in needles):
                pids.append(int(entry))
                break
    return pids


def kill_all_using(*texts: str, timeout_s: float = KILL_TIMEOUT_S) -> list[int]:
    """SIGKILL every process using ``texts`` until none is left; returns the survivors (none, normally)."""
    deadline = time.monotonic() + timeout_s
    while (left := pids_using(*texts)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
    return pids_using(*texts)


STOP_GRACE_S = 3
"""`ray start --block` takes ~20 s to wind down on SIGTERM; after this the test's own cluster is SIGKILLed."""


START_ATTEMPTS = 3
"""A head that exits while starting (a port taken between choosing it and binding it) is retried."""


@contextlib.contextmanager
def private_ray_head(num_cpus: int = 2):
    """Yields (dashboard_url, env) for a fresh head; everything it started is gone afterwards."""
    env = dict(os.environ, RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60, check=True)
    for attempt in range(1, START_ATTEMPTS + 1):
        head, url, temp_dir, log = _start_head(ray_bin, env, num_cpus)
        try:
            if _wait_until_up(head, url):
                break
            reason, retry = f"exited with {head.returncode}", attempt < START_ATTEMPTS
        except TimeoutError:
            reason, retry = f"was not up within {START_TIMEOUT_S}s", False
        _stop(head, temp_dir)
        with open(log, errors="replace") as f:
            tail = f.read()[-2000:]
        if not retry:
            raise RuntimeError(f"private Ray head at {url} {reason} (attempt {attempt}); ray start said:\n{tail}")
    try:
        yield url, env
    finally:
        _stop(head, temp_dir)


def _start_head(ray_bin: str, env: dict, num_cpus: int):
    temp_dir = tempfile.mkdtemp(prefix="rtjob-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs, dash, client, nm, om, agent, agent_grpc, metrics, rt_env, wmin = free_ports(10)
    cmd = [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_env}",
           f"--min-worker-port={wmin}", f"--max-worker-port={wmin + 200}" if wmin + 200 < 65535 else "--max-worker-port=65535",
           f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log = os.path.join(temp_dir, "ray-start.log")
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return head, f"http://127.0.0.1:{dash}", temp_dir, log


def _wait_until_up(head: subprocess.Popen, url: str) -> bool:
    """True once the dashboard answers; False if the head exits first; TimeoutError after START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return True
        except Exception as e:  # 401 (token auth) also means it is up
            if getattr(e, "code", None) == 401:
                return True
            if head.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(url) from e
            time.sleep(0.5)


def _stop(head: subprocess.Popen, temp_dir: str) -> None:
    """Stop the head's process group and anything else naming its temp dir."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(timeout=STOP_GRACE_S)
    deadline = time.monotonic() + 20
    while (left := _pids_naming(temp_dir)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
