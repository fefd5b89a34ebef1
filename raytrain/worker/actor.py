"""The Ray actor that owns one device and hosts one pipeline stage (or one shard of it) of one
data-parallel replica.

Deliberately thin: torch is imported inside the worker process (raytrain.worker.stage), so the driver and
the coordinator never import it and worker start-up is not serialised behind theirs. The class name
contains ``Worker`` so the processes are recognisable in ``ps`` (``ray::StageWorker``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from typing import Optional

import ray

from raytrain.config.prepared import Slot, WorkerSpec
from raytrain.data import shards
from raytrain.data.atomic import atomic_path
from raytrain.data.samples import DataSource
from raytrain.reports import BackgroundSave, EvalReport, JoinReport, ShardReport, StepReport
from raytrain.reports.oom import WorkerOutOfMemory, error_line, is_out_of_memory, node_memory


def import_torch_uncollected() -> None:
    """Import torch, dynamo (AdamW's constructor would import it) and the stage with Python's cyclic
    collector paused, then freeze what the imports made: they build about half a million objects that live
    as long as the process, and the collector would traverse them during the imports (a sixth of the
    imports' CPU) and again on every full collection while the worker trains (a pause in some steps)."""
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401

        import raytrain.worker.stage  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def leaves_when_out_of_memory(method):
    """A worker call that ran out of memory (a MemoryError, torch's OutOfMemoryError or its CPU allocator's
    error) raises WorkerOutOfMemory with this node's memory, after dropping the worker's process groups so
    that its peers fail at once: its state is undefined now, and the coordinator takes it out of the run."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if isinstance(e, WorkerOutOfMemory) or not is_out_of_memory(e):
                raise
            error = error_line(e)
            e.__traceback__ = None  # its frames hold what was allocated
            del e
            try:
                self.stage.leave()
            except Exception:  # noqa: BLE001 -- it leaves the run either way
                pass
            raise WorkerOutOfMemory(error, node_memory(), os.getpid(), ray.util.get_node_ip_address()) from None

    return call


class StageWorker:
    def __init__(self, spec: WorkerSpec, slot: Slot, beat_id: int = 0):
        from raytrain.worker.heartbeat import Heartbeat

        # beating from the start: a worker that hangs while it starts is found as one that hangs in a step
        self.heartbeat = None if spec.heartbeat_to is None else Heartbeat(
            spec.heartbeat_to, beat_id,
            on_abort=lambda generation: self.stage.abort(generation) if hasattr(self, "stage") else None,
            leaving=lambda: self.drain.notice.why if hasattr(self, "drain") and self.drain.notice else None)
        import_torch_uncollected()
        from raytrain.worker.drain import DrainWatch
        from raytrain.worker.stage import Stage

        # a SIGTERM, or this node draining: leave at the next step boundary
        self.drain = DrainWatch(spec.cfg.elastic.drain_grace_s, ray.get_runtime_context().get_node_id())
        spec = dataclasses.replace(spec, source=dataset_here(spec.source, spec.corpus, spec.cfg.data.cache_dir))
        self.stage = Stage(spec, slot, leaving=lambda: self.drain.notice is not None)

    def pid(self) -> int:
        return os.getpid()

    @leaves_when_out_of_memory
    def join(self, rank, mesh, shares, store, generation, faults) -> JoinReport:
        report = self.stage.join(rank, mesh, shares, store, generation, faults)
        report.node = ray.get_runtime_context().get_node_id()  # the node Ray knows, not the host's name
        return report

    def leave(self) -> None:
        self.stage.leave()

    @leaves_when_out_of_memory
    def commit_prepared(self, step: int) -> int:
        return self.stage.commit_prepared(step)

    @leaves_when_out_of_memory
    def skip_step(self, step: int) -> int:
        return self.stage.skip_step(step)

    @leaves_when_out_of_memory
    def sync_state(self, src_rank: int) -> int:
        return self.stage.sync_state(src_rank)

    @ray.method(enable_task_events=False)  # called every step: not worth tracing in Ray's task table
    @leaves_when_out_of_memory
    def run_step(self, step: int, trace: bool = False, hold: bool = False) -> StepReport:
        # The hook sees the reply: a fault due in the next step waits until the caller has read it.
        report = self.stage.run_step(step, trace, hold)
        report.draining = self.drain.notice
        if report.ok:
            self.drain.step_s = report.wall_s
        return self.stage.hook.reply(step, report)

    @leaves_when_out_of_memory
    def evaluate(self) -> EvalReport:
        return self.stage.evaluate()

    @leaves_when_out_of_memory
    def save(self, ckpt_dir: str) -> ShardReport:
        return self.stage.save(ckpt_dir)

    @leaves_when_out_of_memory
    def start_save(self, ckpt_dir: str) -> float:
        return self.stage.start_save(ckpt_dir)

    @leaves_when_out_of_memory
    def finish_save(self) -> Optional[BackgroundSave]:
        return self.stage.finish_save()

    @leaves_when_out_of_memory
    def load(self, ckpt_dir: str) -> None:
        self.stage.load(ckpt_dir)

    @leaves_when_out_of_memory
    def state_digest(self) -> str:
        return self.stage.state_digest()

    def shutdown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.stage.shutdown()


def dataset_here(source: DataSource, corpus: Optional[list], cache_dir: str) -> DataSource:
    """The run's files as this machine reads them. The driver's paths (its own machine, storage every
    node mounts, or URIs); but for the built-in corpus, which the driver built in its own cache, where this
    machine lacks it, the driver's copy of the file (``corpus``: [object ref of its bytes]) written into
    this machine's cache, so that every worker trains on the same bytes."""
    if not corpus or os.path.exists(source.train.paths[0]):
        return source
    local = os.path.join(os.path.expanduser(cache_dir), os.path.basename(source.train.paths[0]))
    if not os.path.exists(local):
        with atomic_path(local) as tmp, open(tmp, "wb") as f:
            f.write(ray.get(corpus[0]))
    return dataclasses.replace(source, train=shards.one_file(local, source.train.samples[0]))
