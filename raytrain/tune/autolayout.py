"""``parallel.auto``: probe the feasible layouts with short Tune trials and train with the fastest.

The candidates are every dp x fsdp x tp x pp layout of the cluster's workers that the config can run
(tp > 1 only where a tp group fits on one node, and the model's tp plan splits its layers so).
One whose estimated memory per worker (raytrain.models.memory: the fullest worker's training state,
gathered layer and activations) exceeds a worker's memory is not probed, and the probe table says so; a layout that fails its probe (out of device memory, for one) is never chosen. The probes are a
normal raytrain sweep (``raytrain.tune``), kept under ``<run.dir>/auto-layout`` for inspection;
they run one at a time so that each measures the whole cluster alone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, TextIO

import ray

from raytrain.config import Config, ParallelConfig
from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.config.prepared import ModelFacts
from raytrain.driver.memory import layout_memory, worker_memory_bytes
from raytrain.driver.placement import worker_bundle
from raytrain.models.memory import gib
from raytrain.pipeline.schedule import V_SCHEDULES


def candidate_layouts(cfg: Config, workers: int, layers: int) -> list[dict]:
    """Every layout that uses all ``workers`` workers and that the config can run.

    dp x fsdp data-parallel workers need to divide the global batch (a model.factory's or model.hf's
    limit on fsdp and the tp plan for tp are applied by ``choose_layout``); tp > 1 needs the config's checks
    (one node, the built-in GPT's heads) to pass; pipelines need pp <= ``layers`` and take each of
    parallel.auto_microbatches that divides each worker's share, with each of parallel.auto_schedules.
    """
    p, batch = cfg.parallel, cfg.train.global_batch
    layouts = []
    for pp, tp, fsdp in _grids(workers, layers):
        mesh = Mesh(dp=workers // (pp * tp * fsdp), fsdp=fsdp, tp=tp, pp=pp)
        if batch % mesh.columns:
            continue
        grid = {"parallel.dp": mesh.dp, "parallel.pp": pp, **({"parallel.fsdp": fsdp} if fsdp > 1 else {}),
                **({"parallel.tp": tp} if tp > 1 else {})}
        if not _runnable(cfg, {**grid, **schedule_keys("1f1b")}):  # the grid alone, whatever the base's schedule
            continue
        if pp == 1:
            layouts.append({**grid, "parallel.microbatches": 1, "parallel.virtual_stages": 1})
            continue
        for m in sorted(set(p.auto_microbatches)):
            if (batch // mesh.columns) % m == 0:
                for s in p.auto_schedules:
                    layout = {**grid, "parallel.microbatches": m, **schedule_keys(s)}
                    if s not in CHUNKED_SCHEDULES or (2 * pp <= layers and _runnable(cfg, layout)):
                        layouts.append(layout)
    return layouts


CHUNKED_SCHEDULES = ("interleaved_1f1b", *V_SCHEDULES)


def schedule_keys(schedule: str) -> dict:
    """The keys a schedule sets: two chunks per worker for the interleaved and V schedules, else one."""
    return {"parallel.schedule": schedule, "parallel.virtual_stages": 2 if schedule in CHUNKED_SCHEDULES else 1}


def _grids(workers: int, layers: int):
    """(pp, tp, fsdp) of every grid whose pp x tp x fsdp divides ``workers`` (dp takes the rest)."""
    for pp in range(1, min(workers, layers) + 1):
        for tp in (t for t in range(1, workers // pp + 1) if workers % (pp * t) == 0):
            for fsdp in (f for f in range(1, workers // (pp * tp) + 1) if workers % (pp * tp * f) == 0):
                yield pp, tp, fsdp


def splits_by_tp(cfg: Config, model: list, tp: int) -> bool:
    """Whether the model's tp plan splits its layers over ``tp`` ranks (the built-in GPT's heads are the
    config's own check; a model.factory's or model.hf's tp plan is checked here, as a run would)."""
    if tp == 1 or (cfg.model.factory is None and cfg.model.hf is None):
        return True
    if cfg.model.factory is not None:
        from raytrain.models.tensor_plan import plan_problem

        return plan_problem(model, tp, cfg.parallel.sequence_parallel) is None
    from raytrain.models.hf_prepare import check_tensor_parallel, resolve_cut, with_hf_architecture

    try:
        check_tensor_parallel(resolve_cut(with_hf_architecture(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, auto=False, tp=tp)))))
    except ValueError:
        return False
    return True


def _runnable(cfg: Config, grid: dict) -> bool:
    """Whether the config's own checks pass with this grid (fsdp against the model's rows, for one)."""
    try:
        dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, auto=False, **{k.split(".", 1)[1]: v for k, v in grid.items()}))
    except ValueError:
        return False
    return True


def layout_of(params: dict) -> Layout:
    """The Layout a candidate's parallel.* keys set."""
    return Layout.of(ParallelConfig(**{k.split(".", 1)[1]: v for k, v in params.items()}))


