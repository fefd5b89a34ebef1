"""Out of memory as a named failure: what a worker that ran out of memory tells the coordinator, and
what the coordinator learnt about a worker killed for memory (by Ray's memory monitor, by the
kernel's OOM killer, or by its own failed allocation).

Pure (no torch, no Ray): the worker raises ``WorkerOutOfMemory`` with its node's memory, the Ray
worker group (raytrain.control.workergroup) turns Ray's errors into an ``OutOfMemory`` on the lost
member, and the coordinator records it as an ``oom`` event and, when the run cannot go on, names it
in the one line the CLI prints (exit 4).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Optional

MEMINFO = "/proc/meminfo"
KERNEL_LOG = "/dev/kmsg"
KERNEL_LOG_MAX_BYTES = 8 << 20

FIT_ADVICE = ("to fit, raise parallel.fsdp or parallel.pp (less state per worker), raise parallel.microbatches "
              "(smaller micro-batches) or set train.activation_checkpointing=true (less activation memory)")
"""What to change, in the one line of a run that ran out of memory."""

_CPU_ALLOCATOR = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")


@dataclass(frozen=True)
class NodeMemory:
    """A node's memory in MiB, and where the figures come from."""

    total_mb: int
    available_mb: int
    source: str

    def text(self) -> str:
        return f"{self.available_mb / 1024:.1f} of {self.total_mb / 1024:.1f} GiB available per {self.source}"


def node_memory(path: str = MEMINFO) -> Optional[NodeMemory]:
    """This node's total and available memory from ``/proc/meminfo``; None where it cannot be read."""
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = {k: int(v.split()[0]) for k, v in fields.items() if k in ("MemTotal", "MemAvailable")}
        return NodeMemory(kib["MemTotal"] // 1024, kib["MemAvailable"] // 1024, path)
    except (OSError, KeyError, ValueError, IndexError):
        return None


KERNEL_KILL_WINDOW_S = 600.0
"""How recent a kernel log record of an OOM kill must be to explain a worker lost now (an older one
names a process that had the same pid before)."""


def kernel_killed(pid: int, log: Optional[str] = None, now_us: Optional[int] = None) -> bool:
    """Whether this node's kernel log says its OOM killer killed the Ray worker ``pid`` in the last
    KERNEL_KILL_WINDOW_S (``Out of memory: Killed process 4242 (ray::StageWorke)``, or a memory
    cgroup's). ``log``: the log's records (``priority,sequence,microseconds since boot,flags;text``;
    default: ``/dev/kmsg``, which a process may not be allowed to read: False); ``now_us``: the
    clock of those records now (default: CLOCK_MONOTONIC)."""
    text = read_kernel_log() if log is None else log
    now_us = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6) if now_us is None else now_us
    killed = re.compile(rf"Killed process {int(pid)} \(ray::")
    for record in text.splitlines():
        head, _, message = record.partition(";")
        fields = head.split(",")
        if killed.search(message) and len(fields) >= 3 and fields[2].isdigit():
            if now_us - int(fields[2]) <= KERNEL_KILL_WINDOW_S * 1e6:
                return True
    return False


def read_kernel_log(path: str = KERNEL_LOG) -> str:
    """The kernel's ring buffer as text, without waiting for more (empty where it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    records, size, overwritten = [], 0, 0
    try:
        while size < KERNEL_LOG_MAX_BYTES and overwritten < 100:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:  # no more records
                break
            except BrokenPipeError:  # a record was overwritten while reading: read on
                overwritten += 1
                continue
            except OSError:
                break
            if not record:
                break
            records.append(record)
            size += len(record)
    finally:
        os.close(fd)
    return b"".join(records).decode(errors="replace")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: a MemoryError, torch's OutOfMemoryError (a
    device's allocator; a RuntimeError, so it is recognised by class name without importing torch),
    or torch's CPU allocator's RuntimeError."""
    if isinstance(error, MemoryError):
        return True
    if any(c.__name__ == "OutOfMemoryError" and c.__module__.split(".")[0] == "torch" for c in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and bool(_CPU_ALLOCATOR.search(str(error)))


def error_line(error: BaseException) -> str:
    """``MemoryError`` or ``RuntimeError: DefaultCPUAllocator: ...``: the exception's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def reraise_out_of_memory(error: BaseException) -> None:
    """Raise ``error`` again if it is out of memory (a handler of failed collectives must not take torch's
    allocator errors, RuntimeErrors too, for a peer's failure)."""
    if is_out_of_memory(error):
        raise error


class WorkerOutOfMemory(MemoryError):
    """Raised by a worker whose call ran out of memory (raytrain.worker.actor): its state is undefined,
    so it leaves the run. ``error`` is the original exception's line; ``memory`` its node's memory then;
    ``node`` the node's address."""

    def __init__(self, error: str, memory: Optional[NodeMemory] = None, pid: int = 0, node: str = ""):
        super().__init__(error, memory, pid, node)  # every field in args: the exception pickles whole
        self.error, self.memory, self.pid, self.node = error, memory, pid, node

    def __str__(self) -> str:
        return self.error


@dataclass(frozen=True)
class OutOfMemory:
    """Why a lost worker is counted as out of memory: who ended it, Ray's or the worker's error line,
    the node's address and its memory (at the kill where Ray reports it, else as read afterwards)."""

    killed_by: str
    """``ray memory monitor``, ``kernel oom killer`` or ``allocation failed`` (the worker's own error)."""
    error: str
    node: str = ""
    memory: Optional[NodeMemory] = None

    def record(self) -> dict:
        """The fields of an ``oom`` event."""
        return {"killed_by": self.killed_by, "error": self.error[:500], "node": self.node,
                "node_memory": asdict(self.memory) if self.memory else None}

    def text(self) -> str:
        """``was killed by Ray's memory monitor (node 10.0.0.2: 0.3 of 23.5 GiB available per ...)``."""
        how = {"ray memory monitor": "was killed by Ray's memory monitor",
               "kernel oom killer": "was killed by the kernel's OOM killer"}.get(
            self.killed_by, f"failed to allocate memory ({_short(self.error)})")
        where = ": ".join(p for p in (f"node {self.node}" if self.node else "",
                                      self.memory.text() if self.memory else "") if p)
        return f"{how} ({where})" if where else how


def _short(error: str, limit: int = 140) -> str:
    """An allocator's error without its source location (``[enforce fail at alloc_cpu.cpp:127] err == 0.``)
    or its errno sentence, cut at ``limit`` characters."""
    text = re.sub(r"\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", error)
    text = re.sub(r"\.?\s*Error code \d+ \([^)]*\)\.?$", "", text).strip()
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."
