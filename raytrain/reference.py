"""The plain single-process reference: same model, data order, loss and optimizer, no Ray.

The equivalence tests and benchmarks compare every layout against this (DESIGN invariant 2).
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain import data
from raytrain.config import Config
from raytrain.model import build_model


def train_reference(cfg: Config, steps: int | None = None) -> tuple[nn.Sequential, list[float]]:
    """Train ``steps`` (default train.steps) full-batch steps in this process; returns model and losses."""
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*spec.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    path = data.resolve_data_path(cfg)
    dataset = data.TokenDataset(path, cfg.data.column, cfg.model.seq_len)
    B = cfg.train.global_batch
    losses = []
    for step in range(cfg.train.steps if steps is None else steps):
        x, y = dataset.batch(data.sample_ids(cfg.train.seed, len(dataset), step * B, (step + 1) * B))
        optimizer.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return model, losses
