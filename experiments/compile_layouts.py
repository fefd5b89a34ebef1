"""train.compile in every layout: a small built-in GPT trained compiled at dp=1 (2 micro-batches), dp=2, pp=2,
fsdp=2 and tp=2, each against the compiled dp=1 run and against an eager one-process reference (the same
math: rounding only), with the seconds each spent compiling (start-up badput) and its samples/s after
the first step beside an eager run of the same layout.

    python experiments/compile_layouts.py                      # about 3 minutes on 2 cores, warm Inductor cache
    python experiments/compile_layouts.py --steps 20 --layouts parallel.dp=2

Every worker runs micro-batches of 4 samples, so the layouts share one compiled graph per kind of layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "train.global_batch=8",
         "train.lr=1e-2", "train.seed=3", "data.max_bytes=200000", "run.trace_steps=0"]
LAYOUTS = ["parallel.microbatches=2", "parallel.dp=2", "parallel.pp=2,parallel.microbatches=2", "parallel.fsdp=2",
           "parallel.tp=2"]


def relative(a, b) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)) for k in b)


def run(layout: str, compiled: bool, steps: int, root: str):
    from raytrain import checkpoint, train
    from raytrain.config import load_config

    cfg = load_config(None, MODEL + layout.split(",") + [f"train.steps={steps}", f"checkpoint.every={steps}",
                                                         f"train.compile={str(compiled).lower()}", f"run.dir={root}"])
    result = train(cfg, stream=open(os.devnull, "w"))
    steady = result.metrics[1:]
    rate = cfg.train.global_batch * len(steady) / sum(r["step_s"] for r in steady)
    return cfg, checkpoint.load_state_dict(result.checkpoint), result.metrics[0].get("compile_s", 0.0), rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", nargs="*", default=LAYOUTS)
    args = parser.parse_args()
    import ray

    from raytrain.testing.reference import train_reference

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    print(f"{'layout':<40} {'vs compiled dp=1':>16} {'vs eager':>9} {'compile s':>9} {'samples/s':>9} {'eager':>7}")
    with tempfile.TemporaryDirectory() as root:
        base = None
        for layout in args.layouts:
            cfg, state, compile_s, rate = run(layout, True, args.steps, root)
            _, _, _, eager_rate = run(layout, False, args.steps, root)
            if base is None:
                model, _ = train_reference(cfg)
                eager = {k: v.detach() for k, v in model.named_parameters()}
                base = state
            print(f"{layout:<40} {relative(state, base):>16.1e} {relative(state, eager):>9.1e} {compile_s:>9.1f} "
                  f"{rate:>9.1f} {eager_rate:>7.1f}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
