"""A stage's backward in two halves: the input gradient first, the weight gradients after.

A pipeline stage's predecessor waits for the gradient of this stage's input, not for this stage's
weight gradients. Computing the input gradient alone, sending it, and only then computing the
weight gradients takes the weight half (about half of a backward) off the critical path: the
cool-down of every step gets one weight-gradient time shorter on each stage but the first. This
is the B/W split of zero-bubble pipelines (Qi et al., 2023), kept inside the GPipe and 1F1B orders.

How, with public autograd APIs only. ``torch.autograd.grad(out, inp)`` runs exactly the graph nodes
on a path to ``inp`` and skips the outputs of each node that lead only to weights. The nodes where a
weight branch leaves that path (a Linear's ``AddmmBackward``, a LayerNorm's backward) are the
*boundary* nodes: a pre-hook records the gradient each receives. The weight half then restarts
autograd at those nodes (``GradientEdge`` roots) with the recorded gradients and the weights as
``inputs``, so each node now computes only its weight outputs, and the weights accumulate into
``.grad`` as usual (post-accumulate hooks fire: bucketed all-reduce still overlaps).

The weights are the graph's own leaves (its ``AccumulateGrad`` nodes other than the input's): the
tensors autograd accumulates into, whatever the module's ``parameters()`` return at the time. Under
FSDP2 those are the unsharded parameters it swaps in for the forward, not the shards a module holds
between layers.

One autograd call per boundary node, with only the weights it reaches as ``inputs``: a call that
also named a deeper node's weights would re-run the input path down to them. A weight reached from
two boundary nodes (used at two depths of the stage) would do that too, so such a graph is not
split: ``backward_input`` then does the whole backward at once and the weight half is empty. Same
gradients either way.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightGradients:
    """The deferred weight half of one micro-batch's backward: call ``run`` once."""

    def __init__(self, calls: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]):
        self._calls = calls

    def run(self) -> None:
        calls, self._calls = self._calls, []  # our last references to the graph: it is freed after this
        for roots, grads, weights in calls:
            torch.autograd.backward(roots, grads, retain_graph=True, inputs=weights)


def backward_input(output: torch.Tensor, output_grad: Optional[torch.Tensor],
                   inp: torch.Tensor) -> tuple[torch.Tensor, WeightGradients]:
    """Gradient of ``output`` (seeded by ``output_grad``) w.r.t. ``inp``, and its weight half, to run later."""
    groups = _boundary_groups(output.grad_fn, inp)
    if groups is None:  # cannot split: one ordinary backward does both halves now
        output.backward(output_grad)
        grad, inp.grad = inp.grad, None
        return grad, WeightGradients([])
    captured: dict[Node, tuple] = {}
    handles = [node.register_prehook(_recorder(captured, node)) for node, _ in groups]
    try:
        (grad,) = torch.autograd.grad(output, inp, output_grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    calls = []
    for node, group_weights in groups:  # one call per node: see the module docstring
        recorded = [(GradientEdge(node, i), g) for i, g in enumerate(captured.get(node, ())) if g is not None]
        if recorded:
            calls.append(([edge for edge, _ in recorded], [g for _, g in recorded], group_weights))
    return grad, WeightGradients(calls)


def _recorder(captured: dict, node: Node) -> Callable:
    def record(grad_outputs):
        captured[node] = grad_outputs

    return record


def _boundary_groups(root: Optional[Node], inp: torch.Tensor):
    """``[(boundary node, weights it reaches)]``, or None where the graph cannot be split.

    Walks the graph once from ``root``. A node is *on the input path* if ``inp`` is reachable from
    it; a boundary node is on the path and has an edge leaving it towards weights (leaves other
    than ``inp``: see the module docstring).
    """
    if root is None or not inp.requires_grad:
        return None
    target = get_gradient_edge(inp).node
    # Post-order walk (iterative: graphs of deep stages exceed Python's recursion limit).
    on_path: dict[Node, bool] = {}
    reaches: dict[Node, frozenset] = {}  # weights reachable from a node off the input path
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in on_path:
            continue
        children = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in on_path)
            continue
        on_path[node] = node is target or any(on_path[c] for c in children)
        leaf = getattr(node, "variable", None) if node is not target else None  # an AccumulateGrad's tensor
        own = {leaf} if leaf is not None else set()
        reaches[node] = frozenset(own.union(*(reaches[c] for c in children if not on_path[c])))
    if not on_path[root]:
        return None
    groups = [(node, list(reaches[node])) for node, path in on_path.items() if path and reaches[node]]
    # Each weight must be reached from one boundary node only; else (a weight used twice) the
    # weight half of one node would recompute the input path to the other.
    seen: set = set()
    for _, ws in groups:
        ids = {id(w) for w in ws}
        if ids & seen:
            return None
        seen |= ids
    return groups

