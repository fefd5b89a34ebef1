"""``parallel.auto``: probe the feasible layouts with short Tune trials and train with the fastest.

A layout that fails its probe (out of device memory, for one) is never chosen. The probes are a
normal raytrain sweep (``raytrain.tune``), kept under ``<run.dir>/auto-layout`` for inspection;
they run one at a time so that each measures the whole cluster alone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TextIO

import ray

from raytrain.config import Config
from raytrain.placement import worker_bundle


def candidate_layouts(cfg: Config, workers: int, layers: int) -> list[dict]:
    """Every layout that uses all ``workers`` workers and that the config can run.

    Data parallel needs dp to divide the global batch; pipelines need pp <= ``layers`` and take
    each of parallel.auto_microbatches that divides the per-replica batch, with each of
    parallel.auto_schedules.
    """
    p, batch = cfg.parallel, cfg.train.global_batch
    layouts = []
    for pp in range(1, min(workers, layers) + 1):
        dp, rest = divmod(workers, pp)
        if rest or batch % dp:
            continue
        if pp == 1:
            layouts.append({"parallel.dp": dp, "parallel.pp": 1, "parallel.microbatches": 1})
            continue
        for m in sorted(set(p.auto_microbatches)):
            if (batch // dp) % m == 0:
                layouts += [{"parallel.dp": dp, "parallel.pp": pp, "parallel.microbatches": m, "parallel.schedule": s}
                            for s in p.auto_schedules]
    return layouts


def cluster_workers(cfg: Config) -> int:
    """How many workers of this config's bundle the cluster holds, capped by parallel.auto_max_workers."""
    total = ray.cluster_resources()
    fits = min(int(total.get(resource, 0) // amount) for resource, amount in worker_bundle(cfg).items())
    cap = cfg.parallel.auto_max_workers
    return min(fits, cap) if cap else fits


def choose_layout(cfg: Config, layers: int, stream: TextIO) -> tuple[Config, dict]:
    """Probe every candidate layout; returns the config with the fastest, and what was probed."""
    from raytrain import tune as rt_tune

    workers = cluster_workers(cfg)
    layouts = candidate_layouts(cfg, workers, layers)
    if not layouts:
        raise ValueError(f"parallel.auto=true: no layout of {workers} worker(s) fits train.global_batch="
                         f"{cfg.train.global_batch} and {layers} layers; set the layout by hand")
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
    stream.write(rt_tune.format_table(rows) + "\n")
    finished = [r for r in rows if r.status == "finished"]
    if not finished:
        raise RuntimeError("parallel.auto=true: every probed layout failed (see the table above); "
                           "set the layout by hand")
    best = finished[0]  # rows come sorted by samples/s, best first
    chosen = {key.split(".", 1)[1]: value for key, value in best.params[rt_tune.LAYOUTS].items()}
    stream.write(f"[raytrain] parallel.auto: chose {best.layout} ({best.samples_per_s:.1f} samples/s)\n")
    probes = [{"layout": r.layout, "samples_per_s": r.samples_per_s, "status": r.status} for r in rows]
    new_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, auto=False, **chosen))
    return new_cfg, {"chosen": best.layout, "probes": probes, "experiment": sweep.storage_path}
