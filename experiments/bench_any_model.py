"""Any model on any data: raytrain against the code a user would write, on two workloads.

- ``mlp``: the design documents' MLP (Linear(64, 100), ReLU, Linear(100, 10)) on the built-in digits
  (1797 rows of 64 floats), global batch 64;
- ``resnet``: the small ResNet of experiments/examples/resnet.py (GroupNorm, 4 blocks of 16 channels) on
  16 x 16 PNG images (experiments/examples/shapes.py, 2048 rows), decoded, cropped and flipped per sample,
  global batch 32.

Systems, each with 2 gloo workers of 1 torch thread, the same model, data, global batch, AdamW and steps:

- ``torchrun``: torchrun + DistributedDataParallel + a DataLoader with a DistributedSampler (the samples
  read in ``__getitem__``, the PNGs decoded there, no loader worker processes: 2 cores);
- ``ray-train``: Ray Train V2's TorchTrainer with ``prepare_model`` and ``prepare_data_loader`` over the
  same DataLoader;
- ``raytrain``: ``python -m raytrain``'s ``train`` with the rows read from Parquet (data.inputs, and for the
  images data.transform).

Steady samples/s counts the steps after the warm-up; "data" is the share of a worker's step spent reading
(and decoding, transforming) its samples: raytrain's ``data_s`` / ``worker_step_s``, the others' time
waiting on the DataLoader.

    python experiments/bench_any_model.py --workload mlp --steps 300
    python experiments/bench_any_model.py --workload resnet --steps 60 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # experiments.examples

SYSTEMS = ["torchrun", "ray-train", "raytrain"]
WORKLOADS = {
    "mlp": {"batch": 64, "lr": 3e-3, "factory": "experiments.examples.mlp:classifier", "options": {}},
    "resnet": {"batch": 32, "lr": 3e-3, "factory": "experiments.examples.resnet:resnet",
               "options": {"norm": "group", "blocks": 4, "channels": 16}},
}
WARMUP = 10
SHAPES_ROWS = 2048


# --- the data and model every system uses -------------------------------------------------------------


def shapes_path(workdir: str) -> str:
    return os.path.join(workdir, "shapes.parquet")


def make_dataset(workload: str, workdir: str):
    """A map-style torch Dataset of the workload's rows, as a torchrun or Ray Train user writes it."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    if workload == "mlp":
        from raytrain.data.corpus import DIGITS_PATH

        table = pq.read_table(DIGITS_PATH)
        x = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype(np.float32)
        y = table.column("digit").to_numpy()
        return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    from experiments.examples.shapes import decode

    table = pq.read_table(shapes_path(workdir))
    images, labels = table.column("image").to_pylist(), table.column("label").to_numpy()

    class Shapes(torch.utils.data.Dataset):
        def __len__(self):
            return len(labels)

        def __getitem__(self, i):  # decoded and augmented per sample, as a torchvision transform would
            x, y = decode({"image": [images[i]], "label": labels[i:i + 1]}, np.array([i], dtype=np.uint64), True)
            return torch.from_numpy(x[0]), int(y[0])

    return Shapes()


def make_model(workload: str):
    import importlib

    from raytrain.config import ModelConfig

    spec = WORKLOADS[workload]
    module, _, name = spec["factory"].partition(":")
    built = getattr(importlib.import_module(module), name)(ModelConfig(factory=spec["factory"], options=spec["options"]))
    import torch

    return torch.nn.Sequential(*built)


