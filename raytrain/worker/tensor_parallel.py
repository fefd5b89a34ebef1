"""A stage's layers split over its tp group with DTensor tensor parallelism (``parallelize_module``).

Contract, as raytrain.worker.sharded's for FSDP2: ``TensorParallelLayers(cfg, layer_ids, index, tp, device)``
holds this tp rank's part of every parameter of its stage as plain tensors (``params``, in the stage's
parameter order), cut by each layer's plan (raytrain.models.tensor_plan: colwise and rowwise linears
split, everything else whole) from the values every layout gives them: the stage is built on the meta
device and each layer is materialised alone (raytrain.worker.stage_values), by the built-in GPT's
(seed, layer index) rule or from a Hugging Face directory's weights, to take this rank's boxes of it
(``slices``: what checkpoints record). Every generation, ``wrap(groups, mesh, rank,
optimizer)`` parallelises a fresh meta copy of the stage over a 1-D device mesh made from that
generation's tp group (``DeviceMesh.from_group``), copies ``params`` into it and re-points ``params`` and
the optimizer at its local tensors: a wrapping holds one generation's groups, which die with it, while
the values and AdamW's state are plain tensors that survive a re-forming.

Gradients: a split parameter's gradient is its DTensor gradient's local part (redistributed to the
parameter's own placement first, should autograd leave it partial); a replicated parameter (norms,
positions, a table or head tp cannot split by vocabulary, rowwise biases) sees the same full activations and output gradients on every tp rank
(ColwiseParallel all-reduces its input's gradient), so its gradient is whole and identical there, but
for a per-head norm's (``replicated_grad_sum``: each rank's covers its heads), summed over the tp
group. A plain part (a bare parameter's rows, an expert's slice) has its own local gradient; a mixture's
router stays whole, its gradient identical once the experts' input gradients are summed over the tp group.
With dp > 1 they are summed over the dp group (``TensorParallelGrads``). The global norm counts the split
parameters' squares summed over the tp group and the replicated ones once (raytrain.worker.gradsync).

This class serves parallel.tp alone (with dp and pp); with parallel.fsdp > 1 the stage is 2-D and
raytrain.worker.sharded's ``ShardedLayers`` applies ``parallelize_layers`` before FSDP2.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from raytrain.checkpoint.assemble import slices_entry, stack_dim
from raytrain.compat import clear_dtensor_sharding_cache
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.models.layers import persistent_buffer_names
from raytrain.models.tensor_plan import (EXPERT_SPLITS, PARAM_ROWS, SEQUENCE_REGION, SEQUENCE_REGIONS, SUMMED_EXPERTS,
                                         TAIL_GRAD_SUM, VOCAB_EMBEDDING, VOCAB_PARALLEL, Box, layer_plan,
                                         sequence_parallel, split_of)
from raytrain.worker.compiling import as_run
from raytrain.worker.executor import cut_into_chunks
from raytrain.worker.groups import Groups
from raytrain.worker.gradsync import all_reduce_flat, squared_norms_by_split, sum_over_tp
from raytrain.worker.stage_values import meta_stage, tp_grad_summed, tp_parts
from raytrain.worker.wrapping import adopt

STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    VOCAB_PARALLEL: lambda: ColwiseParallel(use_local_output=False),  # logits stay a DTensor: loss_parallel's input
    VOCAB_EMBEDDING: lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
}
"""raytrain.models.tensor_plan's split styles as torch's; the whole-module one needs no parallelising."""
TOKENS = Shard(1)
"""Activations split by tokens (batch, sequence, width): between the split linears of a sequence-parallel layer."""
SEQUENCE_STYLES = {
    "colwise": lambda: ColwiseParallel(input_layouts=TOKENS),
    "rowwise": lambda: RowwiseParallel(output_layouts=TOKENS),
    VOCAB_PARALLEL: lambda: ColwiseParallel(input_layouts=TOKENS, use_local_output=False),
    VOCAB_EMBEDDING: STYLES[VOCAB_EMBEDDING],  # summed whole; the layer's sequence_scatter keeps the rank's tokens
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "sequence_scatter": lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=TOKENS,
                                                    use_local_output=True),
    "sequence_gather": lambda: PrepareModuleInput(input_layouts=TOKENS, desired_input_layouts=Replicate(),
                                                  use_local_output=True),
}
"""The same styles in a sequence-parallel layer (raytrain.models.tensor_plan.sequence_parallel), as torchtitan
applies them: colwise linears all-gather the tokens, rowwise ones reduce-scatter to them."""
IN_REGION_STYLES = {
    **STYLES,
    "rowwise": SEQUENCE_STYLES["rowwise"],
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=TOKENS),
}
"""The styles inside a ``sequence_region`` (its input already gathered whole): colwise linears take it as
it is, rowwise ones reduce-scatter to the rank's tokens. Inside a ``sequence_region_whole_output``: STYLES."""


