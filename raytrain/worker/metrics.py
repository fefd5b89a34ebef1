"""eval.metrics measured on the held-out rows beside the loss, on the last stage: each a sum over the
samples' target elements and their count, so the coordinator adds every replica's and divides once
(raytrain.control.evaluation): the same figure in every layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class HeldOutMetrics:
    """Sums of ``names`` (of raytrain.config.schema.EVAL_METRICS) over one evaluation's outputs."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.sums = {name: 0.0 for name in self.names}
        self.counts = {name: 0 for name in self.names}

    def add(self, out: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one micro-batch's outputs against its targets."""
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out = out.detach().float()
        for name in self.names:
            total, count = _MEASURES[name](out, targets)
            self.sums[name] += float(total)
            self.counts[name] += int(count)


def _correct(out: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """Targets among the output's k largest classes (its last dimension), and how many targets."""
    _, top = out.topk(min(k, out.shape[-1]), dim=-1)
    return (top == targets.unsqueeze(-1)).any(-1).sum(), targets.numel()


def _matching(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The output in the targets' shape (an output of (B, 1) against targets of (B,), as the default loss)."""
    return out.squeeze(-1) if out.shape != targets.shape and out.shape == (*targets.shape, 1) else out


_MEASURES = {
    "accuracy": lambda out, y: _correct(out, y, 1),
    "top5": lambda out, y: _correct(out, y, 5),
    "mse": lambda out, y: (((_matching(out, y) - y.float()) ** 2).sum(), y.numel()),
    "mae": lambda out, y: ((_matching(out, y) - y.float()).abs().sum(), y.numel()),
}
