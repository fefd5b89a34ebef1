"""Pipeline throughput: raytrain's schedules vs torch.distributed.pipelining's vs one process vs a naive
pipeline that passes activations through Ray object refs.

GPT with 8 blocks, d_model 256, 4 heads, seq 128, vocab 256, global batch 32, cut into 2 stages (or
4 chunks, two per worker, for interleaved 1F1B, zero-bubble V and DualPipeV; balanced by parameters,
the same cut for every system) on 2 gloo workers of 1 torch thread; micro-batches m in {1, 2, 4, 8}.
Prints samples/s, ratios, efficiency (samples/s over twice one process's), measured bubble against
theory, peak memory and live activations per worker, and per m the ratio of raytrain's best schedule
to torch.pipelining's best.

    python experiments/bench_pp.py                 # about 10 minutes on 2 cores
    python experiments/bench_pp.py --steps 10 --microbatches 4
    python experiments/bench_pp.py --microbatches 4 --without-ray   # adds "raytrain <schedule> no Ray" rows
    python experiments/bench_pp.py --microbatches 4 --unfused       # adds "raytrain <schedule> unfused" rows
    python experiments/bench_pp.py --microbatches 4 --split         # adds "raytrain <schedule> split" rows
    python experiments/bench_pp.py --microbatches 2,8 --schedules gpipe --split   # one schedule only
    python experiments/bench_pp.py --microbatches 4,8 --schedules 1f1b,interleaved_1f1b,zbv,dualpipev --split --repeats 3

raytrain uses AdamW's fused kernel (train.fused_optimizer, its default); torch.pipelining and the
other baselines use torch's default AdamW. ``--unfused`` adds "raytrain <schedule> unfused" rows
with it turned off, to show what the fused step contributes.

"raytrain <schedule>" rows run raytrain's defaults: the same algorithm as torch.pipelining's
ScheduleGPipe and Schedule1F1B, step for step. ``--split`` adds "raytrain <schedule> split" rows with
parallel.split_backward=true: stage 1 sends its input gradient before it computes its weight
gradients.

The "no Ray" rows run raytrain's own stage executor in plain torchrun processes
(experiments/executor_without_ray.py), splitting raytrain's distance from torch.pipelining into
what its executor costs and what running inside Ray costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODEL = ["model.n_layer=8", "model.d_model=256", "model.n_head=4", "model.seq_len=128", "model.vocab_size=256"]
GLOBAL_BATCH = 32
PP = 2
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules on the V placement, built on the B/W split (raytrain.pipeline.schedule.V_SCHEDULES)."""


def bench_config(steps, extra=()):
    from raytrain.config import load_config

    return load_config(None, MODEL + [f"train.steps={steps}", f"train.global_batch={GLOBAL_BATCH}", "train.lr=1e-3",
                                      "train.grad_clip=0", f"parallel.pp={PP}", "run.trace_steps=0", *extra])


def stage_cut(cfg) -> list[range]:
    from raytrain.driver.model_check import model_layout

    return model_layout(cfg).stage_ranges


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its other figures come with it)."""
    return sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]


def steady_rate(step_ends: list[float], warmup: int) -> float:
    return (len(step_ends) - 1 - warmup) * GLOBAL_BATCH / (step_ends[-1] - step_ends[warmup])


# --- systems -----------------------------------------------------------------------------------


def run_raytrain(steps, warmup, m, schedule, workdir, fused=True, split=False):
    from raytrain import train

    cfg = bench_config(steps, [f"parallel.microbatches={m}", *chunked_keys(schedule), f"run.dir={workdir}",
                               "run.trace_steps=3", f"train.fused_optimizer={str(fused).lower()}",
                               f"parallel.split_backward={str(split).lower()}"])
    result = train(cfg, stream=open(os.devnull, "w"))
    rows = result.metrics
    return {"samples_per_s": steady_rate([r["time"] for r in rows], warmup),
            "bubble": sum(r["bubble"] for r in rows[warmup:]) / len(rows[warmup:]),
            "peak_mem_mb": [rows[-1]["peak_mem_mb"][str(s)] for s in range(PP)],
            "peak_live": [rows[-1]["peak_live_activations"][str(s)] for s in range(PP)],
            "run_dir": result.run_dir}


def run_executor_without_ray(steps, warmup, m, schedule, workdir):
    import executor_without_ray

    cfg = bench_config(steps, [f"parallel.microbatches={m}", f"parallel.schedule={schedule}"])
    from raytrain.driver.model_check import model_layout

    ends = executor_without_ray.launch(cfg, model_layout(cfg).worker_layers, workdir, f"no-ray-{schedule}-{m}")
    return {"samples_per_s": steady_rate(ends, warmup)}


def run_one_process(steps, warmup):
    import torch
    from torch import nn

    from raytrain import data
    from raytrain.models.layers import build_model

    torch.set_num_threads(1)
    cfg = bench_config(steps)
    spec = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*spec.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = data.TokenDataset(data.resolve_data_path(cfg), "tokens", cfg.model.seq_len)
    ends = []
    for step in range(steps):
        x, y = ds.batch(data.sample_ids(0, len(ds), step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
        opt.zero_grad()
        spec.loss_fn(model(x), y).backward()
        opt.step()
        ends.append(time.time())
    return {"samples_per_s": steady_rate(ends, warmup)}


TORCH_SCHEDULES = {  # raytrain's name -> (torch.pipelining's class, stages per rank, V placement)
    "gpipe": ("ScheduleGPipe", 1, False), "1f1b": ("Schedule1F1B", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False), "zbv": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}
CHUNKED = ("interleaved_1f1b", "zbv", "dualpipev")
"""raytrain's schedules with two chunks per worker (parallel.virtual_stages=2)."""


