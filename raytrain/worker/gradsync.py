"""Bucketed gradient all-reduce inside a data-parallel group, overlapped with the last backward.

Gradients live in flat per-bucket buffers (``param.grad`` is a view), so a bucket is all-reduced in
place with one collective as soon as the last micro-batch's backward has produced all of its grads,
while autograd goes on with earlier layers. This is DDP's design, kept small enough to work with
pipeline stages, where the last backward is driven by the schedule rather than by ``loss.backward``.

The reduction is a SUM: each micro-batch loss is already scaled by its share of the *global* batch,
so the sum is the global-batch gradient whatever the number of replicas or their shares.

In a purely data-parallel generation (the dp group is the whole world) the step's vote rides in the
first bucket (``carries_vote``): two values after its gradients, this worker's loss and whether it leaves,
summed with them. A separate vote collective costs as much as the gradients' own on a small model
(1.5 ms of a 4.7 ms step of the design documents' MLP at dp=2 on two CPU cores), and the bucket's
completion proves what the vote proves: every worker finished its forward and backward.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
VOTE_SLOTS = 2
"""Values after the first bucket's gradients: the worker's loss sum, and 1 when it leaves (summed over the group)."""


class GradientBuckets:
    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        group: Optional[dist.ProcessGroup],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.group = group
        self.buffers: list[torch.Tensor] = []  # each bucket's gradients ...
        self._flat: list[torch.Tensor] = []  # ... and what it all-reduces: the first one's vote after them
        self.vote: Optional[torch.Tensor] = None  # the vote's values (a view into the first bucket)
        self.carries_vote = False  # whether the step's vote is this reduction's (the wrapper sets it per generation)
        self._leaving: Optional[Callable[[], bool]] = None  # this step's say in it, once opened
        self._bucket_of: dict[torch.nn.Parameter, int] = {}
        self._sizes: list[int] = []
        # Gradients arrive roughly in reverse order of definition: bucket them that way.
        current: list[torch.nn.Parameter] = []
        for p in reversed([p for p in params if p.requires_grad]):
            current.append(p)
            if sum(q.numel() * q.element_size() for q in current) >= bucket_bytes:
                self._add_bucket(current)
                current = []
        if current:
            self._add_bucket(current)
        self._armed = False
        self._pending: list[int] = []
        self._works: dict[int, object] = {}
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        index = len(self.buffers)
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel + (VOTE_SLOTS if index == 0 else 0), dtype=params[0].dtype, device=params[0].device)
        buffer = flat[:numel]
        if index == 0:
            self.vote = flat[numel:]
        offset = 0
        for p in params:
            p.grad = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            self._bucket_of[p] = index
        self.buffers.append(buffer)
        self._flat.append(flat)
        self._sizes.append(len(params))

    def detach_group(self) -> None:
        """Forget the group and any collective in flight (the group is being torn down)."""
        self.group = None
        self._works = {}
        self._armed = False

    def zero(self) -> None:
        """Zero every gradient, and the vote, in place (never set to None: the views must stay)."""
        for flat in self._flat:
            flat.zero_()

    def open_vote(self, leaving: Callable[[], bool]) -> None:
        """Carry this step's vote: when the last backward starts (``arm``), this worker's loss and
        ``leaving()`` (asked then, as late as the first bucket allows) go in."""
        self._leaving = leaving

    def vote_result(self) -> tuple[bool, bool]:
        """After ``finish``: (every worker's loss finite, some worker leaves), as the whole group summed them."""
        return bool(torch.isfinite(self.vote[0])), bool(self.vote[1] > 0)

    def arm_chunk(self, chunk: int) -> None:
        """Nothing: a replicated worker's buckets span its chunks, so they wait for ``arm``."""

    def chunk_weights_done(self, chunk: int) -> None:
        """Nothing: the weight halves fire the post-accumulate hooks that fill the buckets."""

    def arm(self, loss_sum: torch.Tensor) -> None:
        """Call right before the last backward of the step (every forward has run: ``loss_sum`` is this
        worker's loss of the step): buckets then reduce as they fill."""
        self._armed = True
        self._pending = list(self._sizes)
        self._works = {}
        if self._leaving is not None:
            self.vote[0], self.vote[1] = loss_sum, 1.0 if self._leaving() else 0.0
            self._leaving = None

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        index = self._bucket_of[param]
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._launch(index)

    def _launch(self, index: int) -> None:
        if self.group is not None and index not in self._works:
            self._works[index] = dist.all_reduce(self._flat[index], op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish(self) -> None:
        """Reduce what has not started (unused parameters) and wait for every bucket."""
        if self._armed:
            for index in range(len(self.buffers)):
                self._launch(index)
            for work in self._works.values():
                work.wait()
        self._armed = False

    def squared_norm(self) -> torch.Tensor:
        return sum(b.float().pow(2).sum() for b in self.buffers)

    def scale_(self, factor: float) -> None:
        for b in self.buffers:
            b.mul_(factor)


def clip_global_norm(grads, clip: float, groups: Sequence[Optional[dist.ProcessGroup]],
                     tp_group: Optional[dist.ProcessGroup] = None,
                     counted_elsewhere: Sequence[torch.Tensor] = ()) -> Optional[float]:
    """The global gradient norm over all shards and stages (``groups``: the fsdp group, then the pp group;
    the dp replicas already agree), with ``grads`` scaled down to ``clip`` when above it; None with
    clipping off (``clip`` 0: no collective). ``grads``: GradientBuckets or a sharded stage's gradients.
    With a ``tp_group``, ``grads`` are a tensor-parallel stage's: the squares of its split gradients are
    summed over the tp group, its replicated ones (whole on every tp rank) counted once. ``counted_elsewhere``:
    parameters tied to another stage's, whose worker counts them (raytrain.worker.ties)."""
    if clip == 0:
        return None
    if tp_group is not None:
        split, whole = grads.squared_norms()
        dist.all_reduce(split, group=tp_group)
        sq = split + whole
    else:
        sq = grads.squared_norm()
    for p in counted_elsewhere:
        sq = sq - p.grad.float().pow(2).sum()
    for group in groups:
        if group is not None:
            dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = clip / (norm + 1e-6)
    if coef < 1.0:
        grads.scale_(coef)
    return norm


def all_reduce_flat(grads: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``grads`` over ``group`` in place, as one collective over their concatenation."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_over_tp(params: Sequence[torch.Tensor], summed: Sequence[bool], tp_group: Optional[dist.ProcessGroup]) -> None:
    """Sum the gradients of the ``summed`` parameters over the tp group (each rank's covers its heads)."""
    if any(summed):
        all_reduce_flat([p.grad for p, s in zip(params, summed) if s], tp_group)


def squared_norms_by_split(params: Sequence[torch.Tensor], split: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of squares of the gradients of the tp-split parameters and of the others (the global norm sums
    the first over the tp group and counts the second once per tp group)."""
    split_sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
    whole_sq = torch.zeros_like(split_sq)
    for p, is_split in zip(params, split):
        if p.grad is not None:
            (split_sq if is_split else whole_sq).add_(p.grad.float().pow(2).sum())
    return split_sq, whole_sq
