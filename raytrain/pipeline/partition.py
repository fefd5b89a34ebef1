"""Cut an ordered list of layers into p contiguous, balanced stages."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
from torch import nn


def balanced_cuts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split points minimising the most expensive stage (every stage gets >= 1 layer).

    Returns the index of the first layer of stages 1..p-1. Exact dynamic programme: O(p * n^2),
    trivial for the tens of layers a pipeline cuts.
    """
    n = len(costs)
    assert 1 <= num_stages <= n, (num_stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of the first i layers cut into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    cuts, i = [], n
    for k in range(num_stages, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters())) or 1.0 for layer in layers]


def time_costs(layers: Sequence[nn.Module], example_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds per layer on one example batch (median of ``repeats``)."""
    costs = []
    x = example_input
    for layer in layers:
        samples = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.float().sum().backward()
            samples.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(samples)[len(samples) // 2])
        with torch.no_grad():
            x = layer(x)
    return costs


def layer_cuts(layers: Sequence[nn.Module], num_stages: int, example_input: Optional[torch.Tensor] = None) -> list[int]:
    """Balanced cuts (the first layer of stages 1..p-1): by measured time on ``example_input`` when
    given, else by parameter counts."""
    costs = time_costs(layers, example_input) if example_input is not None else param_costs(layers)
    return balanced_cuts(costs, num_stages)
