"""A step's world-wide vote: whether every worker may apply it, and whether it is the boundary where
workers told to leave go (raytrain.worker.stage's commit protocol).

Two ways to cast it, with the same outcome: a collective of its own over the whole generation, or, in a
purely data-parallel generation, two values summed with the gradients' first bucket
(raytrain.worker.gradsync: a collective fewer in every step).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from raytrain.reports import StepReport


def step_vote(grads, report: StepReport, leaving: Callable[[], bool], device: torch.device) -> tuple[bool, bool]:
    """(finite everywhere, some worker leaves) once ``grads`` are reduced and clipped; ``leaving()``: whether
    this worker leaves. Where the gradients carried the vote (``grads.carries_vote``) every worker holds the
    same reduced gradients and the same summed values, so each one's verdict is everyone's; else ``world_vote``."""
    if not grads.carries_vote:
        return world_vote(share_finite(report, grads), leaving(), device)
    losses_finite, leaves = grads.vote_result()
    return losses_finite and share_finite(report, grads), leaves


def share_finite(report: StepReport, grads) -> bool:
    """Whether this worker's share of the step (its loss, its gradients) is finite."""
    if report.loss_sum is not None and not math.isfinite(report.loss_sum):
        return False
    if report.grad_norm is not None:  # the global norm: every worker sees the same value
        return math.isfinite(report.grad_norm)
    return bool(torch.isfinite(grads.squared_norm()))


def world_vote(finite: bool, leaving: bool, device: torch.device) -> tuple[bool, bool]:
    """The step's vote as a collective of its own: its completion says everyone reduced and clipped, so
    everyone may step. Its values: the count of non-finite workers, which stops the step everywhere if a
    loss or gradient anywhere is NaN or inf; and the count of workers told to leave (in a step that does
    not hold them), which makes this step's end the boundary where they go (every worker learns it in the
    same collective, so all of them skip a step the coordinator sent ahead alike). Returns (finite
    everywhere, someone leaves)."""
    counts = torch.tensor([0.0 if finite else 1.0, 1.0 if leaving else 0.0], device=device)
    dist.all_reduce(counts)
    return not bool(counts[0] > 0), bool(counts[1] > 0)
