"""Runs one pipeline worker's list of the schedule for one step: one loop over its actions, one short method
per action kind.

Sends are non-blocking and receives block, as raytrain.pipeline.checker simulates them, so a schedule that
passes the checker cannot deadlock here. An activation is a tensor or a tuple of tensors
(raytrain.worker.activations). With virtual stages the worker holds several model chunks and
every tensor in flight is keyed by (chunk, micro-batch); between two chunks of this worker nothing is
sent: the next chunk's forward takes the previous one's output (detached, as a received activation
would be) and its backward hands the input gradient straight back. Everything a step holds while it
runs lives in one ``StepBuffers``; nothing outlives the step but the gradients it accumulated.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raytrain.pipeline import split_backward
from raytrain.worker import activations
from raytrain.worker.activations import Activation
from raytrain.worker.metrics import HeldOutMetrics
from raytrain.pipeline.actions import COMPUTE, Action, ActionKind
from raytrain.worker.generation import Generation
from raytrain.worker.gradsync import GradientBuckets
from raytrain.worker.phases import PhaseHook


Key = tuple[int, int]  # (chunk, micro-batch)


@dataclass
class StepBuffers:
    """One step of one stage: what it runs in, the tensors in flight between its actions, its counters."""

    gen: Generation
    step: int
    hook: PhaseHook
    x: Optional[torch.Tensor]  # (share, ...) this replica's inputs (first stage: token ids, features) ...
    y: Optional[torch.Tensor]  # ... and targets (last stage)
    loss_sum: torch.Tensor  # sum over this replica's samples of their loss (last stage)
    # keyed by (chunk, micro-batch):
    inputs: dict[Key, Activation] = field(default_factory=dict)  # activation received (or handed over)
    outputs: dict[Key, Activation] = field(default_factory=dict)  # output (scaled loss on the last stage)
    output_grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)  # gradients received for it
    input_grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)  # gradients to send back
    weight_halves: dict[Key, split_backward.WeightGradients] = field(default_factory=dict)  # backwards whose W is due
    sends: list[Any] = field(default_factory=list)  # torch.distributed work of the sends in flight
    busy_s: float = 0.0  # time in compute actions
    peak_live: int = 0  # most (chunk, micro-batch) activations alive at once (forward done, weight gradients not)
    events: Optional[list[tuple[str, float, float]]] = None  # (action, start, end) when traced
    backward_started: bool = False
    metrics: Optional[HeldOutMetrics] = None  # eval.metrics summed over the last stage's samples (evaluations)


class ScheduleExecutor:
    """Executes a worker's list of the schedule (``Generation.actions``) one step at a time on its layers:
    ``module``, whose model chunks are ``chunks`` (``[module]`` without virtual stages; ``cut_into_chunks``
    views, or FSDP2 roots of their own). ``loss_context``: what the loss and the last chunk's backward run in (torch's
    ``loss_parallel`` under tensor parallelism, where the head's logits stay split by vocabulary)."""

    def __init__(self, module: nn.Module, chunks: list[nn.Module], loss_fn: Callable, grads: GradientBuckets,
                 device: torch.device, autocast: Callable[[], Any], global_batch: int,
                 loss_context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.module, self.chunks, self.loss_fn, self.grads = module, chunks, loss_fn, grads
        self.device, self.autocast, self.global_batch = device, autocast, global_batch
        self.loss_context = loss_context
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
            hook: PhaseHook, trace: bool, metrics: Optional[HeldOutMetrics] = None) -> StepBuffers:
        """Every action of ``gen.actions`` in order, then wait for the sends; the gradients are accumulated.
        ``metrics``: what an evaluation measures of the last chunk's outputs beside the loss."""
        buf = StepBuffers(gen, step, hook, x, y, torch.zeros((), device=self.device), events=[] if trace else None,
                          metrics=metrics)
        hook("forward", step)
        for i, action in enumerate(gen.actions):
            t0 = time.perf_counter()
            if i in gen.chunk_last_grad_actions:  # this chunk's last gradients: a sharded chunk reduces them
                self.grads.arm_chunk(gen.chunk_last_grad_actions.index(i))
            if i == gen.last_grad_action:  # this action fills the step's last gradients: buckets reduce as they fill
                self.grads.arm(buf.loss_sum)
            self._handlers[action.kind](action, buf)
            if action.kind == ActionKind.WEIGHT and i in gen.chunk_last_grad_actions:
                self.grads.chunk_weights_done(gen.chunk_last_grad_actions.index(i))
            t1 = time.perf_counter()
            if action.kind in COMPUTE:
                buf.busy_s += t1 - t0
            if buf.events is not None:
                buf.events.append((repr(action), t0, t1))
        for work in buf.sends:
            work.wait()
        return buf

    def output_of(self, chunk: int, example: Activation) -> Activation:
        """Chunk ``chunk``'s output for ``example``, without gradients, in eval mode (to learn its shape:
        a batch norm updates no statistics, a dropout draws no random numbers), eagerly (compiled layers,
        train.compile, are not compiled for it)."""
        module = self.chunks[chunk]
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.autocast(), torch.compiler.set_stance("force_eager"):
                return module(example)
        finally:
            module.train(was_training)

    # --- one method per action kind ---------------------------------------------------------------

    def _recv_activation(self, a: Action, buf: StepBuffers) -> None:
        lo, hi = buf.gen.mb_bounds[a.mb]
        place = buf.gen.chunks[a.chunk]
        buf.inputs[(a.chunk, a.mb)] = activations.receive(hi - lo, place.input_shapes, place.input_is_tuple,
                                                          place.prev_rank, self.device)

    def _forward(self, a: Action, buf: StepBuffers) -> None:
        lo, hi = buf.gen.mb_bounds[a.mb]
        place, key = buf.gen.chunks[a.chunk], (a.chunk, a.mb)
        if place.is_first:
            inp = buf.x[lo:hi]
        elif place.prev_chunk is not None:  # a hand-off from this worker's previous chunk
            inp = activations.detached(buf.outputs[(place.prev_chunk, a.mb)])
            buf.inputs[key] = inp
        else:
            inp = buf.inputs[key]
        with self.autocast():
            out = self.chunks[a.chunk](inp)
        if place.is_last:
            with self.loss_context():
                loss = self.loss_fn(out, buf.y[lo:hi])
            value = loss.detach()
            buf.loss_sum += (value.full_tensor() if isinstance(value, DTensor) else value) * (hi - lo)
            if buf.metrics is not None:
                buf.metrics.add(out, buf.y[lo:hi])
            out = loss * ((hi - lo) / self.global_batch)  # share of the global batch: grads then just sum
        buf.outputs[key] = out
        buf.peak_live = max(buf.peak_live, len(buf.outputs) + len(buf.weight_halves))

    def _send_activation(self, a: Action, buf: StepBuffers) -> None:
        dst = buf.gen.chunks[a.chunk].next_rank
        buf.sends.extend(activations.send(buf.outputs[(a.chunk, a.mb)], dst))

    def _recv_gradient(self, a: Action, buf: StepBuffers) -> None:
        key = (a.chunk, a.mb)
        buf.output_grads[key] = activations.receive_grads(buf.outputs[key], buf.gen.chunks[a.chunk].next_rank)

    def _backward(self, a: Action, buf: StepBuffers) -> None:
        if not buf.backward_started:
            buf.hook("backward", buf.step)
            buf.backward_started = True
        place, key = buf.gen.chunks[a.chunk], (a.chunk, a.mb)
        out = buf.outputs.pop(key)
        out_grads = None if place.is_last else buf.output_grads.pop(key)
        with self._around_loss(a.chunk, buf):
            if key in buf.gen.split:  # one tensor each way: prepare refuses to split tuples
                grad, buf.weight_halves[key] = split_backward.backward_input(
                    out, None if out_grads is None else out_grads[0], buf.inputs.pop(key))
                input_grads = [grad]
            else:
                activations.backward(out, out_grads)
                input_grads = None if place.is_first else activations.input_grads(buf.inputs.pop(key))
        if place.prev_chunk is not None:  # the previous chunk is this worker's: hand the gradient back
            buf.output_grads[(place.prev_chunk, a.mb)] = input_grads
        elif input_grads is not None and not place.is_first:
            buf.input_grads[key] = input_grads

    def _send_gradient(self, a: Action, buf: StepBuffers) -> None:
        dst = buf.gen.chunks[a.chunk].prev_rank
        buf.sends.extend(activations.send_grads(buf.input_grads.pop((a.chunk, a.mb)), dst))

    def _weight_gradients(self, a: Action, buf: StepBuffers) -> None:
        with self._around_loss(a.chunk, buf):
            buf.weight_halves.pop((a.chunk, a.mb)).run()

    def _around_loss(self, chunk: int, buf: StepBuffers) -> ContextManager:
        """The loss's context for a backward through it (the last chunk's), else none."""
        return self.loss_context() if buf.gen.chunks[chunk].is_last else contextlib.nullcontext()


def cut_into_chunks(module: nn.Module, chunk_lengths: Optional[list[int]]) -> list[nn.Module]:
    """``module`` (an ``nn.Sequential``) as model chunks of ``chunk_lengths`` layers: views of consecutive
    layers sharing its parameters (itself when one)."""
    if chunk_lengths is None or len(chunk_lengths) == 1:
        return [module]
    assert isinstance(module, nn.Sequential) and sum(chunk_lengths) == len(module), (chunk_lengths, module)
    layers, chunks, start = list(module), [], 0
    for length in chunk_lengths:
        chunks.append(nn.Sequential(*layers[start:start + length]))
        start += length
    return chunks
