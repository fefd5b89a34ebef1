"""A worker's layers in one of three kinds behind one contract (``StageLayers``): whole and replicated
(``ReplicatedLayers``, here), this shard's rows of them (FSDP2: raytrain.worker.sharded.ShardedLayers), or
this tp rank's slices of them (raytrain.worker.tensor_parallel.TensorParallelLayers; 2-D with FSDP2 is the
sharded kind). ``stage_layers`` picks the kind from the layout.

Contract: ``wrap`` for each generation (collective-free) gives the layers on that generation's groups and
the ``Grads`` that reduce their gradients; ``release`` before the groups go. The values live in
``params`` (and ``buffers``) throughout, so a worker keeps its state from one generation to the next.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
from torch import nn

from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.models.layers import build_model, persistent_buffer_names
from raytrain.worker.compiling import as_run
from raytrain.worker.executor import cut_into_chunks
from raytrain.worker.gradsync import GradientBuckets
from raytrain.worker.groups import Groups


class Grads(Protocol):
    """Who reduces a stage's gradients over the data-parallel group (and shards or tp groups) in a step:
    ``zero`` before it, ``arm`` (and ``arm_chunk``) before the backwards that fill the last gradients,
    ``finish`` after them; ``squared_norm`` for the clip. ``carries_vote``: the step's vote is summed with
    the gradients (``open_vote``, then ``vote_result``; replicated layers of a purely data-parallel run)."""

    carries_vote: bool

    def zero(self) -> None: ...
    def arm(self, loss_sum: torch.Tensor) -> None: ...
    def arm_chunk(self, chunk: int) -> None: ...
    def chunk_weights_done(self, chunk: int) -> None: ...
    def finish(self) -> None: ...
    def squared_norm(self) -> torch.Tensor: ...


class StageLayers(Protocol):
    """A worker's layers of its stage, in one kind (see the module docstring)."""

    names: list[str]
    """Global names of ``params``, in order."""
    params: list[torch.Tensor]
    """The values this worker holds of each parameter (whole, its rows, its slices): what the optimizer steps."""
    buffers: list[torch.Tensor]
    """The stage's buffers, whole on every kind (batch norm's statistics, rotary tables), in module order."""
    buffer_names: list[Optional[str]]
    """Of each of ``buffers``: its global name when it is state (checkpointed, kept equal on the replicas),
    else None."""
    loss_fn: Callable
    module: Optional[nn.Module]
    """The stage as this generation runs it (None between ``release`` and ``wrap``) ..."""
    chunks: list[nn.Module]
    """... and its model chunks (one unless virtual stages)."""
    rows: Optional[list]
    """Of each parameter, the (start, stop, total) rows of dim 0 this worker holds; None when whole."""
    slices: Optional[list]
    """Of each parameter, the checkpoint's ``slices`` entry of the boxes it holds; None unless tensor-parallel."""
    written: Optional[list[bool]]
    """Which parameters this worker's checkpoint file holds (None: all; a tp rank but the first leaves out
    those every rank holds whole)."""
    part: Optional[int]
    """Which file of its stage this worker writes (None: the stage's one file)."""
    comm_log: Optional[list]

    def wrap(self, groups: Groups, mesh: Mesh, rank: int, optimizer: torch.optim.Optimizer) -> Grads: ...
    def release(self) -> None: ...


class ReplicatedLayers:
    """The stage's whole layers on the device: every replica holds them; the gradient buckets all-reduce
    them over the dp group of each generation."""

    rows = slices = written = part = None
    comm_log = None

    def __init__(self, cfg: Config, layer_ids: list[int], chunk_lengths: list[int], device: torch.device):
        spec = build_model(cfg.model, cfg.train.seed, layer_ids)
        layers = as_run(spec.layers, cfg.train)
        self.module = nn.Sequential(*layers).to(device)  # parameters in the same order: names stay global
        self.chunks = cut_into_chunks(self.module, chunk_lengths)
        self.names, self.loss_fn = spec.param_names(), spec.loss_fn
        self.params = list(self.module.parameters())
        self.buffers = list(self.module.buffers())
        self.buffer_names = persistent_buffer_names(spec.layers, layer_ids)
        self.grads = GradientBuckets(self.params, None)

    def wrap(self, groups: Groups, mesh: Mesh, rank: int, optimizer: torch.optim.Optimizer) -> GradientBuckets:
        self.grads.group = groups.dp_group
        # the dp group is the whole world (no stages, shards or tp ranks): the step's vote rides in the gradients
        self.grads.carries_vote = mesh.world_size == mesh.dp and self.grads.vote is not None
        return self.grads

    def release(self) -> None:
        self.grads.detach_group()


def stage_layers(cfg: Config, chunks: list[list[int]], shard: int, tp: int, device: torch.device) -> StageLayers:
    """The layers of ``chunks`` (global layer ids of each model chunk) in the kind the layout gives this
    worker: tensor-parallel (tp > 1 alone), sharded (fsdp > 1, with or without tp), else replicated."""
    layer_ids = [i for chunk in chunks for i in chunk]
    lengths = [len(chunk) for chunk in chunks]
    if cfg.parallel.tp > 1 and cfg.parallel.fsdp == 1:
        from raytrain.worker.tensor_parallel import TensorParallelLayers  # DTensor: imported only when used

        return TensorParallelLayers(cfg, layer_ids, tp, cfg.parallel.tp, device, lengths)
    if cfg.parallel.fsdp > 1:
        # Imported here: FSDP2 and DTensor take a second to import, which a replicated stage's start-up skips.
        from raytrain.worker.sharded import ShardedLayers

        return ShardedLayers(cfg, layer_ids, shard, cfg.parallel.fsdp, device, cfg.parallel.tp, tp, lengths)
    return ReplicatedLayers(cfg, layer_ids, lengths, device)
