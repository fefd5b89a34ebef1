"""Tensor parallelism against the other two-worker layouts and against the torchrun script a user would write.

The 57M-parameter GPT of bench_memory (8 blocks, d_model 768, 12 heads, seq 64, vocab 256), global
batch 8, on two workers of one torch thread each: raytrain under tp=2, dp=2 and fsdp=2 (each a fresh
run in one embedded Ray of 4 CPU slots), and a plain torchrun script (``--peer``, launched here with
``python -m torch.distributed.run --nproc-per-node 2``, gloo) that builds the same model, applies the
same ``parallelize_module`` plan to each block (attention q/k/v and the MLP's up projection colwise,
the out projections rowwise, everything else replicated) and steps AdamW on random tokens. The
peer splits the fused qkv projection contiguously, as a plain ``ColwiseParallel`` does (raytrain
splits it per head): the same shapes and arithmetic cost, another grouping of the heads, so it is a
peer in speed and memory, not in values. raytrain also splits the head and the token table by
vocabulary (the loss in ``loss_parallel``); the peer keeps them whole, which at this vocabulary of 256
is 0.7% of the parameters. "tp=2 sp" adds sequence parallelism (parallel.sequence_parallel). Runs are interleaved
over ``--repeats`` rounds; the median is shown. Prints samples/s (steps after the first two) and the
peak resident memory of each worker, with ratios against raytrain's tp=2.

    python experiments/bench_tp.py                 # about 8 minutes on 2 cores
    python experiments/bench_tp.py --seq-len 256   # longer samples: activations grow, sequence parallelism splits more
    python experiments/bench_tp.py --repeats 1 --steps 6

``--vocab N`` measures the split by vocabulary instead: tp=2 on the same blocks with a vocabulary of N
(tp divides it: the head and its logits split, the loss in ``loss_parallel``, the token table split)
against N + 1 (tp does not divide it: head and table stay whole on both ranks), the peer and the other
layouts left out.

    python experiments/bench_tp.py --vocab 65536 --repeats 1 --steps 5

``--moe`` measures a Hugging Face mixture of experts instead (a Mixtral of 4 layers, hidden 512, 8 experts
of width 1024, 2 per token: 54M parameters, 94% of them in experts, random weights saved to a temporary
directory): tp=2 splits every expert (transformers' moe_tp_experts plan) as well as attention, against dp=2
and fsdp=2, the peer left out.

    python experiments/bench_tp.py --moe --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

SEQ_LEN = 64
MODEL = ["model.n_layer=8", "model.d_model=768", "model.n_head=12", f"model.seq_len={SEQ_LEN}", "model.vocab_size=256"]
BATCH = 8
LAYOUTS = {
    "tp=2": ["parallel.tp=2", "resources.placement_strategy=STRICT_PACK"],
    "tp=2 sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "resources.placement_strategy=STRICT_PACK"],
    "dp=2": ["parallel.dp=2"],
    "fsdp=2": ["parallel.fsdp=2"],
}
PEER = "torchrun tp=2"
WARM_UP_STEPS = 2
"""Steps not timed on the peer (raytrain's Result leaves out its first step, which pays for warm-up)."""


MOE = {"vocab_size": 256, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
       "tie_word_embeddings": False}


def write_moe(workdir: str, seq_len: int) -> str:
    """The Mixtral of ``--moe``, randomly initialised, saved as a Hugging Face directory: its path."""
    import transformers

    path = os.path.join(workdir, "mixtral")
    config = transformers.MixtralConfig(**MOE, max_position_embeddings=seq_len)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def vocab_layouts(vocab: int) -> dict[str, list[str]]:
    """tp=2 with the head and token table split by vocabulary (``vocab``), and whole (``vocab`` + 1, which tp=2
    does not divide)."""
    return {"tp=2": [*LAYOUTS["tp=2"], f"model.vocab_size={vocab}"],
            "tp=2, whole by vocabulary": [*LAYOUTS["tp=2"], f"model.vocab_size={vocab + 1}"]}


def run_layout(name: str, overrides: list[str], steps: int, workdir: str) -> dict:
    from raytrain import train
    from raytrain.config import load_config

    cfg = load_config(None, MODEL + overrides + [
        f"train.steps={steps}", f"train.global_batch={BATCH}", "train.lr=1e-3", "run.trace_steps=0",
        f"run.dir={workdir}", "checkpoint.every=0", "resources.step_timeout_s=600"])
    result = train(cfg, stream=open(os.devnull, "w"))
    peaks = {int(rank): float(mb) for rank, mb in result.metrics[-1]["peak_mem_mb"].items()}
    return {"name": name, "samples_per_s": result.samples_per_s, "peaks": [peaks[r] for r in sorted(peaks)]}


def run_peer(steps: int) -> dict:
    """The torchrun script on two local processes; its rank 0 prints one JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seq_len = next(item for item in MODEL if item.startswith("model.seq_len=")).split("=")[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          __file__, "--peer", "--steps", str(steps), "--seq-len", seq_len],
                         capture_output=True, text=True, timeout=1800, env=env, check=True)
    return {"name": PEER, **json.loads(out.stdout.strip().splitlines()[-1])}


def peer_main(steps: int) -> None:
    """What a torchrun user writes: the model, the plan on each block, AdamW, a timed loop."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from raytrain.config import load_config
    from raytrain.models.layers import Block, build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    cfg = load_config(None, MODEL)
    model = torch.nn.Sequential(*build_model(cfg.model, seed=0).layers)
    for block in (m for m in model if isinstance(m, Block)):
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "fc": ColwiseParallel(), "out": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)  # every rank draws the same tokens: a tp group reads one batch
    timed = 0.0
    for step in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len + 1), generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= WARM_UP_STEPS:
            timed += time.perf_counter() - started
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    peaks = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        print(json.dumps({"samples_per_s": BATCH * (steps - WARM_UP_STEPS) / timed,
                          "peaks": [float(p) for p in peaks]}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peer", action="store_true", help="run as one process of the torchrun script")
    parser.add_argument("--vocab", type=int, help="tp=2 with head and table split by this vocabulary against whole")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sample (default {SEQ_LEN}): activations grow with it")
    parser.add_argument("--moe", action="store_true", help="a Hugging Face Mixtral, its experts split by tp")
    args = parser.parse_args()
    if args.seq_len is not None:
        MODEL[MODEL.index(f"model.seq_len={SEQ_LEN}")] = f"model.seq_len={args.seq_len}"
    if args.peer:
        peer_main(args.steps)
        return
    if args.steps <= WARM_UP_STEPS:
        parser.error(f"--steps must exceed the {WARM_UP_STEPS} warm-up steps")
    if args.vocab is not None and (args.vocab < 256 or args.vocab % 2):
        parser.error("--vocab must be even (tp=2 divides it) and at least 256 (the built-in corpus's bytes)")
    layouts = vocab_layouts(args.vocab) if args.vocab else LAYOUTS if args.moe else {**LAYOUTS, PEER: []}
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        if args.moe:
            seq_len = args.seq_len or SEQ_LEN
            MODEL[:] = [f"model.hf={write_moe(workdir, seq_len)}", f"model.seq_len={seq_len}"]
        for _ in range(args.repeats):
            for name, overrides in layouts.items():
                print(f"running {name} ...", file=sys.stderr, flush=True)
                run = run_peer(args.steps) if name == PEER else run_layout(name, overrides, args.steps, workdir)
                runs.setdefault(name, []).append(run)
    ray.shutdown()
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    median = {name: sorted(rs, key=lambda r: r["samples_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    base = median["tp=2"]
    print(f"\n{'layout':<15} {'samples/s':>10} {'vs tp=2':>8} {'peak MB per worker':>20} {'largest vs tp=2':>16}")
    for name, r in median.items():
        peaks = " / ".join(f"{mb:.0f}" for mb in r["peaks"])
        print(f"{name:<15} {r['samples_per_s']:>10.2f} {r['samples_per_s'] / base['samples_per_s']:>7.2f}x "
              f"{peaks:>20} {max(r['peaks']) / max(base['peaks']):>15.2f}x")
    for name, rs in runs.items():
        rates = " / ".join(f"{r['samples_per_s']:.2f}" for r in rs)
        print(f"{name}: samples/s {rates}")


if __name__ == "__main__":
    main()
