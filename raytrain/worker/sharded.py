"""A stage's layers sharded over its fsdp group with torch's FSDP2 (``fully_shard``), one unit per layer.

Contract: ``ShardedLayers(cfg, layer_ids, shard, fsdp, device)`` holds this worker's rows of every
parameter of its stage as plain tensors (``params``, in the stage's parameter order), initialised
with the values every layout gives them: the built-in GPT is built on the meta device and each
layer is materialised alone, by its (seed, layer index) rule, to take this shard's rows of it.
Every generation, ``wrap(groups, mesh, rank, optimizer)`` builds a fresh FSDP2 module on that
generation's device mesh (1-D over the fsdp group, or 2-D (replicate, shard) for HSDP when dp > 1),
copies ``params`` into its sharded parameters and re-points ``params`` and the optimizer at them: the
optimizer steps plain views of FSDP's own shards, so its state is plain tensors that survive a
re-forming (a wrapping holds the groups of one generation only, and those die with it).

Gradients: FSDP2 reduce-scatters (and, with dp > 1, all-reduces across replicas) in each chunk's last
backward of the step only, or after its last weight half where the schedule splits that backward;
losses are scaled by their share of the global batch, so the reductions are SUMs (``ShardedGrads``,
the sharded counterpart of raytrain.worker.gradsync).

A shard owns rows ``[start, stop)`` of dim 0 of every parameter (``shard_rows``: torch.chunk's cut,
as FSDP2 makes it); checkpoints record them so any layout can reassemble or re-cut them.

With parallel.tp > 1 (2-D, as torchtitan's ``parallelize_llama`` orders it) each layer is first split
over the tp dimension of a (replicate, shard, tp) device mesh (raytrain.worker.tensor_parallel), then
FSDP2 shards the tp parts: a worker owns rows of its tp rank's part of each parameter, boxes of the
whole (``slices``), and the global norm sums the split parameters' squares over the tp group too.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import torch.distributed as dist

from raytrain.checkpoint.assemble import slices_entry
from raytrain.compat import clear_dtensor_sharding_cache
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.models.layers import persistent_buffer_names
from raytrain.models.tensor_plan import rows_of_stack
from raytrain.pipeline.actions import WEIGHT
from raytrain.pipeline.schedule import build_schedule
from raytrain.worker.compiling import as_run
from raytrain.worker.groups import Groups
from raytrain.worker.tensor_parallel import local_part, parallelize_layers
from raytrain.worker.gradsync import squared_norms_by_split, sum_over_tp
from raytrain.worker.stage_values import meta_stage, tp_grad_summed, tp_parts
from raytrain.worker.wrapping import adopt

CommLog = Optional[list]
"""Where the traced collectives go: (name, start, end) tuples, or None when not tracing."""


def shard_rows(rows: int, fsdp: int, shard: int) -> tuple[int, int]:
    """[start, stop) of dim 0 that shard ``shard`` of ``fsdp`` owns: ceil(rows / fsdp) rows each, the
    last shards shorter (torch.chunk's cut, which FSDP2 uses)."""
    chunk = -(-rows // fsdp)
    start = min(shard * chunk, rows)
    return start, min(start + chunk, rows)


def device_mesh(groups: Groups, mesh: Mesh, rank: int, device_type: str) -> DeviceMesh:
    """The FSDP2 mesh of this worker's stage: its fsdp group, with its dp group as HSDP's replicate
    dimension when there are replicas (and its tp group as the innermost dimension with parallel.tp > 1:
    ``tp_device_mesh``)."""
    if mesh.tp > 1:
        return tp_device_mesh(groups, mesh, rank, device_type)
    if mesh.dp == 1:
        return DeviceMesh.from_group(groups.fsdp_group, device_type, mesh_dim_names=("shard",))
    _, stage = mesh.coords(rank)
    grid = [[mesh.rank(replica=r, shard=f, stage=stage) for f in range(mesh.fsdp)] for r in range(mesh.dp)]
    return DeviceMesh.from_group([groups.dp_group, groups.fsdp_group], device_type, mesh=grid,
                                 mesh_dim_names=("replicate", "shard"))


def tp_device_mesh(groups: Groups, mesh: Mesh, rank: int, device_type: str) -> DeviceMesh:
    """The (replicate, shard, tp) mesh of this worker's stage (no replicate dimension when dp == 1): FSDP2
    shards over its ``shard`` (and replicates over ``replicate``) dimensions, DTensor splits each layer
    over ``tp``, as torchtitan's 2-D parallelism does."""
    replica, stage = mesh.coords(rank)
    replicas = range(mesh.dp) if mesh.dp > 1 else [replica]
    grid = [[[mesh.rank(replica=r, shard=f, stage=stage, tp=t) for t in range(mesh.tp)] for f in range(mesh.fsdp)]
            for r in replicas]
    if mesh.dp == 1:
        return DeviceMesh.from_group([groups.fsdp_group, groups.tp_group], device_type, mesh=grid[0],
                                     mesh_dim_names=("shard", "tp"))
    return DeviceMesh.from_group([groups.dp_group, groups.fsdp_group, groups.tp_group], device_type, mesh=grid,
                                 mesh_dim_names=("replicate", "shard", "tp"))


class ShardedLayers:
    """This worker's rows of its stage's parameters, and the FSDP2 wrapping of each generation."""

    def __init__(self, cfg: Config, layer_ids: list[int], shard: int, fsdp: int, device: torch.device,
                 tp: int = 1, tp_index: int = 0, chunk_lengths: Optional[list[int]] = None):
        """With ``tp`` > 1 (layers that declare a plan) this worker is tp rank ``tp_index`` of its shard:
        it owns rows of its tp part of each parameter (``slices``: boxes of the whole), not rows of the whole.
        With ``chunk_lengths`` (virtual stages) each model chunk of that many layers is an FSDP2 root."""
        self.cfg, self.shard, self.fsdp, self.device, self.tp = cfg, shard, fsdp, device, tp
        self.chunk_lengths = chunk_lengths or [len(layer_ids)]
        self.chunks: list[nn.Module] = []
        """This generation's FSDP2 roots, one per model chunk."""
        self.meta_layers, self.names, self.loss_fn, full_values, buffers = meta_stage(cfg, layer_ids)
        self.rows: Optional[list[tuple[int, int, int]]] = [] if tp == 1 else None
        """(start, stop, total rows) of each parameter that this shard owns (None with tp > 1)."""
        self.slices: Optional[list] = [] if tp > 1 else None
        """With tp > 1: the checkpoint's ``slices`` entry of each parameter (the boxes this worker holds)."""
        self.split: list[bool] = []
        """Whether each parameter is split over the tp group (never, with tp == 1)."""
        self.params: list[torch.Tensor] = []
        self.summed = tp_grad_summed(self.meta_layers) if tp > 1 else []
        """Whether each whole parameter's gradient is summed over the tp group (a per-head norm's)."""
        parts = tp_parts(self.meta_layers, tp, tp_index)
        for value, (boxes, split) in zip(full_values(), parts):
            self._own(value, boxes, split)
        self.buffers = [b.to(device) for b in buffers]
        """The stage's buffers (rotary tables, masks, batch norm's statistics: not sharded), in module order."""
        self.buffer_names = persistent_buffer_names(self.meta_layers, layer_ids)
        self.part = shard * tp + tp_index
        """Which file of its stage this worker writes: one per (shard, tp rank)."""
        self.written = self.split if tp_index > 0 else None
        """tp rank 0 writes the parts every tp rank holds (raytrain.worker.stage_state)."""
        self.module: Optional[nn.Module] = None
        self.comm_log: CommLog = None

    def _own(self, value: torch.Tensor, boxes, split: bool) -> None:
        """Take this shard's rows of ``value`` (of its tp part of it, stacked by ``boxes``, with tp > 1)."""
        if self.slices is None:
            start, stop = shard_rows(value.shape[0], self.fsdp, self.shard)
            self.rows.append((start, stop, value.shape[0]))
            self.params.append(value[start:stop].clone().to(self.device))
            self.split.append(False)
            return
        local = local_part(value, boxes)
        start, stop = shard_rows(local.shape[0], self.fsdp, self.shard)
        self.slices.append(slices_entry(rows_of_stack(boxes, start, stop), tuple(value.shape)))
        self.params.append(local[start:stop].clone().to(self.device))
        self.split.append(split)

    def wrap(self, groups: Groups, mesh: Mesh, rank: int, optimizer: torch.optim.Optimizer) -> "ShardedGrads":
        """Shard a fresh copy of the stage on this generation's groups, holding the current values;
        ``params`` and ``optimizer`` then step its shards. Collective-free."""
        assert mesh.fsdp == self.fsdp and mesh.shard(rank) == self.shard, (mesh, rank, self.shard)
        layers = copy.deepcopy(self.meta_layers)
        grid = device_mesh(groups, mesh, rank, self.device.type)
        if self.tp > 1:  # 2-D: split each layer over tp first, then shard the tp parts
            layers = parallelize_layers(layers, grid["tp"], self.cfg.parallel.sequence_parallel)
            grid = grid["replicate", "shard"] if mesh.dp > 1 else grid["shard"]
        layers = as_run(layers, self.cfg.train)
        self.chunks = [_fully_shard_stage(chunk, grid, self) for chunk in _chunked(layers, self.chunk_lengths)]
        module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        dparams = adopt(module, self.device, self.buffers, self.params, optimizer)
        self.module = module
        return ShardedGrads(self.chunks, dparams, self.params, self.split, (self.summed, groups.tp_group),
                            keep_unsharded=schedule_has_weight_halves(self.cfg, mesh, rank))

    def release(self) -> None:
        """Drop the wrapping (its groups are going); ``params`` keep the values and the prepared gradients.

        DTensor caches the sharding of the ops it dispatched (``to_empty`` makes some) by their
        specs, which hold the device mesh and through it the process groups: cleared here, or the
        groups' connections outlive them and peers blocked in a collective with this worker wait
        for the timeout instead of failing at once."""
        self.module, self.chunks = None, []
        clear_dtensor_sharding_cache()


def _chunked(layers: list[nn.Module], lengths: list[int]) -> list[list[nn.Module]]:
    """``layers`` cut into consecutive runs of ``lengths``."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def _fully_shard_stage(layers: list[nn.Module], mesh: DeviceMesh, owner: ShardedLayers) -> nn.Module:
    """``fully_shard`` every layer holding parameters (one unit each; the whole stage as one unit when
    layers share a parameter), then the stage; gradients SUM; each unit prefetches its neighbour's
    all-gather (the next in forward, the previous in backward)."""
    root = nn.Sequential(*layers)
    shared = len({id(p) for p in root.parameters()}) < sum(1 for layer in layers for _ in layer.parameters())
    units = [] if shared else [layer for layer in layers if any(True for _ in layer.parameters())]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(root, mesh=mesh)
    for unit in units + [root]:
        unit.set_gradient_divide_factor(1.0)  # losses carry their share of the global batch: reduce by SUM
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_custom_all_gather(TracedAllGather(owner))
        unit.set_custom_reduce_scatter(TracedReduceScatter(owner))
    for first, second in zip(units, units[1:]):
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
    return root


def schedule_has_weight_halves(cfg: Config, mesh: Mesh, rank: int) -> bool:
    """Whether the pipeline schedule of ``rank``'s worker splits a backward (has weight halves): only then
    must its layers stay gathered from a backward to the weight half after it. The first stage under a
    split 1F1B or GPipe sends no input gradient, so it does not split; nor does a run without a pipeline."""
    par = cfg.parallel
    schedule = build_schedule(par.schedule, mesh.pp, par.microbatches, par.split_backward, par.virtual_stages)
    return any(action.kind == WEIGHT for action in schedule[mesh.coords(rank)[1]])


class ShardedGrads:
    """GradientBuckets' contract for a sharded stage: ``zero`` before a step, ``arm_chunk`` before each
    chunk's last backward (that FSDP2 root then reduces: earlier micro-batches accumulate unsharded
    gradients locally), ``chunk_weights_done`` after a chunk's last gradient action when that was a
    split backward's weight half, ``finish`` after it all, then the norm and scaling act on this
    shard's reduced gradients, which the optimizer's plain ``params`` see as their ``.grad``."""

    carries_vote = False  # the step's vote is a world-wide collective of its own (raytrain.worker.stage)

    def __init__(self, roots: list[nn.Module], dparams: list[nn.Parameter], params: list[torch.Tensor],
                 split: Optional[list[bool]] = None,
                 summed_over_tp: tuple[list[bool], Optional[dist.ProcessGroup]] = ((), None),
                 keep_unsharded: bool = False):
        self.roots, self.dparams, self.params = roots, dparams, params
        self.split = split or [False] * len(params)
        self.summed_over_tp = summed_over_tp
        """With tp > 1: which gradients FSDP reduced over the fsdp group alone still sum over tp too."""
        self.keep_unsharded = keep_unsharded
        """When the worker's schedule splits backwards (schedule_has_weight_halves): no backward reshards a chunk's
        layers until its reduction, as a weight half that runs after its input half accumulates into the
        unsharded parameters (as in torch.distributed.pipelining); a later forward may still reshard them
        (FSDP2's reshard_after_forward). Otherwise each backward reshards them."""

    def zero(self) -> None:
        for p in self.dparams + self.params:
            p.grad = None
        for root in self.roots:
            self._sync(root, False)
            root.set_reshard_after_backward(not self.keep_unsharded)

    def arm_chunk(self, chunk: int) -> None:
        """Before a chunk's last backward of the step: that root reduce-scatters in it."""
        self._sync(self.roots[chunk], True)
        self.roots[chunk].set_reshard_after_backward(True)

    def chunk_weights_done(self, chunk: int) -> None:
        """The chunk's last gradients came from a weight half, after its last backward: FSDP2 reduces in
        a backward's post-backward, and none is left to run it, so run it now (armed: it reduce-scatters).

        FSDP2 has no public call for this; its root's post-backward callback is what
        torch.distributed.pipelining's stages call for the same reason (``perform_reduce_grad``). Every
        parameter group of the root is idle after its last backward, and the callback runs the
        post-backward of each idle group: the unsharded gradients the weight halves accumulated are
        reduce-scattered (and all-reduced across replicas with HSDP) into the shards. ``arm_chunk`` ran
        before that W (it is the chunk's last gradient action), so the root already reduces and reshards."""
        fully_shard.state(self.roots[chunk])._root_post_backward_final_callback()  # armed by arm_chunk before the W

    def arm(self, loss_sum: torch.Tensor) -> None:
        """Nothing more: each chunk's root was armed before its own last backward."""

    @staticmethod
    def _sync(root: nn.Module, last: bool) -> None:
        assert isinstance(root, FSDPModule)
        root.set_requires_gradient_sync(last)
        root.set_is_last_backward(last)

    def finish(self) -> None:
        with torch.no_grad():
            for dp, p in zip(self.dparams, self.params):
                p.grad = dp.grad.to_local() if dp.grad is not None else torch.zeros_like(p)
            sum_over_tp(self.params, *self.summed_over_tp)

    def squared_norm(self) -> torch.Tensor:
        """Sum of squares of this shard's gradients (the global norm sums it over the fsdp and pp groups)."""
        split, whole = self.squared_norms()
        return split + whole

    def squared_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums of squares of this shard's tp-split and of its other gradients (with tp > 1 the global norm
        sums the first over the tp group too)."""
        return squared_norms_by_split(self.params, self.split)

    def scale_(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)


class TracedAllGather:
    """FSDP2's all-gather, timed into the owner's ``comm_log`` when the step is traced (what
    ``set_custom_all_gather`` takes: ``allocate`` and a call, as torch's ``AllGather`` declares)."""

    def __init__(self, owner: ShardedLayers):
        self.owner = owner

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        t0 = time.perf_counter()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        _log(self.owner.comm_log, "all-gather", t0, work)
        return work


class TracedReduceScatter:
    """FSDP2's reduce-scatter, timed into the owner's ``comm_log`` when the step is traced."""

    def __init__(self, owner: ShardedLayers):
        self.owner = owner

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        t0 = time.perf_counter()
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        _log(self.owner.comm_log, "reduce-scatter", t0, work)
        return work


def _log(log: CommLog, name: str, t0: float, work) -> None:
    """Record a collective from its start to its end: now for a blocking one, when its future
    completes for an asynchronous one (a prefetched all-gather)."""
    if log is None:
        return
    if work is None:
        log.append((name, t0, time.perf_counter()))
    else:
        work.get_future().add_done_callback(lambda _: log.append((name, t0, time.perf_counter())))
