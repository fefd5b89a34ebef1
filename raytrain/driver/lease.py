"""One run at a time per checkpoint directory: a lease file with its holder and a heartbeat.

Two runs writing into one ``checkpoint.dir`` would prune each other's checkpoints. A run therefore
holds the directory while it trains: ``<dir>/raytrain-lease.json`` names the holder (host, pid, run
directory) and is rewritten every ``HEARTBEAT_S`` by a thread in the driver. A second run is refused
before any actor starts. A lease whose heartbeat is older than ``EXPIRY_S``, or whose holder was a
process on this host that no longer exists, is stale and is taken over (a driver that was SIGKILLed
releases nothing).

Through ``pyarrow.fs`` the lease works on any filesystem; object stores have no exclusive create,
so two runs starting within the same instant are told apart by reading the lease back after
writing it (the last writer wins, the other is refused).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

from raytrain.checkpoint import filesystem, join_uri

LEASE_FILE = "raytrain-lease.json"
HEARTBEAT_S = 10.0
"""How often the holder rewrites its lease."""
EXPIRY_S = 60.0
"""A lease not rewritten for this long belongs to a run that is gone."""


class DirectoryBusy(ValueError):
    """Another live run holds this checkpoint directory."""


class Lease:
    """A held checkpoint directory; ``release()`` when the run ends (also on failure)."""

    def __init__(self, base: str, run_dir: str):
        self.base, self.uri = base, join_uri(base, LEASE_FILE)
        self.holder = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "run_dir": run_dir, "started": time.time()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> "Lease":
        current = read_holder(self.uri)
        if current is not None and not is_stale(current):
            raise DirectoryBusy(busy_message(self.base, current))
        self._write()
        time.sleep(0.05)  # a rival that wrote at the same instant: whoever wrote last holds it
        current = read_holder(self.uri)
        if current is None or current.get("token") != self.holder["token"]:
            raise DirectoryBusy(busy_message(self.base, current or {}))
        self._thread = threading.Thread(target=self._beat, name="raytrain-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
        current = read_holder(self.uri)
        if current is not None and current.get("token") == self.holder["token"]:
            fs, path = filesystem(self.uri)
            fs.delete_file(path)

    def _write(self) -> None:
        fs, path = filesystem(self.uri)
        tmp = f"{path}.{self.holder['token']}.tmp"
        with fs.open_output_stream(tmp) as f:
            f.write(json.dumps({**self.holder, "heartbeat": time.time()}).encode())
        fs.move(tmp, path)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError:
                pass  # storage hiccup: the next beat tries again, well inside EXPIRY_S


def read_holder(uri: str) -> Optional[dict]:
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    except OSError as e:
        if "not found" in str(e).lower() or "no such file" in str(e).lower():
            return None
        raise


def is_stale(holder: dict) -> bool:
    if time.time() - float(holder.get("heartbeat", 0)) > EXPIRY_S:
        return True
    return holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", 0)))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def busy_message(base: str, holder: dict) -> str:
    age = time.time() - float(holder.get("heartbeat", time.time()))
    return (f"checkpoint.dir={base} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}, "
            f"run dir {holder.get('run_dir')}, last heartbeat {age:.0f}s ago); two runs in one directory would "
            f"delete each other's checkpoints. Give this run its own checkpoint.dir, or stop that run; a lease "
            f"not renewed for {EXPIRY_S:.0f}s is taken over")