def local_part(value: torch.Tensor, boxes: list[Box]) -> torch.Tensor:
    """The boxes of ``value`` stacked along the dim they differ in (a copy): what a tp rank holds of it."""
    return torch.cat([value[tuple(slice(a, b) for a, b in box)] for box in boxes], dim=stack_dim(boxes)).clone()


def parallelize_layers(layers: list[nn.Module], tp_mesh: DeviceMesh, sequence: bool) -> list[nn.Module]:
    """Apply each layer's plan (raytrain.models.tensor_plan; its sequence-parallel entries with ``sequence``)
    over ``tp_mesh``, in place; the layers."""
    for layer in layers:
        plan = layer_plan(layer, tp_mesh.size(), sequence)
        parallel = {}
        for name, (style, _) in plan.items():
            table = _style_table(plan, name)
            if style in table:  # the others are hooks or plain parts, below
                parallel[name] = table[style]()
        if sequence_parallel(plan) and hasattr(layer, "tokens_split_by"):
            layer.tokens_split_by = tp_mesh.size()  # it builds positions and masks of the whole sequence
        whole = parallel.pop("", None)  # a style of the layer itself
        if whole is not None:
            parallelize_module(layer, tp_mesh, whole, src_data_rank=None)
        if parallel:  # every rank holds the same (meta) values: no scatter from a source rank
            parallelize_module(layer, tp_mesh, parallel, src_data_rank=None)
        for name, (style, features) in plan.items():
            if style == TAIL_GRAD_SUM:
                layer.get_submodule(name).register_forward_hook(_tail_grad_sum(features, tp_mesh.get_group()))
            if style == PARAM_ROWS or style in EXPERT_SPLITS:
                _keep_part(layer, name, split_of(plan, name)[2], tp_mesh.size())
            if style == SUMMED_EXPERTS:
                _sum_experts(layer.get_submodule(name), tp_mesh.get_group())
            if style in SEQUENCE_REGIONS:
                _run_on_every_token(layer.get_submodule(name), tp_mesh)
    return layers


def _style_table(plan, name: str) -> dict:
    """The torch styles for entry ``name`` of ``plan``: as without sequence parallelism, but for a
    sequence-parallel layer's, where a ``sequence_region`` holding the entry sets its own."""
    if not sequence_parallel(plan):
        return STYLES
    region = next((region for region, (style, _) in plan.items()
                   if style in SEQUENCE_REGIONS and name.startswith(f"{region}.")), None)
    if region is None:
        return SEQUENCE_STYLES
    return IN_REGION_STYLES if plan[region][0] == SEQUENCE_REGION else STYLES


def _run_on_every_token(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Hooks making ``module`` a sequence region: its hidden states (its first argument, or
    ``hidden_states``) gathered from every rank's tokens, and its output (or its output's first tensor)
    cut to the rank's tokens unless a rowwise linear has cut it already. The gather's backward keeps the
    rank's tokens of a gradient that is whole on every rank (colwise linears sum theirs over the tp group)."""
    def whole(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(module).__name__} (a sequence region) took an input of shape {tuple(x.shape)}, "
                             "not (batch, tokens, width): set parallel.sequence_parallel=false for this model")
        return _tokens(x, tp_mesh, TOKENS, Replicate()).clone()  # its own: a module may change it in place

    def gather(_, args, kwargs):
        if args:
            return (whole(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(module).__name__} (a sequence region) was called with neither a positional "
                            "input nor hidden_states")
        return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}

    def cut(_, args, kwargs, output):
        first = output[0] if isinstance(output, tuple) else output
        hidden = args[0] if args else kwargs["hidden_states"]
        if first.shape[1] == hidden.shape[1] // tp_mesh.size():
            return output  # a rowwise linear reduce-scattered it
        if first.shape[1] != hidden.shape[1]:
            raise RuntimeError(f"{type(module).__name__} (a sequence region) returned {first.shape[1]} tokens of "
                               f"{hidden.shape[1]}: neither the whole sequence nor this rank's part")
        mine = _tokens(first, tp_mesh, Replicate(), TOKENS)
        return (mine, *output[1:]) if isinstance(output, tuple) else mine

    module.register_forward_pre_hook(gather, with_kwargs=True)
    module.register_forward_hook(cut, with_kwargs=True)


