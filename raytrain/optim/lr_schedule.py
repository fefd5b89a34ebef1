"""The learning rate of each step: warm-up, then constant or a cosine / linear decay.

A function of the step being applied alone: not of the layout, of the replicas alive or of where a
run was resumed, so a schedule is the same in every layout, across resizes and across a resume.
No torch here: the coordinator reports each step's rate without importing it.
"""

from __future__ import annotations

import math

from raytrain.config import TrainConfig


def learning_rate(train: TrainConfig, step: int) -> float:
    """The learning rate of 0-based ``step``: a linear warm-up over train.warmup_steps to train.lr,
    then train.lr_schedule (constant, or cosine / linear decay to train.min_lr at train.steps)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    if train.lr_schedule == "cosine":
        return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    return train.lr - (train.lr - train.min_lr) * progress
