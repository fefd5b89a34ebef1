"""The Ray actor that owns one device and hosts one pipeline stage (or one shard of it) of one
data-parallel replica.

Deliberately thin: torch is imported inside the worker process (raytrain.worker.stage), so the driver and
the coordinator never import it and worker start-up is not serialised behind theirs. The class name
contains ``Worker`` so the processes are recognisable in ``ps`` (``ray::StageWorker``).
"""

from __future__ import annotations

import os
from typing import Optional

import ray

from raytrain.config import Config
from raytrain.data.atomic import atomic_path
from raytrain.reports import EvalReport, JoinReport, ShardReport, StepReport


class StageWorker:
    def __init__(self, cfg: Config, data_path: str, num_samples: int, stage: int, layer_ids: list[int],
                 corpus: Optional[list] = None, shard: int = 0):
        from raytrain.worker.stage import Stage

        data_path = dataset_here(data_path, corpus, cfg.data.cache_dir)
        self.stage = Stage(cfg, data_path, num_samples, stage, layer_ids, shard=shard)

    def pid(self) -> int:
        return os.getpid()

    def join(self, rank, mesh, shares, store, generation, faults) -> JoinReport:
        return self.stage.join(rank, mesh, shares, store, generation, faults)

    def leave(self) -> None:
        self.stage.leave()

    def commit_prepared(self, step: int) -> int:
        return self.stage.commit_prepared(step)

    def skip_step(self, step: int) -> int:
        return self.stage.skip_step(step)

    def sync_state(self, src_rank: int) -> int:
        return self.stage.sync_state(src_rank)

    @ray.method(enable_task_events=False)  # called every step: not worth tracing in Ray's task table
    def run_step(self, step: int, trace: bool = False) -> StepReport:
        # The hook sees the reply: a fault due in the next step waits until the caller has read it.
        return self.stage.hook.reply(step, self.stage.run_step(step, trace))

    def evaluate(self) -> EvalReport:
        return self.stage.evaluate()

    def save(self, ckpt_dir: str) -> ShardReport:
        return self.stage.save(ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.stage.load(ckpt_dir)

    def state_digest(self) -> str:
        return self.stage.state_digest()

    def shutdown(self) -> None:
        self.stage.shutdown()


def dataset_here(data_path: str, corpus: Optional[list], cache_dir: str) -> str:
    """The dataset's path on this machine. The driver's path where it exists here (the driver's own
    machine, or storage every node mounts); else, for the built-in corpus, which the driver built in
    its own cache, the driver's copy of the file (``corpus``: [object ref of its bytes]) written
    into this machine's cache, so that every worker trains on the same bytes."""
    if os.path.exists(data_path) or not corpus:
        return data_path
    local = os.path.join(os.path.expanduser(cache_dir), os.path.basename(data_path))
    if not os.path.exists(local):
        with atomic_path(local) as tmp, open(tmp, "wb") as f:
            f.write(ray.get(corpus[0]))
    return local
