"""The Ray actor that owns one device and hosts one pipeline stage of one data-parallel replica.

Deliberately thin: torch is imported inside the worker process (raytrain.stage), so the driver and
the coordinator never import it and worker start-up is not serialised behind theirs. The class name
contains ``Worker`` so the processes are recognisable in ``ps`` (``ray::StageWorker``).
"""

from __future__ import annotations

import os

import ray


class StageWorker:
    def __init__(self, config: dict, data_path: str, num_samples: int, stage: int, layer_ids: list[int]):
        from raytrain.stage import Stage

        self.stage = Stage(config, data_path, num_samples, stage, layer_ids)

    def pid(self) -> int:
        return os.getpid()

    def join(self, rank, mesh, shares, store, generation, faults) -> dict:
        return self.stage.join(rank, mesh, shares, store, generation, faults)

    def leave(self) -> None:
        self.stage.leave()

    def commit_prepared(self, step: int) -> int:
        return self.stage.commit_prepared(step)

    def sync_state(self, src_rank: int) -> int:
        return self.stage.sync_state(src_rank)

    @ray.method(enable_task_events=False)  # called every step: not worth tracing in Ray's task table
    def run_step(self, step: int, trace: bool = False) -> dict:
        return self.stage.run_step(step, trace)

    def save(self, ckpt_dir: str) -> dict:
        return self.stage.save(ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.stage.load(ckpt_dir)

    def shutdown(self) -> None:
        self.stage.shutdown()
