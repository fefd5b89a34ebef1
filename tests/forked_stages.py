"""raytrain's ``Stage`` executor in forked processes joined by gloo, without Ray: for test grids.

A Ray worker spends about 3 s of CPU starting (a Python process, ``import torch``, and the
``torch._dynamo`` import that AdamW's constructor triggers), so a grid of layouts on actors costs
tens of seconds on 2 cores. Here one forkserver imports all that once (``tests.forked_preload``) and
forks every worker in milliseconds. The workers run the very code a ``StageWorker`` hosts (``join``
then ``run_step`` per step, with the same store, mesh, shares and stage cut as a raytrain run); what
Ray adds (placement, the coordinator's messages, repair) is tested on real actors elsewhere.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Optional

import torch

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.config.prepared import Slot, WorkerSpec
from raytrain.data.order import even_shares
from raytrain.driver.prepare import prepare
from raytrain.driver.rendezvous import RendezvousStore

JOIN_TIMEOUT_S = 120.0
"""Bound on one run of the whole grid cell; a hang fails the test instead of CI."""

_context: Optional[multiprocessing.context.BaseContext] = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["tests.forked_preload"])  # imported once, inherited by every fork
    return _context


def _run_worker(spec: WorkerSpec, rank: int, mesh: Mesh, store, out_dir: str, resume: Optional[str],
                rejoin_at: Optional[int] = None, evaluate_after: tuple[int, ...] = ()) -> None:
    from raytrain.worker.stage import Stage

    replica, stage_index = mesh.coords(rank)
    shard, tp = mesh.shard(rank), mesh.tp_index(rank)
    cfg = spec.cfg
    steps = cfg.train.steps
    stage = Stage(spec, Slot(stage_index, shard, tp))
    if resume is not None:
        stage.load(resume)
    stage.join(rank, mesh, even_shares(cfg.train.global_batch, mesh.dp), store, generation=0, faults=[])
    peak_live, held_out, last_step_events = 0, [], []
    for step in range(stage.committed, steps):
        if step == rejoin_at:  # a new generation: groups re-formed, a sharded or tp stage re-wrapped on them
            stage.join(rank, mesh, even_shares(cfg.train.global_batch, mesh.dp), store, generation=1, faults=[])
        result = stage.run_step(step, trace=step == steps - 1)  # the last step's actions and collectives, timed
        if not result.ok:
            raise RuntimeError(f"rank {rank} failed step {step}: {result.error}")
        peak_live, last_step_events = max(peak_live, result.peak_live), result.events
        if step + 1 in evaluate_after:
            report = stage.evaluate()
            if not report.ok:
                raise RuntimeError(f"rank {rank} failed the evaluation after step {step + 1}: {report.error}")
            if report.loss_sum is not None:  # a last stage: its sum over its replica's (shard's) rows
                held_out.append([step + 1, report.loss_sum, report.rows, report.metric_sums, report.metric_counts])
    if evaluate_after:
        with open(os.path.join(out_dir, f"held-out-{rank}.json"), "w") as f:
            json.dump(held_out, f)
    if replica == 0:
        torch.save(stage.state.shard(), os.path.join(out_dir, f"stage{stage_index}-{shard}-{tp}.pt"))
        held = dict(zip(stage.state.names, stage.state.params))  # all this worker holds, written or not
        torch.save(held, os.path.join(out_dir, f"stage{stage_index}-{shard}-{tp}-held.pt"))
        with open(os.path.join(out_dir, f"stage{stage_index}-{shard}-{tp}.json"), "w") as f:
            tails = [list(chunk.input_tail) if chunk.input_tail else None for chunk in stage.gen.chunks]
            # a Hugging Face decoder layer's view of its input: a part of every sample's tokens, or all
            split = sorted({m.tokens_split_by for m in stage.executor.module.modules() if hasattr(m, "tokens_split_by")})
            json.dump({"peak_live": peak_live, "input_tails": tails, "tokens_split_by": split,
                       "last_step_events": last_step_events}, f)
    stage.shutdown()


def run_stages(cfg: Config, out_dir: str, rejoin_at: Optional[int] = None,
               evaluate_after: tuple[int, ...] = ()) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Train ``cfg`` (its dp x fsdp x tp x pp layout, resuming from checkpoint.resume if set) in forked
    processes, every worker joining a second generation before step ``rejoin_at`` if set and evaluating
    after each step of ``evaluate_after`` (``held_out_losses`` reads the results); returns the model by
    global name (shards reassembled) and the peak number of live activations of each stage (replica 0's,
    shard 0's)."""
    prepared = prepare(cfg)
    mesh = prepared.layout.mesh
    os.makedirs(out_dir, exist_ok=True)
    rendezvous = RendezvousStore()
    store = rendezvous.address("127.0.0.1", namespace=os.path.basename(out_dir))
    try:
        run_forked(_run_worker, [(prepared.worker_spec(), rank, mesh, store, out_dir, prepared.resume, rejoin_at,
                                  evaluate_after) for rank in range(mesh.world_size)])
    finally:
        rendezvous.close()
    pieces, peak_live = checkpoint.Assembler(None, checkpoint.new_tensors()), []
    for s in range(mesh.pp):
        for f in range(mesh.fsdp):
            for t in range(mesh.tp):
                pieces.add(torch.load(os.path.join(out_dir, f"stage{s}-{f}-{t}.pt"), weights_only=True))
        with open(os.path.join(out_dir, f"stage{s}-0-0.json")) as f:
            peak_live.append(json.load(f)["peak_live"])
    pieces.check(out_dir)
    return pieces.tensors()["model"], peak_live


def run_forked(target, args_per_rank: list[tuple]) -> None:
    """``target(*args)`` in one forked process per entry of ``args_per_rank``; fails unless every one
    exits 0 within JOIN_TIMEOUT_S, and leaves none behind."""
    ctx = _forkserver()
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_rank]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT_S)
        failed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
        assert not failed, f"forked workers failed (rank: exit code, None = still running): {failed}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def held_out_losses(out_dir: str) -> dict[int, tuple[float, int]]:
    """After ``run_stages(..., evaluate_after=...)``: step -> (held-out loss, rows), summed over the
    last stages' reports as the coordinator sums them (raytrain.control.evaluation)."""
    sums: dict[int, list] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("held-out-"):
            with open(os.path.join(out_dir, name)) as f:
                for step, loss_sum, rows, *_ in json.load(f):
                    total = sums.setdefault(step, [0.0, 0])
                    total[0], total[1] = total[0] + loss_sum, total[1] + rows
    return {step: (loss_sum / rows, rows) for step, (loss_sum, rows) in sorted(sums.items())}


def held_out_metrics(out_dir: str) -> dict[int, dict[str, float]]:
    """After ``run_stages(..., evaluate_after=...)``: step -> eval.metrics, each summed over the last stages'
    reports and divided by their counts, as the coordinator does (raytrain.control.evaluation)."""
    sums: dict[int, dict[str, list]] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("held-out-"):
            with open(os.path.join(out_dir, name)) as f:
                for step, _, _, metric_sums, counts in json.load(f):
                    for metric, value in metric_sums.items():
                        total = sums.setdefault(step, {}).setdefault(metric, [0.0, 0])
                        total[0], total[1] = total[0] + value, total[1] + counts[metric]
    return {step: {m: value / count for m, (value, count) in by.items()} for step, by in sorted(sums.items())}
