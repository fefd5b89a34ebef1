"""Data-parallel throughput and start-up: raytrain vs Ray Train V2 vs torchrun DDP vs one process.

raytrain uses AdamW's fused kernel (train.fused_optimizer, its default); the baselines use torch's
default AdamW, as their users do. The row ``raytrain-unfused`` turns that off, to show what the
fused step contributes. The row ``raytrain-no-ray`` is raytrain's own worker code in plain torchrun processes
(experiments/executor_without_ray.py): raytrain against it is what running inside Ray costs,
it against torchrun DDP is what raytrain's executor costs.

Same GPT (4 layers, d_model 256, 4 heads, seq 128, vocab 256), global batch 32, AdamW, the same data
order; 2 gloo workers of 1 torch thread each. Every system runs in its own subprocess launched by this
script, so "time to first step" counts from process launch (interpreter, imports, cluster start) to
the end of the first optimizer step. Steady throughput counts steps after the warm-up.

    python experiments/bench_dp.py            # all systems, 60 steps
    python experiments/bench_dp.py --steps 30 --only raytrain,torchrun
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=128", "model.vocab_size=256"]
GLOBAL_BATCH = 32
WARMUP = 10
SYSTEMS = ["one-process", "torchrun", "raytrain", "raytrain-unfused", "raytrain-no-ray", "ray-train-v2"]


def bench_config(steps: int, extra=()):
    from raytrain.config import load_config

    return load_config(None, MODEL + [f"train.steps={steps}", f"train.global_batch={GLOBAL_BATCH}", "train.lr=1e-3",
                                      "train.grad_clip=0", "parallel.dp=2", "run.trace_steps=0", *extra])


# --- variants (each runs in its own process and writes step end times as JSON) ---------------


def _plain_step_loop(model, loss_fn, optimizer, dataset, ids_for_step, steps, out, rank=0):
    import torch

    times = []
    for step in range(steps):
        x, y = dataset.batch(ids_for_step(step))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.time())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_end": times}, f)


def _data_and_model(cfg):
    import torch
    from torch import nn

    from raytrain import data
    from raytrain.models.layers import build_model

    spec = build_model(cfg.model, cfg.train.seed)
    path = data.resolve_data_path(cfg)
    return nn.Sequential(*spec.layers), spec.loss_fn, data.TokenDataset(path, "tokens", cfg.model.seq_len), data


def run_one_process(steps, out):
    import torch

    torch.set_num_threads(1)
    cfg = bench_config(steps)
    model, loss_fn, dataset, data = _data_and_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    ids = lambda s: data.sample_ids(cfg.train.seed, len(dataset), s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
    _plain_step_loop(model, loss_fn, opt, dataset, ids, steps, out)


def run_torchrun_worker(steps, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = bench_config(steps)
    model, loss_fn, dataset, data = _data_and_model(cfg)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    share = GLOBAL_BATCH // world
    ids = lambda s: data.sample_ids(cfg.train.seed, len(dataset), s * GLOBAL_BATCH + rank * share,
                                    s * GLOBAL_BATCH + (rank + 1) * share)
    _plain_step_loop(model, loss_fn, opt, dataset, ids, steps, out, rank)
    dist.destroy_process_group()


def run_raytrain(steps, out, fused=True):
    import ray

    from raytrain import train

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = bench_config(steps, [f"run.dir={os.path.dirname(out)}", f"train.fused_optimizer={str(fused).lower()}"])
    result = train(cfg, stream=open(os.devnull, "w"))
    steps_rows = result.metrics
    overhead = [1 - r["worker_step_s"] / r["step_s"] for r in steps_rows[WARMUP:]]
    with open(out, "w") as f:
        json.dump({"step_end": [r["time"] for r in steps_rows],
                   "control_overhead": sum(overhead) / len(overhead)}, f)
    ray.shutdown()


def run_ray_train_v2(steps, out):
    import ray
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    def loop(config):
        import torch

        import ray.train.torch as rtt

        torch.set_num_threads(1)
        cfg = bench_config(config["steps"])
        model, loss_fn, dataset, data = _data_and_model(cfg)
        model = rtt.prepare_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        share = GLOBAL_BATCH // world
        times = []
        for step in range(config["steps"]):
            x, y = dataset.batch(data.sample_ids(cfg.train.seed, len(dataset), step * GLOBAL_BATCH + rank * share,
                                                 step * GLOBAL_BATCH + (rank + 1) * share))
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            ray.train.report({"loss": loss.item(), "step": step})
            times.append(time.time())
        if rank == 0:
            with open(config["out"], "w") as f:
                json.dump({"step_end": times}, f)

    trainer = TorchTrainer(
        loop, train_loop_config={"steps": steps, "out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=os.path.dirname(out), name="ray-train-bench"),
    )
    trainer.fit()
    ray.shutdown()


# --- orchestration --------------------------------------------------------------------------


def launch(system: str, steps: int, workdir: str) -> dict:
    launched = time.time()
    if system == "raytrain-no-ray":
        import executor_without_ray
        from raytrain.driver.model_check import model_layout

        cfg = bench_config(steps)
        res = {"step_end": executor_without_ray.launch(cfg, model_layout(cfg).worker_layers, workdir, system)}
    else:
        out = os.path.join(workdir, f"{system}.json")
        script = [os.path.abspath(__file__), "--variant", system, "--steps", str(steps), "--out", out]
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
        cmd = [sys.executable, *(launcher if system == "torchrun" else []), *script]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            res = json.load(f)
    ends = res["step_end"]
    steady = (len(ends) - 1 - WARMUP) * GLOBAL_BATCH / (ends[-1] - ends[WARMUP])
    return {"system": system, "first_step_s": ends[0] - launched, "samples_per_s": steady,
            "control_overhead": res.get("control_overhead")}


def median_by_throughput(runs: list[dict]) -> dict:
    """The run with the median steady throughput (its other figures come with it)."""
    return sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1, help="runs per system, interleaved; the median is shown")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        variants = {"one-process": run_one_process, "torchrun": run_torchrun_worker, "raytrain": run_raytrain,
                    "raytrain-unfused": lambda steps, out: run_raytrain(steps, out, fused=False),
                    "ray-train-v2": run_ray_train_v2}
        variants[args.variant](args.steps, args.out)
        return
    # Build the corpus once so no system pays for it.
    from raytrain import data

    data.resolve_data_path(bench_config(args.steps))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        # Repeats interleave the systems, so a slow minute on this shared machine hits them all.
        for _ in range(args.repeats):
            for system in args.only.split(","):
                print(f"running {system} ...", file=sys.stderr, flush=True)
                runs.setdefault(system, []).append(launch(system, args.steps, workdir))
    rows = [median_by_throughput(rs) for rs in runs.values()]
    if args.repeats > 1:
        for system, rs in runs.items():
            rates = " / ".join(f"{r['samples_per_s']:.1f}" for r in rs)
            firsts = " / ".join(f"{r['first_step_s']:.1f}" for r in rs)
            print(f"{system}: samples/s {rates}; first step s {firsts}")
    base = {r["system"]: r for r in rows}
    ref = base.get("torchrun")
    rtrain = base.get("ray-train-v2")
    print(f"\n{'system':<16} {'first step s':>12} {'samples/s':>10} {'vs torchrun':>12} {'first step vs Ray Train':>24}")
    for r in rows:
        vs_tr = f"{r['samples_per_s'] / ref['samples_per_s']:.3f}x" if ref else "-"
        vs_rt = f"{r['first_step_s'] / rtrain['first_step_s']:.2f}x" if rtrain else "-"
        print(f"{r['system']:<16} {r['first_step_s']:>12.1f} {r['samples_per_s']:>10.1f} {vs_tr:>12} {vs_rt:>24}")
    if "raytrain" in base:
        print(f"\nraytrain control plane + per-step metrics: {base['raytrain']['control_overhead']:.2%} of step time")


if __name__ == "__main__":
    main()
