"""A private machine for commands that start Ray clusters: a shell in its own network namespace,
with a fresh HOME and Ray temp dir, and everything it started killed by pid afterwards.

``ray stop`` would stop every Ray on the machine (the test session's, other users'), so nothing here
calls it: every process a command starts inherits HOME and RAY_TMPDIR, and on exit every process
whose environment or command line names one of those temp dirs is killed. The network namespace
has a loopback of its own, so ``ray start --head`` can use its default ports, and Ray's
``ray_current_cluster`` file lies in the private RAY_TMPDIR, so no other cluster is found or
overwritten.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

KILL_TIMEOUT_S = 20.0
"""How long stopping a private cluster may take: SIGKILL, then wait for the processes to go."""

SHELL_START_TIMEOUT_S = 10.0
"""Bound on the private shell's first command (bringing its loopback up)."""


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


def unshare_works() -> bool:
    """Whether this machine lets a test open a private network namespace (root, or user namespaces)."""
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Shell:
    """One bash, fed one command at a time; shell state (``export``, ``cd``) carries over."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, command: str, timeout_s: float) -> tuple[int, str]:
        """Run ``command`` as written (stdin from /dev/null); its exit status and its output
        (stdout and stderr). TimeoutError naming the command when it takes over ``timeout_s``."""
        marker = f"__rc_{uuid.uuid4().hex}__"
        self.proc.stdin.write(f"{{ {command}\n}} </dev/null\nprintf '\\n{marker}%s\\n' \"$?\"\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"`{command}` did not finish within {timeout_s:g}s; its output:\n"
                                   + "".join(out)[-4000:]) from None
            if line is None:
                raise RuntimeError(f"the shell exited while running `{command}`; output:\n" + "".join(out)[-4000:])
            if marker in line:
                text = "".join(out)
                return int(line.split(marker)[1]), text[:-1] if text.endswith("\n") else text
            out.append(line)


@contextlib.contextmanager
def private_machine(cwd: str):
    """Yields (Shell, home, ray_tmpdir): a bash in a new network namespace (loopback up) with a fresh
    HOME and RAY_TMPDIR, the virtualenv's ``python`` and ``ray`` first on PATH, no RAY_* settings
    from this session. Afterwards every process it started is gone and the temp dirs removed."""
    home = tempfile.mkdtemp(prefix="rthome-", dir="/tmp")
    ray_tmp = tempfile.mkdtemp(prefix="rtray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=home, RAY_TMPDIR=ray_tmp, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.Popen(["unshare", "-n", "bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        shell = Shell(proc)
        rc, out = shell.run("ip link set lo up", SHELL_START_TIMEOUT_S)
        assert rc == 0, f"cannot bring up the private loopback: {out}"
        yield shell, home, ray_tmp
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        left = kill_all_using(home, ray_tmp)
        proc.wait(timeout=KILL_TIMEOUT_S)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not left, f"processes of the private cluster survived SIGKILL: {left}"
