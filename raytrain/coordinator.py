"""The actor that owns a run: starts the workers in a placement group, forms their process groups,
drives the steps, aggregates metrics and publishes checkpoints.

It sends one small message per worker per step (``run_step(step)``) and gets metrics back; no tensor
passes through it. The driver polls ``poll()`` for new metric rows while ``run()`` executes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain import checkpoint
from raytrain.config import Config, config_from_dict
from raytrain.data import even_shares
from raytrain.mesh import Mesh
from raytrain.worker import StageWorker

SETUP_TIMEOUT_S = 300.0
"""Bound on worker start-up and process-group formation."""


class StepFailed(RuntimeError):
    """A step did not complete on every worker (a worker died, raised, or timed out)."""


class Coordinator:
    def __init__(self, config: dict, data_path: str, num_samples: int, stage_layers: list[list[int]],
                 placement: PlacementGroup, first_bundle: int, resume_from: Optional[str], worker_cls=StageWorker):
        self.cfg: Config = config_from_dict(config)
        self.config_dict = config
        self.data_path, self.num_samples = data_path, num_samples
        self.stage_layers = stage_layers
        self.placement, self.first_bundle = placement, first_bundle
        self.resume_from = resume_from
        self.worker_cls = ray.remote(worker_cls) if not hasattr(worker_cls, "remote") else worker_cls
        self.mesh = Mesh(self.cfg.parallel.dp, self.cfg.parallel.pp)
        self.workers: list[Any] = []
        self.generation = 0
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._store = None
        self.last_checkpoint: Optional[str] = None

    # --- driver-facing ----------------------------------------------------------------------------

    def poll(self) -> list[dict]:
        """Metric rows produced since the last poll."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def run(self) -> dict:
        """Train to ``train.steps``; returns the summary. Raises on an unrecoverable failure."""
        self._start_workers()
        start_step = 0
        if self.resume_from is not None:
            start_step = checkpoint.read_manifest(self.resume_from)["step"]
            ray.get([w.load.remote(self.resume_from) for w in self.workers], timeout=SETUP_TIMEOUT_S)
            self._emit({"event": "resumed", "from": self.resume_from, "step": start_step})
        every = self.cfg.checkpoint.every
        for step in range(start_step, self.cfg.train.steps):
            row = self._run_step(step)
            done = step + 1
            if (every and done % every == 0) or done == self.cfg.train.steps:
                row["checkpoint"] = self._checkpoint(done)
            self._emit(row)
        return {"steps": self.cfg.train.steps, "checkpoint": self.last_checkpoint, "start_step": start_step,
                "worker_pids": self.worker_pids}

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    # --- internals ---------------------------------------------------------------------------------

    def _emit(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def _start_workers(self) -> None:
        cfg = self.cfg
        resources = {"num_cpus": cfg.resources.cpus_per_worker, "num_gpus": 1 if cfg.resources.use_gpu else 0}
        self.workers = [
            self.worker_cls.options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=self.first_bundle + rank),
            ).remote(self.config_dict, self.data_path, self.num_samples)
            for rank in range(self.mesh.world_size)
        ]
        # Import torch only now, while the workers import theirs: the store outlives any worker.
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        shares = even_shares(cfg.train.global_batch, self.mesh.dp)
        infos = ray.get(
            [w.setup.remote(rank, self.mesh, self.stage_layers, shares, (host, self._store.port), self.generation)
             for rank, w in enumerate(self.workers)],
            timeout=SETUP_TIMEOUT_S,
        )
        self.worker_pids = [info["pid"] for info in infos]
        self._emit({"event": "started", "layout": cfg.layout(), "workers": infos, "generation": self.generation})

    def _run_step(self, step: int) -> dict:
        trace = step < self.cfg.run.trace_steps
        t0 = time.perf_counter()
        refs = [w.run_step.remote(step, trace) for w in self.workers]
        try:
            results = ray.get(refs, timeout=self.cfg.resources.step_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise StepFailed(f"step {step} failed on layout {self.cfg.layout()}: {e}") from e
        wall = time.perf_counter() - t0
        return aggregate_step(step, results, wall, self.cfg, self.mesh)

    def _checkpoint(self, step: int) -> str:
        """Save every stage's shard, publish the manifest; returns the checkpoint's path."""
        base = self.cfg.checkpoint.dir
        ckpt_dir = checkpoint.step_dir(base, step)
        t0 = time.perf_counter()
        savers = [self.workers[self.mesh.rank(0, s)] for s in range(self.mesh.pp)]
        shards = ray.get([w.save.remote(ckpt_dir) for w in savers], timeout=SETUP_TIMEOUT_S)
        checkpoint.publish(ckpt_dir, {
            "step": step,
            "samples_seen": step * self.cfg.train.global_batch,
            "layout": {"dp": self.mesh.dp, "pp": self.mesh.pp, "stage_layers": self.stage_layers},
            "shards": shards,
            "config": self.config_dict,
        })
        checkpoint.prune(base, self.cfg.checkpoint.keep)
        self.last_checkpoint = ckpt_dir
        self._emit({"event": "checkpoint", "step": step, "path": ckpt_dir, "seconds": round(time.perf_counter() - t0, 3)})
        return ckpt_dir


def aggregate_step(step: int, results: list[dict], wall_s: float, cfg: Config, mesh: Mesh) -> dict:
    """One metrics.jsonl row from every worker's report of a step."""
    B = cfg.train.global_batch
    last_stage = [r for r in results if mesh.coords(r["rank"])[1] == mesh.pp - 1]
    loss = sum(r["loss_sum"] for r in last_stage) / B
    # Bubble: idle share of each replica's pipeline span (its stages x its slowest stage's span).
    bubbles = []
    for replica in range(mesh.dp):
        stages = [r for r in results if mesh.coords(r["rank"])[0] == replica]
        span = max(r["pipeline_s"] for r in stages)
        bubbles.append(1.0 - sum(r["busy_s"] for r in stages) / (len(stages) * span) if span > 0 else 0.0)
    row = {
        "step": step + 1,
        "loss": loss,
        "grad_norm": results[0]["grad_norm"],
        "step_s": wall_s,
        "time": time.time(),
        "samples_per_s": B / wall_s,
        "worker_step_s": max(r["wall_s"] for r in results),
        "bubble": sum(bubbles) / len(bubbles),
        "peak_live_activations": {str(r["rank"]): r["peak_live"] for r in results},
        "peak_mem_mb": {str(r["rank"]): round(r["peak_mem_mb"], 1) for r in results},
        "layout": cfg.layout(),
    }
    if any("events" in r for r in results):
        row["events"] = {str(r["rank"]): r["events"] for r in results if "events" in r}
    if cfg.run.record_samples:
        row["sample_ids"] = [i for r in sorted(results, key=lambda r: r["rank"]) for i in r.get("sample_ids", [])]
    return row