def _tokens(x: torch.Tensor, tp_mesh: DeviceMesh, held, wanted) -> torch.Tensor:
    """``x`` (a local tensor laid out as ``held`` over ``tp_mesh``) redistributed to ``wanted``, local again."""
    return DTensor.from_local(x, tp_mesh, [held], run_check=False).redistribute(tp_mesh, [wanted]).to_local()


def _keep_part(layer: nn.Module, name: str, dim: int, tp: int) -> None:
    """Make the (meta) parameter ``name`` of ``layer`` a plain one of 1/tp of its dim ``dim``: the rank's part,
    which its module reads as it reads its rank's heads (param_rows) or its rank's slice of every expert
    (expert_colwise, expert_rowwise). Not a DTensor: the module mixes it with local tensors; its gradient
    is the rank's own."""
    owner, _, leaf = name.rpartition(".")
    module = layer.get_submodule(owner)
    whole = getattr(module, leaf)
    shape = list(whole.shape)
    shape[dim] //= tp
    module.register_parameter(leaf, nn.Parameter(whole.new_empty(shape)))


def _sum_experts(experts: nn.Module, group: dist.ProcessGroup) -> None:
    """Hooks on a module of experts split over ``group`` (summed_experts): each rank's output is its slices'
    part of every expert's, summed over the group (the backward passes the whole gradient to each); its
    hidden states' and routing weights' gradients are parts too, summed in the backward."""
    def inputs(_, args, kwargs):
        return (tuple(_sum_its_gradient(a, group) for a in args),
                {key: _sum_its_gradient(value, group) for key, value in kwargs.items()})

    experts.register_forward_pre_hook(inputs, with_kwargs=True)
    experts.register_forward_hook(lambda _, args, output: _SumForward.apply(output, group))


def _sum_its_gradient(x, group: dist.ProcessGroup):
    differentiable = isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad
    return _SumGradient.apply(x, group) if differentiable else x


