"""A worker's checkpoint writes: its shard streamed from the live tensors (a synchronous save), or
written on a thread of its own while the worker trains (checkpoint.async_save).

A background shard is a snapshot (a CPU copy taken at the step boundary, so training may change the live
tensors at once); the thread streams it to storage and keeps the result until the next save starts,
and each step's report carries it to the coordinator, which publishes the manifest only once every
saver's file is durable. At most one write is in flight: a new save, a shutdown and a blocking
``wait`` first let the previous one finish.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from raytrain import checkpoint
from raytrain.reports import BackgroundSave, ShardReport
from raytrain.worker.stage_state import StageState, all_finite


class BackgroundWriter:
    """The worker's one checkpoint-writing thread and the result of its last write.

    A write starts once ``release`` is called (the worker's next step, or a wait for the write), not
    while the call that started it is still answering: the coordinator has its reply, the snapshot
    taken, before anything of the write can fail, so a saver lost mid-write is always a loss during
    the next step and never a failed start."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[BackgroundSave] = None
        self._go = threading.Event()

    def start(self, ckpt_dir: str, write: Callable[[], ShardReport]) -> None:
        """Run ``write`` on a new thread once released; the previous write must have finished (``wait`` first)."""
        assert self._thread is None or not self._thread.is_alive(), "one background save at a time"
        self._result, self._go = None, threading.Event()
        go = self._go

        def run() -> None:
            go.wait()
            try:
                self._result = BackgroundSave(ckpt_dir, shard=write())
            except Exception as e:  # reported to the coordinator, which fails the run as a synchronous save would
                self._result = BackgroundSave(ckpt_dir, error=f"{type(e).__name__}: {str(e)[:400]}")

        self._thread = threading.Thread(target=run, name="raytrain-checkpoint-writer", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let the write started last begin (no-op when none waits)."""
        self._go.set()

    def finished(self) -> Optional[BackgroundSave]:
        """The last write's result if it has finished (None while it runs, or if none was started)."""
        return None if self._thread is not None and self._thread.is_alive() else self._result

    def wait(self) -> Optional[BackgroundSave]:
        """Block until the write in flight (if any) has finished; its result."""
        self.release()
        if self._thread is not None:
            self._thread.join()
        return self._result


class ShardSaves:
    """Writes one stage's shard (shard ``part`` of its rows, when sharded) into checkpoint directories."""

    def __init__(self, state: StageState, stage: int, part: Optional[int]):
        self.state, self.stage, self.part = state, stage, part
        self.writer = BackgroundWriter()

    def save(self, ckpt_dir: str, committed: int, hook) -> ShardReport:
        """Stream the live tensors into ``ckpt_dir`` (a background save still writing finishes first)."""
        self.writer.wait()
        return self._write(ckpt_dir, self.state.shard(), committed, hook)

    def start(self, ckpt_dir: str, committed: int, hook) -> float:
        """Snapshot the shard and write it on the background thread (after the previous write has
        finished); returns the seconds the snapshot stalled training."""
        self.writer.wait()
        t0 = time.perf_counter()
        shard = self.state.shard(copy=True)
        self.writer.start(ckpt_dir, lambda: self._write(ckpt_dir, shard, committed, hook))
        return time.perf_counter() - t0

    def _write(self, ckpt_dir: str, shard: dict[str, Any], committed: int, hook) -> ShardReport:
        """``hook``: the worker's PhaseHook (a ``checkpoint`` fault fires half-way through this write)."""
        hook("checkpoint", committed, file=checkpoint.join_uri(ckpt_dir, checkpoint.shard_name(self.stage, self.part)))
        entry = checkpoint.save_shard(ckpt_dir, self.stage, shard, self.part)
        return ShardReport(entry=entry, finite=all_finite(shard))