def torch_pipelining_worker(steps, m, schedule, out):
    """Runs under torchrun: one process per pipeline rank, holding one stage or two (the same cut as
    raytrain's: the model in PP x chunks pieces balanced by parameters)."""
    import resource

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining

    from raytrain import data
    from raytrain.models.layers import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    class_name, chunks, v_shape = TORCH_SCHEDULES[schedule]
    cfg = bench_config(steps, chunked_keys("zbv" if chunks > 1 else "1f1b"))  # the same cut in 2 or 4 pieces
    cuts, num_stages = stage_cut(cfg), PP * chunks
    indices = [rank, 2 * PP - 1 - rank] if v_shape else [rank + c * PP for c in range(chunks)]
    stages, params = [], []
    for index in indices:
        spec = build_model(cfg.model, cfg.train.seed, list(cuts[index]))
        module = nn.Sequential(*spec.layers)
        stages.append(pipelining.PipelineStage(module, index, num_stages, torch.device("cpu")))
        params += list(module.parameters())
    sched_cls = getattr(pipelining, class_name)
    sched = sched_cls(stages[0] if chunks == 1 else stages, n_microbatches=m, loss_fn=spec.loss_fn)
    opt = torch.optim.AdamW(params, lr=1e-3)
    ds = data.TokenDataset(data.resolve_data_path(cfg), "tokens", cfg.model.seq_len)
    holds_first, holds_last = 0 in indices, num_stages - 1 in indices
    ends = []
    for step in range(steps):
        x, y = ds.batch(data.sample_ids(0, len(ds), step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
        opt.zero_grad()
        inputs = (x,) if holds_first else ()
        sched.step(*inputs, **({"target": y, "losses": []} if holds_last else {}))
        opt.step()
        ends.append(time.time())
    mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    mems = [torch.zeros(1) for _ in range(PP)]
    dist.all_gather(mems, mem)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_end": ends, "peak_mem_mb": [float(t) for t in mems]}, f)
    dist.destroy_process_group()


def chunked_keys(schedule: str) -> list[str]:
    """The config keys of ``schedule``: two chunks per worker for the interleaved and V schedules."""
    return [f"parallel.schedule={schedule}"] + (["parallel.virtual_stages=2"] if schedule in CHUNKED else [])


def run_torch_pipelining(steps, warmup, m, schedule, workdir):
    out = os.path.join(workdir, f"tpp-{schedule}-{m}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PP), "--master_port", "29544",
           os.path.abspath(__file__), "--torch-worker", schedule, "--microbatches", str(m), "--steps", str(steps),
           "--out", out]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(out) as f:
        res = json.load(f)
    return {"samples_per_s": steady_rate(res["step_end"], warmup), "peak_mem_mb": res["peak_mem_mb"]}


def run_naive_object_refs(steps, warmup, m):
    """Each micro-batch's activation and its gradient go through the Ray object store."""
    import ray

    @ray.remote(num_cpus=1)
    class NaiveStage:
        def __init__(self, layer_ids):
            import torch
            from torch import nn

            from raytrain import data
            from raytrain.models.layers import build_model

            torch.set_num_threads(1)
            self.cfg = bench_config(steps)
            spec = build_model(self.cfg.model, self.cfg.train.seed, layer_ids)
            self.module, self.loss_fn = nn.Sequential(*spec.layers), spec.loss_fn
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
            self.ds = data.TokenDataset(data.resolve_data_path(self.cfg), "tokens", self.cfg.model.seq_len)
            self.saved = {}

        def _batch(self, step, mb):
            from raytrain import data

            size = GLOBAL_BATCH // m
            start = step * GLOBAL_BATCH + mb * size
            return self.ds.batch(data.sample_ids(0, len(self.ds), start, start + size))

        def forward(self, step, mb):
            x, _ = self._batch(step, mb)
            out = self.module(x)
            self.saved[mb] = out
            return out.detach()

        def forward_backward(self, step, mb, act):
            _, y = self._batch(step, mb)
            act = act.requires_grad_()
            (self.loss_fn(self.module(act), y) / m).backward()
            return act.grad

        def backward(self, mb, grad):
            self.saved.pop(mb).backward(grad)

        def step(self):
            self.opt.step()
            self.opt.zero_grad()
            return time.time()

    cut = stage_cut(bench_config(steps))
    first, last = NaiveStage.remote(list(cut[0])), NaiveStage.remote(list(cut[1]))
    ends = []
    for step in range(steps):
        grads = [last.forward_backward.remote(step, mb, first.forward.remote(step, mb)) for mb in range(m)]
        for mb in range(m):
            first.backward.remote(mb, grads[mb])
        ends.append(max(ray.get([first.step.remote(), last.step.remote()])))
    ray.kill(first)
    ray.kill(last)
    return {"samples_per_s": steady_rate(ends, warmup)}


def try_run(runs: dict, skipped: dict, name: str, run) -> None:
    """Add ``run()``'s figures under ``name``, or the reason torch.pipelining refused the setting."""
    if name in skipped:
        return
    try:
        runs.setdefault(name, []).append(run())
    except RuntimeError as e:
        skipped[name] = (str(e).strip().splitlines() or ["failed"])[-1][:160]


def theory_bubble(kind: str, m: int) -> float:
    """The idle share theory predicts: (p-1)/(m+p-1) for GPipe and 1F1B, divided by the chunks for
    interleaved 1F1B; for the V schedules the timing model's figure at forward = input gradient = weight
    gradient time, where zero-bubble V is built to leave none but the warm-up's."""
    from raytrain.pipeline import checker, schedule
    from raytrain.pipeline.actions import Placement

    if kind in V_SCHEDULES:
        if kind == "dualpipev" and m < 2 * PP:
            return float("nan")  # neither side runs it (DualPipeV fills a V of 2 PP micro-batches)
        finish, busy, _ = checker.simulate(schedule.build_schedule(kind, PP, m, True, 2), 1.0, 2.0, 1.0,
                                           placement=Placement.of_schedule(kind, PP, 2))
        return 1.0 - sum(busy) / (finish * PP)
    return checker.bubble_formula(PP, m, 2 if kind == "interleaved_1f1b" else 1)


def print_best(m: int, rows: dict) -> None:
    """raytrain's best schedule against torch.pipelining's best at this m: what a user choosing either gets."""
    ours = {n: r for n, r in rows.items() if n.startswith("raytrain") and "no Ray" not in n}
    theirs = {n: r for n, r in rows.items() if n.startswith("torch.pipelining")}
    if not ours or not theirs:
        return
    best_ours = max(ours, key=lambda n: ours[n]["samples_per_s"])
    best_theirs = max(theirs, key=lambda n: theirs[n]["samples_per_s"])
    ratio = ours[best_ours]["samples_per_s"] / theirs[best_theirs]["samples_per_s"]
    print(f"{m:>2} best: {best_ours} / {best_theirs} = {ratio:.3f}x\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zbv,dualpipev",
                        help="comma-separated subset of gpipe,1f1b,interleaved_1f1b,zbv,dualpipev")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system and m, interleaved; the median is shown")
    parser.add_argument("--without-ray", action="store_true",
                        help="also run raytrain's executor in plain torchrun processes")
    parser.add_argument("--unfused", action="store_true",
                        help="also run raytrain with train.fused_optimizer=false (torch's default AdamW, as the baselines)")
    parser.add_argument("--split", action="store_true",
                        help="also run raytrain with parallel.split_backward=true (input gradient sent before weight gradients)")
    parser.add_argument("--only-raytrain", action="store_true", help="skip the baselines (quick A/B of raytrain's own options)")
    parser.add_argument("--torch-worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.schedules.split(",")) - set(TORCH_SCHEDULES)
    if unknown:
        parser.error(f"--schedules: unknown {sorted(unknown)}; use a subset of {','.join(TORCH_SCHEDULES)}")
    if args.torch_worker:
        torch_pipelining_worker(args.steps, int(args.microbatches), args.torch_worker, args.out)
        return
    import ray

    from raytrain import data
    data.resolve_data_path(bench_config(args.steps))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"stage cut: {[f'{r[0]}-{r[-1]}' for r in stage_cut(bench_config(args.steps))]}", file=sys.stderr)
    one = run_one_process(args.steps, args.warmup)["samples_per_s"]
    print(f"one process: {one:.1f} samples/s\n", flush=True)
    header = (f"{'m':>2} {'system':<30} {'samples/s':>9} {'vs torch.pp':>11} {'vs 1 proc':>9} {'effic':>6} "
              f"{'bubble':>7} {'theory':>7} {'peak MB/stage':>15} {'live act/stage':>14}")
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        for m in [int(x) for x in args.microbatches.split(",")]:
            runs: dict[str, list[dict]] = {}
            skipped: dict[str, str] = {}
            # Repeats interleave the systems, so a slow minute on this shared machine hits them all.
            for _ in range(args.repeats):
                for kind in args.schedules.split(","):
                    if not args.only_raytrain:
                        try_run(runs, skipped, f"torch.pipelining {kind}",
                                lambda: run_torch_pipelining(args.steps, args.warmup, m, kind, workdir))
                    if (kind == "interleaved_1f1b" and m % PP) or (kind == "dualpipev" and m < 2 * PP):
                        continue  # interleaved 1F1B runs rounds of PP micro-batches; DualPipeV fills a V of 2 PP
                    split = kind in V_SCHEDULES  # the V schedules split as they are written to
                    runs.setdefault(f"raytrain {kind}", []).append(
                        run_raytrain(args.steps, args.warmup, m, kind, workdir, split=split))
                    if args.unfused:
                        runs.setdefault(f"raytrain {kind} unfused", []).append(
                            run_raytrain(args.steps, args.warmup, m, kind, workdir, fused=False, split=split))
                    if args.split and kind not in V_SCHEDULES:
                        runs.setdefault(f"raytrain {kind} split", []).append(
                            run_raytrain(args.steps, args.warmup, m, kind, workdir, split=True))
                    if args.without_ray:
                        runs.setdefault(f"raytrain {kind} no Ray", []).append(
                            run_executor_without_ray(args.steps, args.warmup, m, kind, workdir))
            for name, why in skipped.items():
                print(f"{m:>2} {name:<30} n/a: {why}", flush=True)
            if not args.only_raytrain:
                runs["naive Ray object refs"] = [run_naive_object_refs(args.steps, args.warmup, m)]
            rows = {name: median_run(rs) for name, rs in runs.items()}
            for name, r in rows.items():
                kind = name.split()[1] if name.startswith("raytrain") else name.split()[-1]
                base = rows.get(f"torch.pipelining {kind}")
                vs = f"{r['samples_per_s'] / base['samples_per_s']:.3f}x" if base else "-"
                bubble = f"{r['bubble']:.3f}" if "bubble" in r else "-"
                theory = f"{theory_bubble(kind, m):.3f}" if kind in TORCH_SCHEDULES else "-"
                mem = "/".join(f"{v:.0f}" for v in r.get("peak_mem_mb", [])) or "-"
                live = "/".join(str(v) for v in r.get("peak_live", [])) or "-"
                spread = "/".join(f"{x['samples_per_s']:.1f}" for x in runs[name]) if len(runs[name]) > 1 else ""
                print(f"{m:>2} {name:<30} {r['samples_per_s']:>9.1f} {vs:>11} {r['samples_per_s'] / one:>8.2f}x "
                      f"{r['samples_per_s'] / (PP * one):>6.3f} {bubble:>7} {theory:>7} {mem:>15} {live:>14}  {spread}",
                      flush=True)
            print_best(m, rows)
            if m == 4 and "raytrain 1f1b" in rows:
                shown = rows.get("raytrain 1f1b split", rows["raytrain 1f1b"])  # the README's picture
                src = os.path.join(shown["run_dir"], "timeline.png")
                os.makedirs("experiments/results", exist_ok=True)
                if os.path.exists(src):
                    import shutil

                    shutil.copy(src, "experiments/results/timeline_pp2_m4_1f1b.png")
    ray.shutdown()


if __name__ == "__main__":
    main()
