"""One NVIDIA GPU: tokens/s, model FLOPs utilisation and peak device memory of raytrain at dp=1 against
a plain torch loop over the same layers in the same script, for the built-in GPT and a Llama-shaped
~1B Hugging Face model, bf16 autocast, activation checkpointing off and on, and train.compile off and
on (the built-in GPT; the baseline compiles its layers the same way); beside each raytrain peak, the
memory check's estimate for the run (raytrain.driver.memory.layout_memory: the figure a refusal rests on)
and its ratio to the peak.

Each case trains ``--steps`` steps; the first two are warm-up and not timed. raytrain's figure is the
run's samples/s times model.seq_len (its metrics rows, one Ray worker on the GPU); the baseline runs
``raytrain.models.layers.full_model`` with AdamW in this process. MFU = (6 x parameters + 12 x layers x
width x seq_len) FLOPs per token x tokens/s over the GPU's dense bf16 peak (``--peak-tflops``; H100 and
H200: 989). Without CUDA it says so and exits 0.

    python experiments/bench_gpu.py                  # about 5 minutes on an H200
    python experiments/bench_gpu.py --models gpt --steps 10
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 125.0}
MODELS = {
    "gpt": ["model.n_layer=16", "model.d_model=2048", "model.n_head=16", "model.seq_len=1024",
            "model.vocab_size=32000"],
    "llama-1b": ["model.seq_len=1024"],  # plus model.hf: a LlamaConfig of 16 x 2048 (5632 MLP), 32000 vocab
}


def llama_dir(root: str) -> str:
    """A ~1.1B Llama config (random weights, no download) saved where model.hf can read it."""
    from transformers import LlamaConfig

    path = os.path.join(root, "llama-1b")
    LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
                tie_word_embeddings=False).save_pretrained(path)
    return path


def config(name: str, recompute: bool, compiled: bool, batch: int, steps: int, root: str):
    from raytrain.config import load_config

    extra = [f"model.hf={llama_dir(root)}"] if name == "llama-1b" else []
    return load_config(None, MODELS[name] + extra + [
        f"train.steps={steps}", f"train.global_batch={batch}", f"train.activation_checkpointing={str(recompute).lower()}",
        f"train.compile={str(compiled).lower()}",
        "resources.use_gpu=true", "resources.bf16=true", "run.trace_steps=0", f"run.dir={root}",
        "checkpoint.every=0", f"checkpoint.dir={os.path.join(root, 'ckpt', name, str(recompute))}"])


def flops_per_token(model, cfg) -> float:
    params = sum(p.numel() for p in model.parameters())
    layers = len(model) - 2  # embedding and head around the blocks
    width = next(p for p in model.parameters() if p.dim() == 2).shape[1]
    return 6 * params + 12 * layers * width * cfg.model.seq_len


def plain_torch(cfg, steps: int) -> tuple[float, float, float]:
    """(tokens/s, peak GiB, FLOPs per token) of the same layers in this process."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from raytrain.models.layers import full_model

    torch.cuda.reset_peak_memory_stats()
    model = full_model(cfg.model, cfg.train.seed).cuda()
    if cfg.train.compile:
        for layer in model:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True)
    B, T = cfg.train.global_batch, cfg.model.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (B, T + 1), device="cuda")
    recompute = cfg.train.activation_checkpointing
    started = None
    for step in range(steps):
        if step == 2:
            torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = tokens[:, :-1]
            for i, layer in enumerate(model):
                inner = 0 < i < len(model) - 1
                x = checkpoint(layer, x, use_reentrant=False) if recompute and inner else layer(x)
            loss = F.cross_entropy(x.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    rate = B * T * (steps - 2) / (time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30
    fpt = flops_per_token(model, cfg)
    del model, optimizer
    torch.cuda.empty_cache()
    return rate, peak, fpt


def raytrain_run(cfg) -> tuple[float, float, float]:
    """(tokens/s of the steps after the first two, peak GiB, the memory check's estimate in GiB) of a
    raytrain run at dp=1."""
    from raytrain import train
    from raytrain.driver.memory import layout_memory
    from raytrain.driver.prepare import prepare

    prepared = prepare(cfg)
    estimate = layout_memory(prepared.cfg, prepared.layout, list(prepared.model.layer_params)).total / 2**30
    result = train(cfg, stream=open(os.devnull, "w"))
    timed = result.metrics[2:]
    rate = cfg.train.global_batch * cfg.model.seq_len * len(timed) / sum(r["step_s"] for r in timed)
    return rate, max(float(mb) for mb in result.metrics[-1]["peak_mem_mb"].values()) / 1024, estimate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (run it on a machine with an NVIDIA GPU)")
        return 0
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        print(f"bench_gpu: unknown peak for {name}: pass --peak-tflops", file=sys.stderr)
        return 2
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    print(f"{name}, bf16 peak {peak:.0f} TFLOPs, torch {torch.__version__}, batch {args.batch}, {args.steps} steps")
    print(f"{'model':<9} {'recompute':>9} {'compile':>7} {'torch tok/s':>12} {'MFU':>6} {'GiB':>6} "
          f"{'raytrain tok/s':>15} {'MFU':>6} {'GiB':>6} {'ratio':>6} {'estimate':>8} {'/peak':>6}")
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            # (recompute, compile): compiled on the built-in GPT only, to stay within 8 minutes
            for recompute, compiled in [(False, False), (True, False)] + [(False, True)] * (model == "gpt"):
                cfg = config(model, recompute, compiled, args.batch, args.steps, root)
                base, base_gib, fpt = plain_torch(cfg, args.steps)
                ours, ours_gib, estimate = raytrain_run(cfg)
                mfu = lambda rate: rate * fpt / (peak * 1e12)  # noqa: E731
                print(f"{model:<9} {str(recompute):>9} {str(compiled):>7} {base:>12.0f} {mfu(base):>6.1%} "
                      f"{base_gib:>6.1f} {ours:>15.0f} {mfu(ours):>6.1%} {ours_gib:>6.1f} {ours / base:>5.2f}x "
                      f"{estimate:>8.1f} {estimate / ours_gib:>5.2f}x", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
