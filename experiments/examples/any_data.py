"""The Python API on data objects: the design documents' MLP trained on the built-in digits given as a torch
Dataset, then as a Ray Dataset whose ``map_batches`` preprocessing (scaling the pixels) runs on Ray's CPU
workers. Both are read in the same sample order as the Parquet file, so all three end at one set of
parameters (the script checks it).

    python experiments/examples/any_data.py [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow.parquet as pq
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)  # experiments.examples, from anywhere: here, and in the workers of the Ray raytrain starts
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

import raytrain  # noqa: E402
from experiments.examples.mlp import classifier  # noqa: E402
from raytrain.data.corpus import DIGITS_PATH  # noqa: E402


class Digits(torch.utils.data.Dataset):
    """Sample i: (64 pixels in [0, 1], the digit)."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    import ray

    table = pq.read_table(DIGITS_PATH)
    x = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype(np.float32)
    y = table.column("digit").to_numpy()
    overrides = [f"train.steps={args.steps}", "train.global_batch=64", "train.lr=3e-3", "parallel.dp=2",
                 "data.eval_fraction=0.2", f"eval.every={args.steps}", "eval.batches=5", "eval.metrics=[accuracy]",
                 "run.trace_steps=0"]
    from_parquet = raytrain.train(raytrain.load_config(None, [*overrides, "data.builtin=digits",
                                                               "model.factory=experiments.examples.mlp:classifier"]))
    from_torch = raytrain.train(raytrain.load_config(None, overrides), dataset=Digits(x, y), model=classifier)
    raw = ray.data.from_items([{"pixels": x[i] * 16, "digit": y[i]} for i in range(len(y))])  # the 0..16 counts
    scaled = raw.map_batches(lambda batch: {**batch, "pixels": batch["pixels"] / 16}, batch_size=256)
    from_ray = raytrain.train(raytrain.load_config(None, [*overrides, "data.inputs=pixels", "data.targets=digit"]),
                              dataset=scaled, model=classifier)
    states = [raytrain.checkpoint.load_state_dict(r.checkpoint) for r in (from_parquet, from_torch, from_ray)]
    for name, result in zip(("Parquet", "torch Dataset", "Ray Dataset"), (from_parquet, from_torch, from_ray)):
        print(f"{name:>13}: held-out accuracy {result.eval_metrics['eval_accuracy']:.3f}, loss {result.final_loss:.4f}")
    same = all(torch.equal(states[0][k], other[k]) for other in states[1:] for k in states[0])
    print("the same parameters from all three:", same)


if __name__ == "__main__":
    main()