def _tail_grad_sum(features: int, group: dist.ProcessGroup):
    """A forward hook: the last ``features`` of the output pass through unchanged, their gradient summed
    over ``group`` (raytrain.models.tensor_plan: tail_grad_sum)."""
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        head, tail = output.split([output.shape[-1] - features, features], dim=-1)
        return torch.cat([head, _SumGradient.apply(tail, group)], dim=-1)

    return hook


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over a process group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """The sum over a process group in forward; the gradient passed through in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TensorParallelLayers:
    """This tp rank's part of its stage's parameters, and the tensor-parallel wrapping of each generation."""

    rows = None  # a tp rank holds boxes (``slices``), not FSDP's rows

    def __init__(self, cfg: Config, layer_ids: list[int], index: int, tp: int, device: torch.device,
                 chunk_lengths: Optional[list[int]] = None):
        self.cfg, self.index, self.tp, self.device = cfg, index, tp, device
        self.chunk_lengths = chunk_lengths
        """Layers of each model chunk (virtual stages); the chunks are views of the parallelised stage."""
        self.meta_layers, self.names, self.loss_fn, full_values, buffers = meta_stage(cfg, layer_ids)
        self.slices: list[list] = []
        """Of each parameter, the boxes of the whole that this rank holds, stacked along one dim, as the
        checkpoint's ``slices`` record them (raytrain.checkpoint.assemble.slices_entry)."""
        self.params: list[torch.Tensor] = []
        self.split: list[bool] = []
        """Whether each parameter is split over the tp group (else every tp rank holds it whole)."""
        self.summed = tp_grad_summed(self.meta_layers)
        """Whether each whole parameter's gradient is summed over the tp group (a per-head norm's)."""
        for value, (boxes, split) in zip(full_values(), tp_parts(self.meta_layers, tp, index)):
            self.slices.append(slices_entry(boxes, tuple(value.shape)))
            self.split.append(split)
            self.params.append(local_part(value, boxes).to(device))
        self.buffers = [b.to(device) for b in buffers]
        self.module: Optional[nn.Module] = None
        self.chunks: list[nn.Module] = []
        self.comm_log = None  # the trace of FSDP's collectives; DTensor's are not traced
        self.buffer_names = persistent_buffer_names(self.meta_layers, layer_ids)
        self.part = index  # one file per tp rank
        self.written = self.split if index > 0 else None  # rank 0 writes the parameters every rank holds whole

    def wrap(self, groups: Groups, mesh: Mesh, rank: int, optimizer: torch.optim.Optimizer) -> "TensorParallelGrads":
        """Parallelise a fresh copy of the stage on this generation's tp group, holding the current values;
        ``params`` and ``optimizer`` then step its local tensors. Collective-free."""
        assert mesh.tp == self.tp and mesh.tp_index(rank) == self.index, (mesh, rank, self.index)
        tp_mesh = DeviceMesh.from_group(groups.tp_group, self.device.type, mesh_dim_names=("tp",))
        layers = parallelize_layers(copy.deepcopy(self.meta_layers), tp_mesh, self.cfg.parallel.sequence_parallel)
        module = nn.Sequential(*as_run(layers, self.cfg.train))
        dparams = adopt(module, self.device, self.buffers, self.params, optimizer)
        self.module, self.chunks = module, cut_into_chunks(module, self.chunk_lengths)
        return TensorParallelGrads(dparams, self.params, self.split, groups.dp_group,
                                   (self.summed, groups.tp_group))

    def release(self) -> None:
        """Drop the wrapping (its groups are going); ``params`` keep the values and the prepared gradients.
        DTensor's sharding cache holds the device mesh: cleared too (raytrain.worker.sharded says why)."""
        self.module, self.chunks = None, []
        clear_dtensor_sharding_cache()


class TensorParallelGrads:
    """GradientBuckets' contract for a tensor-parallel stage: ``zero`` before a step, ``arm`` before its
    last backward (nothing to do: gradients accumulate locally), ``finish`` after it (local gradients
    onto ``params``, a per-head norm's summed over the tp group, all summed over the dp group), then the
    norm and scaling act on them."""

    carries_vote = False  # the step's vote is a world-wide collective of its own (raytrain.worker.stage)

    def __init__(self, dparams: list[nn.Parameter], params: list[torch.Tensor], split: list[bool],
                 dp_group: Optional[dist.ProcessGroup],
                 summed_over_tp: tuple[list[bool], Optional[dist.ProcessGroup]] = ((), None)):
        self.dparams, self.params, self.split, self.group = dparams, params, split, dp_group
        self.summed_over_tp = summed_over_tp

    def zero(self) -> None:
        for p in self.dparams + self.params:
            p.grad = None

    def arm_chunk(self, chunk: int) -> None:
        pass

    def chunk_weights_done(self, chunk: int) -> None:
        pass

    def arm(self, loss_sum: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        with torch.no_grad():
            for dp, p in zip(self.dparams, self.params):
                p.grad = _local_grad(dp, p)
            sum_over_tp(self.params, *self.summed_over_tp)
            all_reduce_flat([p.grad for p in self.params], self.group)

    def squared_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums of squares of this rank's split and of its replicated gradients (the global norm sums the
        first over the tp group and counts the second once)."""
        return squared_norms_by_split(self.params, self.split)

    def squared_norm(self) -> torch.Tensor:
        """This rank's sum of squares (finite exactly when every gradient it holds is)."""
        split, whole = self.squared_norms()
        return split + whole

    def scale_(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)


def _local_grad(dparam: nn.Parameter, param: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of ``param``: a DTensor's local part, in the parameter's own placement."""
    grad = dparam.grad
    if grad is None:
        return torch.zeros_like(param)
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != tuple(dparam.placements):
            grad = grad.redistribute(dparam.device_mesh, dparam.placements)
        grad = grad.to_local()
    return grad