def too_big(cfg: Config, layouts: list[dict], layer_params: list[int],
            worker_bytes: Optional[float]) -> dict[int, str]:
    """Why each layout whose estimated memory per worker (raytrain.models.memory, the estimate every run
    is checked against) exceeds ``worker_bytes`` cannot run, by its index."""
    if worker_bytes is None:
        return {}
    reasons = {}
    for i, params in enumerate(layouts):
        need = layout_memory(cfg, layout_of(params), layer_params)
        if need.total > worker_bytes:
            reasons[i] = f"estimated {need.describe()} per worker exceeds the {gib(worker_bytes)} GiB a worker has"
    return reasons


def cluster_workers(cfg: Config) -> int:
    """How many workers of this config's bundle the cluster holds, capped by parallel.auto_max_workers."""
    total = ray.cluster_resources()
    fits = min(int(total.get(resource, 0) // amount) for resource, amount in worker_bundle(cfg).items())
    cap = cfg.parallel.auto_max_workers
    return min(fits, cap) if cap else fits


def choose_layout(cfg: Config, facts: ModelFacts, model: list, stream: TextIO) -> tuple[Config, dict]:
    """Probe every candidate layout of a model whose layers prepare built (``model``; ``facts`` what it
    learned of them); returns the config with the fastest, and what was probed."""
    from raytrain import tune as rt_tune

    workers, layers = cluster_workers(cfg), len(facts.layer_params)
    tps = {tp: splits_by_tp(cfg, model, tp) for tp in range(1, workers + 1) if workers % tp == 0}
    layouts = [c for c in candidate_layouts(cfg, workers, layers)
               if c.get("parallel.fsdp", 1) <= facts.max_fsdp and tps[c.get("parallel.tp", 1)]]
    if not layouts:
        raise ValueError(f"parallel.auto=true: no layout of {workers} worker(s) fits train.global_batch="
                         f"{cfg.train.global_batch} and {layers} layers; set the layout by hand")
    rejected = too_big(cfg, layouts, list(facts.layer_params), worker_memory_bytes(cfg) if cfg.resources.check_memory else None)
    skipped = [_rejected_row(layouts[i], reason) for i, reason in rejected.items()]
    layouts = [params for i, params in enumerate(layouts) if i not in rejected]
    if not layouts:
        raise ValueError("parallel.auto=true: no layout's training state fits a worker:\n  "
                         + "\n  ".join(f"{r.layout}: {r.status}" for r in skipped)
                         + "\nuse more workers (parallel.auto_max_workers, a bigger cluster) or a smaller model")
    base = cfg.to_dict()
    base["parallel"].update(auto=False, split_points=None)
    base["train"]["steps"] = cfg.parallel.auto_steps
    base["checkpoint"].update(every=0, resume=None, dir=None)
    base["run"].update(trace_steps=0, name=None)
    base["elastic"]["faults"] = []
    base["eval"]["every"] = 0  # a probe measures steps: evaluations would only make it longer
    stream.write(f"[raytrain] parallel.auto: probing {len(layouts)} layout(s) of {workers} worker(s), "
                 f"{cfg.parallel.auto_steps} steps each\n")
    sweep = rt_tune.SweepConfig(
        base=base, space={rt_tune.LAYOUTS: layouts}, metric="samples_per_s", mode="max",
        storage_path=os.path.join(os.path.expanduser(cfg.run.dir), "auto-layout"),
        name=time.strftime("probe-%Y%m%d-%H%M%S"),
    )
    rows = rt_tune.summarize(rt_tune.run_sweep(sweep), sweep)
    stream.write(rt_tune.format_table(rows + skipped) + "\n")
    finished = [r for r in rows if r.status == "finished"]
    if not finished:
        raise RuntimeError("parallel.auto=true: every probed layout failed (see the table above); "
                           "set the layout by hand")
    best = finished[0]  # rows come sorted by samples/s, best first
    chosen = {key.split(".", 1)[1]: value for key, value in best.params[rt_tune.LAYOUTS].items()}
    stream.write(f"[raytrain] parallel.auto: chose {best.layout} ({best.samples_per_s:.1f} samples/s)\n")
    probes = [{"layout": r.layout, "samples_per_s": r.samples_per_s, "status": r.status} for r in rows + skipped]
    new_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, auto=False, **chosen))
    return new_cfg, {"chosen": best.layout, "probes": probes, "experiment": sweep.storage_path}


def _rejected_row(params: dict, reason: str):
    """A probe-table row for a layout that was not probed because its state would not fit."""
    from raytrain.tune import TrialRow

    return TrialRow(trial_id="-", layout=layout_of(params).label, params={"layouts": params},
                    status=f"not probed: {reason}", steps=0, loss=float("nan"), samples_per_s=0.0,
                    first_step_s=float("nan"))