def loop(model, loader, sampler, steps: int, lr: float, rank: int, out: str) -> None:
    """The training loop a user writes: AdamW, cross entropy, a new epoch when the loader runs out."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ends, waits, epoch = [], [], 0
    batches = iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            x, y = next(batches)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ends.append(time.time())
        waits.append((t1 - t0, time.perf_counter() - t0))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_end": ends, "data_share": sum(w for w, _ in waits[WARMUP:]) / sum(s for _, s in waits[WARMUP:])}, f)


# --- the systems ----------------------------------------------------------------------------------------


def run_torchrun(workload: str, steps: int, out: str, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(make_model(workload))
    dataset = make_dataset(workload, workdir)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=WORKLOADS[workload]["batch"] // world, sampler=sampler, drop_last=True)
    loop(model, loader, sampler, steps, WORKLOADS[workload]["lr"], rank, out)
    dist.destroy_process_group()


def run_ray_train(workload: str, steps: int, out: str, workdir: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    def train_loop(config):
        import torch
        import ray.train.torch as rtt
        from torch.utils.data import DataLoader

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = rtt.prepare_model(make_model(workload))
        world = ray.train.get_context().get_world_size()
        dataset = make_dataset(workload, workdir)
        loader = rtt.prepare_data_loader(DataLoader(dataset, batch_size=WORKLOADS[workload]["batch"] // world,
                                                    shuffle=True, drop_last=True))
        loop(model, loader, loader.sampler, steps, WORKLOADS[workload]["lr"], ray.train.get_context().get_world_rank(),
             out)

    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=workdir, name="ray-train-any-model")).fit()
    ray.shutdown()


def run_raytrain(workload: str, steps: int, out: str, workdir: str) -> None:
    import ray

    from raytrain import load_config, train

    spec = WORKLOADS[workload]
    data = (["data.builtin=digits"] if workload == "mlp" else
            [f"data.path={shapes_path(workdir)}", "data.inputs=image", "data.targets=label",
             "data.transform=experiments.examples.shapes:decode"])
    options = "{" + ", ".join(f"{k}: {v}" for k, v in spec["options"].items()) + "}"
    cfg = load_config(None, [f"model.factory={spec['factory']}", f"model.options={options}", *data,
                             f"train.steps={steps}", f"train.global_batch={spec['batch']}", f"train.lr={spec['lr']}",
                             "train.grad_clip=0", "parallel.dp=2", "run.trace_steps=0", f"run.dir={workdir}/runs"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = train(cfg, stream=open(os.devnull, "w")).metrics
    steady = rows[WARMUP:]
    with open(out, "w") as f:
        json.dump({"step_end": [r["time"] for r in rows],
                   "data_share": sum(r["data_s"] for r in steady) / sum(r["worker_step_s"] for r in steady)}, f)
    ray.shutdown()


VARIANTS = {"torchrun": run_torchrun, "ray-train": run_ray_train, "raytrain": run_raytrain}


def launch(system: str, workload: str, steps: int, workdir: str) -> dict:
    out = os.path.join(workdir, f"{system}.json")
    script = [os.path.abspath(__file__), "--variant", system, "--workload", workload, "--steps", str(steps),
              "--out", out, "--workdir", workdir]
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541"]
    cmd = [sys.executable, *(launcher if system == "torchrun" else []), *script]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    ends, batch = res["step_end"], WORKLOADS[workload]["batch"]
    return {"system": system, "samples_per_s": (len(ends) - 1 - WARMUP) * batch / (ends[-1] - ends[WARMUP]),
            "data_share": res["data_share"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1, help="runs per system, interleaved; the median is shown")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        VARIANTS[args.variant](args.workload, args.steps, args.out, args.workdir)
        return
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        from experiments.examples.shapes import write_shapes

        write_shapes(shapes_path(workdir), SHAPES_ROWS)
        for _ in range(args.repeats):  # interleaved, so a slow minute on this shared machine hits them all
            for system in args.only.split(","):
                print(f"running {system} ({args.workload}) ...", file=sys.stderr, flush=True)
                runs.setdefault(system, []).append(launch(system, args.workload, args.steps, workdir))
    rows = [sorted(rs, key=lambda r: r["samples_per_s"])[len(rs) // 2] for rs in runs.values()]
    ref = next((r for r in rows if r["system"] == "torchrun"), None)
    print(f"\n{args.workload}, {args.steps} steps, global batch {WORKLOADS[args.workload]['batch']}, 2 workers, "
          f"median of {args.repeats}")
    print(f"{'system':<12} {'samples/s':>10} {'vs torchrun':>12} {'data share of a step':>22}")
    for r in rows:
        vs = f"{r['samples_per_s'] / ref['samples_per_s']:.3f}x" if ref else "-"
        print(f"{r['system']:<12} {r['samples_per_s']:>10.1f} {vs:>12} {r['data_share']:>21.1%}")
    if args.repeats > 1:
        for system, rs in runs.items():
            print(f"{system}: samples/s " + " / ".join(f"{r['samples_per_s']:.1f}" for r in rs))


if __name__ == "__main__":
    main()
