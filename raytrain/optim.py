"""The optimizer every layout and the single-process reference use, so layouts share the same math."""

from __future__ import annotations

from typing import Iterable

import torch

from raytrain.config import TrainConfig


def make_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay,
                             fused=True if train.fused_optimizer else None)
