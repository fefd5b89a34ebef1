"""Nothing of an embedded Ray outlives its driver, even a driver killed with SIGKILL.

Ray's own processes of an embedded ``ray.init`` mostly die with the driver, but its agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) were seen lingering for over a minute. The
driver therefore starts this watchdog in its own session, connected by a pipe whose only writer is
the driver: while the driver lives, the watchdog notes the driver's descendants every
``SCAN_INTERVAL_S``; when the pipe reaches end-of-file (the driver exited, however it exited) it
SIGKILLs those that still run. A pid is killed only if its start time is the one noted, so a
reused pid is never hit. Linux only (it reads /proc); elsewhere it is not started.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from typing import Optional

SCAN_INTERVAL_S = 1.0
"""How often the watchdog notes the driver's descendants."""

_write_end: Optional[int] = None  # the driver's end of the pipe, open for the driver's whole life


def start(driver_pid: Optional[int] = None) -> Optional[subprocess.Popen]:
    """Start the watchdog for this process (call right after it started an embedded Ray)."""
    if not os.path.isdir("/proc"):
        return None
    read_end, write_end = os.pipe()
    watchdog = subprocess.Popen([sys.executable, "-m", "raytrain.driver.reaper", str(driver_pid or os.getpid())],
                                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    os.close(read_end)
    global _write_end
    _write_end = write_end  # never inherited (os.pipe's default): EOF means this process is gone
    return watchdog


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


RAY_MARKERS = (b"ray::", b"/ray/", b"raylet", b"gcs_server")
"""What a Ray process's command line shows: a retitled worker or agent, Ray's own scripts, its servers."""


def _is_ray(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this watchdog (python -m raytrain.driver.reaper) must not note itself
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return any(marker in cmdline for marker in RAY_MARKERS)


def descendants(pid: int) -> dict[int, str]:
    """Every Ray process below ``pid`` (Ray's servers, agents and workers), with its start time."""
    tree, found, stack = _children(), {}, [pid]
    while stack:
        for child in tree.get(stack.pop(), []):
            started = _start_time(child)
            if started is not None and child not in found:
                stack.append(child)
                if _is_ray(child):
                    found[child] = started
    return found


def watch(driver_pid: int, pipe_fd: int = 0) -> None:
    """Note the driver's descendants until the pipe closes, then kill the ones still running."""
    noted: dict[int, str] = {}
    while True:
        noted.update(descendants(driver_pid))
        readable, _, _ = select.select([pipe_fd], [], [], SCAN_INTERVAL_S)
        if readable and not os.read(pipe_fd, 1):
            break
    for pid, started in noted.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
