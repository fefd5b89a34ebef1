"""Memory per worker and speed of dp, fsdp, their mix (HSDP) and pp on one model whose state dominates.

GPT with 8 blocks, d_model 768, 12 heads, seq 64 (57M parameters: 0.9 GB of fp32 parameters,
gradients and AdamW moments), global batch 8, trained under dp=2, fsdp=2, dp=2 x fsdp=2 and
pp=2 (1F1B, 2 micro-batches). Each layout is a fresh raytrain run (fresh worker processes) in one
embedded Ray of 4 CPU slots, one torch thread per worker; layouts are interleaved over
``--repeats`` rounds and the median run is shown. Prints each worker's peak resident memory (CPU;
peak allocated memory on GPU), the largest against dp=2's, the state each worker holds in theory
(16 bytes per parameter it owns: fp32 value, gradient, two AdamW moments), samples/s against
dp=2's, and how far each layout's final parameters are from dp=2's (the same math: ~1e-6).

Beside the largest peak: the memory check's estimate for the layout's fullest worker
(raytrain.driver.memory.layout_memory, the figure a refusal rests on) and its ratio to that peak.

dp=2 x fsdp=2 runs 4 workers: on a machine with fewer than 4 cores its speed is not comparable.

    python experiments/bench_memory.py              # about 5 minutes on 2 cores
    python experiments/bench_memory.py --repeats 1 --steps 6
    python experiments/bench_memory.py --repeats 1 --steps 6 --layouts dp=2 "fsdp=2 x pp=2 interleaved" "fsdp=2 x pp=2 zbv"

The last two layouts (4 workers, not run by default) show what a split backward costs a sharded stage:
its layers stay gathered from their first backward of the step to their reduction after the last
weight half.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

MODEL = ["model.n_layer=8", "model.d_model=768", "model.n_head=12", "model.seq_len=64", "model.vocab_size=256"]
LAYOUTS = {
    "dp=2": ["parallel.dp=2"],
    "fsdp=2": ["parallel.fsdp=2"],
    "dp=2 x fsdp=2": ["parallel.dp=2", "parallel.fsdp=2"],
    "pp=2": ["parallel.pp=2", "parallel.microbatches=2"],
    "fsdp=2 x pp=2 interleaved": ["parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=4",
                                  "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    "fsdp=2 x pp=2 zbv": ["parallel.fsdp=2", "parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=zbv",
                          "parallel.virtual_stages=2"],
}
STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq


def run_layout(name: str, steps: int, workdir: str) -> dict:
    from raytrain import checkpoint, train
    from raytrain.config import load_config

    cfg = load_config(None, MODEL + LAYOUTS[name] + [
        f"train.steps={steps}", "train.global_batch=8", "train.lr=1e-3", "run.trace_steps=0", f"run.dir={workdir}",
        "resources.step_timeout_s=600"])
    result = train(cfg, stream=open(os.devnull, "w"))
    peaks = {int(rank): float(mb) for rank, mb in result.metrics[-1]["peak_mem_mb"].items()}
    return {"name": name, "samples_per_s": result.samples_per_s, "peaks": [peaks[r] for r in sorted(peaks)],
            "params": checkpoint.load_state_dict(result.checkpoint)}


def state_mb_per_worker(name: str) -> list[float]:
    """Bytes of parameters, gradients and AdamW state each worker owns, by the layout's own cut."""
    from raytrain.config import load_config
    from raytrain.driver.prepare import prepare

    cfg = load_config(None, MODEL + LAYOUTS[name] + ["train.global_batch=8", f"run.dir={tempfile.gettempdir()}"])
    layout = prepare(cfg).layout
    counts = _layer_params(cfg)
    workers = [sum(counts[i] for chunk in layout.worker_chunks(s) for i in chunk) for s in range(layout.pp)]
    per_stage = [STATE_BYTES_PER_PARAM * n / layout.fsdp / 2**20 for n in workers]  # a worker's chunks
    return [per_stage[s] for _ in range(layout.dp) for _ in range(layout.fsdp) for s in range(layout.pp)]


def estimate_mb(name: str) -> float:
    """The memory check's estimate for the layout's fullest worker, in MB."""
    from raytrain.config import load_config
    from raytrain.driver.memory import layout_memory
    from raytrain.driver.prepare import prepare

    cfg = load_config(None, MODEL + LAYOUTS[name] + ["train.global_batch=8", f"run.dir={tempfile.gettempdir()}"])
    prepared = prepare(cfg)
    return layout_memory(prepared.cfg, prepared.layout, list(prepared.model.layer_params)).total / 2**20


def _layer_params(cfg) -> list[int]:
    import torch

    from raytrain.models.layers import build_model

    with torch.device("meta"):
        layers = build_model(cfg.model, cfg.train.seed).layers
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)) for k in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS)[:4], choices=list(LAYOUTS))
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.repeats):
            for name in args.layouts:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                runs.setdefault(name, []).append(run_layout(name, args.steps, workdir))
    ray.shutdown()
    report(runs, args.layouts)


def report(runs: dict[str, list[dict]], names: list[str]) -> None:
    median = {name: sorted(rs, key=lambda r: r["samples_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    base = median.get("dp=2", median[names[0]])
    print(f"\n{'layout':<15} {'state MB/worker':>16} {'peak MB per worker':>26} {'largest':>8} {'vs dp=2':>8} "
          f"{'samples/s':>10} {'vs dp=2':>8} {'params vs dp=2':>15} {'estimate MB':>12} {'/peak':>6}")
    for name in names:
        r = median[name]
        state = " / ".join(f"{mb:.0f}" for mb in sorted(set(state_mb_per_worker(name)), reverse=True))
        peaks = " / ".join(f"{mb:.0f}" for mb in r["peaks"])
        estimate = estimate_mb(name)
        print(f"{name:<15} {state:>16} {peaks:>26} {max(r['peaks']):>8.0f} "
              f"{max(r['peaks']) / max(base['peaks']):>7.2f}x {r['samples_per_s']:>10.2f} "
              f"{r['samples_per_s'] / base['samples_per_s']:>7.2f}x {relative_difference(r['params'], base['params']):>15.1e} "
              f"{estimate:>12.0f} {estimate / max(r['peaks']):>5.2f}x")
    for name in names:
        rates = " / ".join(f"{r['samples_per_s']:.2f}" for r in runs[name])
        largest = " / ".join(f"{max(r['peaks']):.0f}" for r in runs[name])
        print(f"{name}: samples/s {rates}; largest worker MB {largest}")


if __name__ == "__main__":
    main()
