"""The optimizer every layout and the single-process reference use, and how a step is applied (at
its learning rate, raytrain.optim.lr_schedule), so that layouts share the same math."""

from __future__ import annotations

from typing import Iterable

import torch

from raytrain.config import TrainConfig
from raytrain.optim.lr_schedule import learning_rate


def make_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, eps=train.adam_eps,
                             fused=True if train.fused_optimizer else None)


def apply_step(optimizer: torch.optim.Optimizer, train: TrainConfig, step: int) -> None:
    """Apply the update of 0-based ``step`` at that step's learning rate."""
    lr = learning_rate(train, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
