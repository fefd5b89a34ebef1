"""Scale: a built-in GPT under fsdp=4, its checkpoint saved synchronously and in the background, and
resumed into another layout (fsdp=2 x pp=2), with each worker's peak memory while training, saving and loading.

Three raytrain runs in one embedded Ray of 4 CPU slots, one torch thread per worker:

1. ``checkpoint.async_save=false``: ``--steps`` steps, a checkpoint after step 2 and at the end;
2. the same with ``checkpoint.async_save=true`` (step 2's save is written while step 3 runs);
3. a resume of run 1's step-2 checkpoint into another layout (``--resume-layout``; fsdp=2 x pp=2 unless
   given), for one step.

Printed: samples/s of the steps after the first, each worker's peak resident memory (ru_maxrss, so a
step's figure includes everything before it) after step 2 (training), after step 3 (training and the
save after step 2) and after the resumed step (loading and one step), the save's wall time and how long
it stalled training (synchronous: the whole save; background: the snapshot, and any wait for the write),
and step 3's time against step 4's; beside the training peak, the memory check's estimate for the layout
(raytrain.driver.memory.layout_memory, the figure a refusal rests on) and its ratio to the largest peak.
The final parameters of runs 1 and 2 are compared (the same math).

    python experiments/bench_scale.py --n-layer 8 --d-model 1024        # 0.1B parameters, 1.6 GB of state
    python experiments/bench_scale.py --n-layer 15 --d-model 2048 --skip-async   # 0.75B: 12 GB (alone on the machine)
    python experiments/bench_scale.py --n-layer 20 --d-model 2048 --skip-async --steps 3 \
        --resume-layout parallel.pp=4    # 1.0B: 16 GB; fsdp=2 x pp=2 does not fit 24 GB at this size

Each run's figures are printed as soon as it ends.

Run it alone: it holds the state of the whole model (16 bytes per parameter) across the workers, and the
background save adds a host copy of each worker's parameters and moments (12 bytes per parameter).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def model_args(args) -> list[str]:
    return [f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}", f"model.n_head={args.n_head}",
            f"model.seq_len={args.seq_len}", "model.vocab_size=256"]


def estimate_gib(cfg) -> float:
    """The memory check's estimate for the fullest worker of ``cfg``'s layout, in GiB."""
    from raytrain.driver.memory import layout_memory
    from raytrain.driver.prepare import prepare

    prepared = prepare(cfg)
    return layout_memory(prepared.cfg, prepared.layout, list(prepared.model.layer_params)).total / 2**30


def run(args, workdir: str, name: str, layout: list[str], extra: list[str]) -> dict:
    from raytrain import train
    from raytrain.config import load_config

    cfg = load_config(None, model_args(args) + layout + extra + [
        "train.global_batch=8", "train.lr=1e-4", "run.trace_steps=0", f"run.dir={workdir}", f"run.name={name}",
        "checkpoint.every=2", "checkpoint.keep=5", f"checkpoint.dir={os.path.join(workdir, name, 'ckpt')}",
        "resources.step_timeout_s=1800", "resources.check_memory=false"])
    print(f"running {name} ...", file=sys.stderr, flush=True)
    estimate = estimate_gib(cfg)  # before the run: its checkpoints would make prepare refuse a second look
    return {"result": train(cfg, stream=open(os.devnull, "w")), "cfg": cfg, "estimate": estimate}


def peaks(row: dict) -> str:
    return " / ".join(f"{float(mb) / 1024:.2f}" for _, mb in sorted(row["peak_mem_mb"].items(), key=lambda kv: int(kv[0])))


def describe(name: str, r: dict) -> None:
    result = r["result"]
    rows = {m["step"]: m for m in result.metrics}
    steady = [m for m in result.metrics if m["step"] > 1]
    rate = sum(r["cfg"].train.global_batch for _ in steady) / sum(m["step_s"] for m in steady)
    saves = [e for e in result.events if e["event"] == "checkpoint"]
    largest = max(float(mb) for mb in rows[2]["peak_mem_mb"].values()) / 1024
    estimate = r["estimate"]
    print(f"\n{name}: {rate:.2f} samples/s (steps 2..); peak GiB per worker after step 2 (training) {peaks(rows[2])}; "
          f"estimate {estimate:.2f} GiB ({estimate / largest:.2f}x the largest)")
    if 3 in rows:
        after = f", step 4 {rows[4]['step_s']:.2f} s" if 4 in rows else ""
        print(f"  after step 3 (and the save after step 2): {peaks(rows[3])}; step 3 {rows[3]['step_s']:.2f} s{after}")
    for e in saves:
        print(f"  checkpoint of step {e['step']}: {e['seconds']:.2f} s wall, training stalled {e['stall_s']:.2f} s"
              f"{' (background)' if e['async'] else ''}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-async", action="store_true", help="no background-save run (it needs 12 B/param more)")
    parser.add_argument("--resume-layout", default="parallel.fsdp=2,parallel.pp=2,parallel.microbatches=2",
                        help="the layout the step-2 checkpoint resumes into, comma-separated overrides")
    args = parser.parse_args()
    import ray
    import torch

    from raytrain import checkpoint

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    fsdp4 = ["parallel.fsdp=4"]
    with tempfile.TemporaryDirectory() as workdir:
        runs = {"fsdp=4, synchronous save": run(args, workdir, "sync", fsdp4, [f"train.steps={args.steps}"])}
        describe("fsdp=4, synchronous save", runs["fsdp=4, synchronous save"])
        if not args.skip_async:
            runs["fsdp=4, background save"] = run(args, workdir, "async", fsdp4,
                                                  [f"train.steps={args.steps}", "checkpoint.async_save=true"])
            describe("fsdp=4, background save", runs["fsdp=4, background save"])
        step2 = checkpoint.step_dir(os.path.join(workdir, "sync", "ckpt"), 2)
        params = sum(t.numel() for t in checkpoint.load_state_dict(step2).values())
        print(f"\nmodel: {params / 1e9:.3f}B parameters, {16 * params / 2**30:.1f} GiB of fp32 state "
              f"(fsdp=4: {16 * params / 4 / 2**30:.2f} GiB per worker)", flush=True)
        layout = args.resume_layout.split(",")
        resumed = run(args, workdir, "resumed", layout, ["train.steps=3", f"checkpoint.resume={step2}"])
        row = resumed["result"].metrics[0]
        print(f"\nresumed {' '.join(layout)} from step 2: step {row['step']} loss {row['loss']:.4f}; peak GiB per "
              f"worker (loading and one step) {peaks(row)}")
        if not args.skip_async:
            a, b = (checkpoint.load_state_dict(r["result"].checkpoint) for r in runs.values())
            same = all(torch.equal(a[k], b[k]) for k in a)
            print(f"final parameters, synchronous vs background save: {'identical' if same else 'DIFFERENT'}")
    ray.shutdown()


if __name__ == "__main__":
    main()
