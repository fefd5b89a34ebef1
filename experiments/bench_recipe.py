"""Memory and speed of the training-recipe switches: activation checkpointing and bf16 autocast.

GPT with 8 blocks, d_model 256, 4 heads, seq 128, global batch 32, dp=2 (2 gloo workers of one
torch thread), 15 steps of which the first is warm-up. Each variant is a fresh raytrain run (fresh
worker processes) in one embedded Ray; variants are interleaved over ``--repeats`` rounds and the
median run is shown. Prints each worker's peak resident memory (CPU) or peak allocated memory
(GPU) and samples/s, with ratios against the fp32 run without checkpointing, and checks that
activation checkpointing ends at the same parameters.

    python experiments/bench_recipe.py              # about 4 minutes on 2 cores
    python experiments/bench_recipe.py --repeats 1 --steps 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

MODEL = ["model.n_layer=8", "model.d_model=256", "model.n_head=4", "model.seq_len=128", "model.vocab_size=256"]
VARIANTS = {
    "fp32": [],
    "fp32 + activation checkpointing": ["train.activation_checkpointing=true"],
    "bf16": ["resources.bf16=true"],
    "bf16 + activation checkpointing": ["resources.bf16=true", "train.activation_checkpointing=true"],
}


def run_variant(name: str, steps: int, workdir: str) -> dict:
    from raytrain import checkpoint, train
    from raytrain.config import load_config

    cfg = load_config(None, MODEL + VARIANTS[name] + [
        f"train.steps={steps}", "train.global_batch=32", "train.lr=1e-3", "parallel.dp=2", "run.trace_steps=0",
        f"run.dir={workdir}"])
    result = train(cfg, stream=open(os.devnull, "w"))
    peak = max(float(v) for v in result.metrics[-1]["peak_mem_mb"].values())
    return {"name": name, "samples_per_s": result.samples_per_s, "peak_mb": peak, "loss": result.final_loss,
            "params": checkpoint.load_state_dict(result.checkpoint)}


def relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)) for k in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.repeats):
            for name in VARIANTS:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                runs.setdefault(name, []).append(run_variant(name, args.steps, workdir))
    ray.shutdown()
    median = {name: sorted(rs, key=lambda r: r["samples_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    base = median["fp32"]
    print(f"\n{'variant':<34} {'peak MB/worker':>14} {'vs fp32':>8} {'samples/s':>10} {'vs fp32':>8} {'loss':>7}")
    for name, r in median.items():
        print(f"{name:<34} {r['peak_mb']:>14.0f} {r['peak_mb'] / base['peak_mb']:>7.2f}x "
              f"{r['samples_per_s']:>10.1f} {r['samples_per_s'] / base['samples_per_s']:>7.2f}x {r['loss']:>7.4f}")
    for name, rs in runs.items():
        rates = " / ".join(f"{r['samples_per_s']:.1f}" for r in rs)
        peaks = " / ".join(f"{r['peak_mb']:.0f}" for r in rs)
        print(f"{name}: samples/s {rates}; peak MB {peaks}")
    diff = relative_difference(median["fp32 + activation checkpointing"]["params"], base["params"])
    print(f"\nactivation checkpointing vs none: parameters differ by {diff:.1e} relative (same math: ~0)")


if __name__ == "__main__":
    main()
