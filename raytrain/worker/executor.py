"""Runs one stage's plan for one step: one loop over the actions, one short method per action kind.

Sends are non-blocking and receives block, as raytrain.pipeline.schedule's checker simulates them, so a
plan that passes the checker cannot deadlock here. Everything a step holds while it runs lives in
one ``StepBuffers``; nothing outlives the step but the gradients it accumulated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain.pipeline import split_backward
from raytrain.pipeline.schedule import COMPUTE, Action, ActionKind
from raytrain.testing.faults import PhaseHook
from raytrain.worker.generation import Generation
from raytrain.worker.gradsync import GradientBuckets


@dataclass
class StepBuffers:
    """One step of one stage: what it runs in, the tensors in flight between its actions, its counters."""

    gen: Generation
    step: int
    hook: PhaseHook
    x: Optional[torch.Tensor]  # (share, T) token ids: this replica's inputs (first stage) ...
    y: Optional[torch.Tensor]  # ... and targets (last stage)
    loss_sum: torch.Tensor  # sum over this replica's samples of their loss (last stage)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> activation received
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> output (scaled loss on the last stage)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> gradient received for it
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> gradient to send back
    weight_halves: dict[int, split_backward.WeightGradients] = field(default_factory=dict)  # backwards whose W is due
    sends: list[Any] = field(default_factory=list)  # torch.distributed work of the sends in flight
    busy_s: float = 0.0  # time in compute actions
    peak_live: int = 0  # most micro-batches alive at once (forward done, weight gradients not)
    events: Optional[list[tuple[str, float, float]]] = None  # (action, start, end) when traced
    backward_started: bool = False


class PlanExecutor:
    """Executes a stage's plan (``Generation.plan``) one step at a time on this stage's layers."""

    def __init__(self, module: nn.Module, loss_fn: Callable, grads: GradientBuckets, device: torch.device,
                 autocast: Callable[[], Any], global_batch: int):
        self.module, self.loss_fn, self.grads = module, loss_fn, grads
        self.params = list(module.parameters())
        self.device, self.autocast, self.global_batch = device, autocast, global_batch
        self._handlers = {
            ActionKind.RECV_F: self._recv_activation,
            ActionKind.FORWARD: self._forward,
            ActionKind.SEND_F: self._send_activation,
            ActionKind.RECV_B: self._recv_gradient,
            ActionKind.BACKWARD: self._backward,
            ActionKind.SEND_B: self._send_gradient,
            ActionKind.WEIGHT: self._weight_gradients,
        }

    def run(self, gen: Generation, step: int, x: Optional[torch.Tensor], y: Optional[torch.Tensor],
            hook: PhaseHook, trace: bool) -> StepBuffers:
        """Every action of ``gen.plan`` in order, then wait for the sends; the gradients are accumulated."""
        buf = StepBuffers(gen, step, hook, x, y, torch.zeros((), device=self.device), events=[] if trace else None)
        hook("forward", step)
        for i, action in enumerate(gen.plan):
            t0 = time.perf_counter()
            if i == gen.last_grad_action:  # this action fills the step's last gradients: buckets reduce as they fill
                self.grads.arm()
            self._handlers[action.kind](action, buf)
            t1 = time.perf_counter()
            if action.kind in COMPUTE:
                buf.busy_s += t1 - t0
            if buf.events is not None:
                buf.events.append((repr(action), t0, t1))
        for work in buf.sends:
            work.wait()
        return buf

    def output_of(self, example: torch.Tensor) -> torch.Tensor:
        """This stage's output for ``example``, without gradients (to learn its shape)."""
        with torch.no_grad(), self.autocast():
            return self.module(example)

    # --- one method per action kind ---------------------------------------------------------------

    def _recv_activation(self, a: Action, buf: StepBuffers) -> None:
        lo, hi = buf.gen.mb_bounds[a.mb]
        x = torch.empty(hi - lo, *buf.gen.input_tail, dtype=buf.gen.input_dtype, device=self.device)
        dist.recv(x, src=buf.gen.prev_rank)
        buf.inputs[a.mb] = x.requires_grad_(x.is_floating_point())

    def _forward(self, a: Action, buf: StepBuffers) -> None:
        lo, hi = buf.gen.mb_bounds[a.mb]
        inp = buf.x[lo:hi] if buf.gen.is_first else buf.inputs[a.mb]
        with self.autocast():
            out = self.module(inp)
        if buf.gen.is_last:
            loss = self.loss_fn(out, buf.y[lo:hi])
            buf.loss_sum += loss.detach() * (hi - lo)
            out = loss * ((hi - lo) / self.global_batch)  # share of the global batch: grads then just sum
        buf.outputs[a.mb] = out
        buf.peak_live = max(buf.peak_live, len(buf.outputs) + len(buf.weight_halves))

    def _send_activation(self, a: Action, buf: StepBuffers) -> None:
        buf.sends.append(dist.isend(buf.outputs[a.mb].detach().contiguous(), dst=buf.gen.next_rank))

    def _recv_gradient(self, a: Action, buf: StepBuffers) -> None:
        grad = torch.empty_like(buf.outputs[a.mb])
        dist.recv(grad, src=buf.gen.next_rank)
        buf.output_grads[a.mb] = grad

    def _backward(self, a: Action, buf: StepBuffers) -> None:
        if not buf.backward_started:
            buf.hook("backward", buf.step)
            buf.backward_started = True
        out = buf.outputs.pop(a.mb)
        out_grad = None if buf.gen.is_last else buf.output_grads.pop(a.mb)
        if a.mb in buf.gen.split_mbs:
            buf.input_grads[a.mb], buf.weight_halves[a.mb] = split_backward.backward_input(
                out, out_grad, buf.inputs.pop(a.mb), self.params)
        else:
            out.backward(out_grad)
            if not buf.gen.is_first:
                buf.input_grads[a.mb] = buf.inputs.pop(a.mb).grad

    def _send_gradient(self, a: Action, buf: StepBuffers) -> None:
        buf.sends.append(dist.isend(buf.input_grads.pop(a.mb).contiguous(), dst=buf.gen.prev_rank))

    def _weight_gradients(self, a: Action, buf: StepBuffers) -> None:
        buf.weight_halves.pop(a.mb).run()
