"""Sweep the pipeline benchmark's GPT over layouts with Ray Tune, and compare per-trial start-up.

GPT with 8 blocks, d_model 256, seq 128, global batch 32, on this machine's 2 CPUs: dp=1, dp=2, and
pp=2 with m in {2, 4, 8} under both schedules. Prints throughput per layout (and writes
results.csv and layouts.png in the experiment directory), then the per-trial overhead: time from a
trial's start to its first step, against a Ray Train TorchTrainer launched per trial on the same
model (time from fit() to the end of its first step).

    python experiments/sweep_layouts.py                   # about 6 minutes on 2 cores
    python experiments/sweep_layouts.py --ray-train-only  # just the Ray Train start-up figure
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

BASE = {
    "model": {"n_layer": 8, "d_model": 256, "n_head": 4, "seq_len": 128, "vocab_size": 256},
    "train": {"steps": 12, "global_batch": 32, "lr": 1.0e-3, "grad_clip": 0.0},
    "run": {"trace_steps": 0},
}
LAYOUTS = [{"parallel.dp": 1}, {"parallel.dp": 2}] + [
    {"parallel.pp": 2, "parallel.microbatches": m, "parallel.schedule": s} for m in (2, 4, 8) for s in ("gpipe", "1f1b")
]


def ray_train_first_step_s(storage: str) -> float:
    """fit() to the end of the first step, for a 2-worker TorchTrainer on the same model."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        import torch

        import ray.train
        import ray.train.torch as rtt
        from raytrain.config import build_config, flatten_sections
        from raytrain.models.layers import build_model

        torch.set_num_threads(1)
        cfg = build_config(flatten_sections(BASE, "bench"))
        spec = build_model(cfg.model, 0)
        model = rtt.prepare_model(torch.nn.Sequential(*spec.layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (16, 128))
        loss = spec.loss_fn(model(x), x)
        loss.backward()
        opt.step()
        if ray.train.get_context().get_world_rank() == 0:
            with open(config["out"], "w") as f:
                f.write(str(time.time()))
        ray.train.report({"step": 1})

    out = os.path.join(storage, "ray-train-first-step.txt")
    start = time.time()
    TorchTrainer(loop, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=storage, name="ray-train-overhead")).fit()
    with open(out) as f:
        return float(f.read()) - start


def main() -> None:
    import ray

    if "--ray-train-only" in sys.argv:  # re-measure the Ray Train side alone
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory() as storage:
            print(f"Ray Train TorchTrainer: fit() -> end of first step {ray_train_first_step_s(storage):.1f} s")
        ray.shutdown()
        return

    from raytrain import data, tune as rt_tune
    from raytrain.config import build_config, flatten_sections

    data.resolve_data_path(build_config(flatten_sections(BASE, "bench")))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        sweep = rt_tune.SweepConfig(base=BASE, space={"layouts": LAYOUTS}, storage_path=storage, name="layouts")
        grid = rt_tune.run_sweep(sweep)
        rows = rt_tune.summarize(grid, sweep)
        print(rt_tune.format_table(rows))
        csv_path, png_path = rt_tune.write_reports(grid, rows, "experiments/results")
        print(f"\nwrote {csv_path} and {png_path}")
        ray_train_s = ray_train_first_step_s(storage)
    raytrain_s = sorted(r.first_step_s for r in rows)[len(rows) // 2]
    print(f"\nper-trial start-up (trial start -> first step): raytrain median {raytrain_s:.1f} s, "
          f"Ray Train TorchTrainer {ray_train_s:.1f} s ({raytrain_s / ray_train_s:.2f}x)")
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
