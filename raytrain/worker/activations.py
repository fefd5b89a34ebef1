"""What passes between pipeline stages: an activation is a tensor, or a tuple of tensors (a hidden state and a
mask, say), each sent and received point to point; its gradient has one tensor per floating tensor of it.

The receiving stage learns each tensor's per-sample shape and dtype once per generation (``TensorShape``,
raytrain.worker.generation); a received floating tensor requires grad, and its gradient (zeros where
the stage's layers did not use it) goes back, so both sides agree on which tensors carry gradients by
their dtypes alone. Integer tensors (ids, masks) carry none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

Activation = Union[torch.Tensor, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class TensorShape:
    """One tensor of an activation: its shape after the batch dimension, and its dtype."""

    tail: tuple[int, ...]
    dtype: torch.dtype


def tensors(a: Activation) -> tuple[torch.Tensor, ...]:
    return a if isinstance(a, tuple) else (a,)


def shapes(a: Activation) -> tuple[TensorShape, ...]:
    return tuple(TensorShape(tuple(t.shape[1:]), t.dtype) for t in tensors(a))


def like(parts: list[torch.Tensor], is_tuple: bool) -> Activation:
    """``parts`` as an activation of the same form (a tuple, or one tensor)."""
    return tuple(parts) if is_tuple else parts[0]


def zeros(batch: int, kinds: tuple[TensorShape, ...], is_tuple: bool, device: torch.device) -> Activation:
    """An activation of ``batch`` samples shaped by ``kinds``, zero-filled (a shape probe's example)."""
    return like([torch.zeros(batch, *k.tail, dtype=k.dtype, device=device) for k in kinds], is_tuple)


def receive(batch: int, kinds: tuple[TensorShape, ...], is_tuple: bool, src: int, device: torch.device) -> Activation:
    """Receive an activation of ``batch`` samples from ``src``; its floating tensors require grad."""
    parts = []
    for k in kinds:
        t = torch.empty(batch, *k.tail, dtype=k.dtype, device=device)
        dist.recv(t, src=src)
        parts.append(t.requires_grad_(t.is_floating_point()))
    return like(parts, is_tuple)


def send(a: Activation, dst: int) -> list:
    """Send every tensor of ``a`` to ``dst`` without blocking; the works to wait for."""
    return [dist.isend(t.detach().contiguous(), dst=dst) for t in tensors(a)]


def detached(a: Activation) -> Activation:
    """``a`` as a stage's input handed over from this worker's previous chunk: detached, floating tensors
    requiring grad (as if received)."""
    parts = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors(a)]
    return like(parts, isinstance(a, tuple))


def receive_grads(out: Activation, src: int) -> list[torch.Tensor]:
    """Receive the gradient of each floating tensor of this stage's output ``out`` from ``src``."""
    grads = []
    for t in tensors(out):
        if t.is_floating_point():
            g = torch.empty_like(t)
            dist.recv(g, src=src)
            grads.append(g)
    return grads


def backward(out: Activation, grads: Optional[list[torch.Tensor]]) -> None:
    """Backpropagate ``grads`` (one per floating tensor of ``out``; None: ``out`` is the loss)."""
    if grads is None:
        out.backward()
        return
    floating = [t for t in tensors(out) if t.is_floating_point()]
    pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def input_grads(inp: Activation) -> list[torch.Tensor]:
    """The gradient of each floating tensor of a stage's input, zeros where its layers did not use it."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors(inp) if t.is_floating_point()]


def send_grads(grads: list[torch.Tensor], dst: int) -> list:
    return [dist.isend(g.contiguous(), dst=dst) for g in grads]
