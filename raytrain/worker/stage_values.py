"""A stage's layers on the meta device and each parameter's full initial value, one layer at a time.

What a worker that holds only part of each parameter (an fsdp shard: raytrain.worker.sharded; a tp
rank: raytrain.worker.tensor_parallel) starts from: it takes its part of each value as the generator
yields it, so it never holds more of the full model than one layer (a model.factory model, or a stage
whose layers share a parameter, is built whole, once).
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain.config import Config
from raytrain.models.layers import build_model
from raytrain.models.tensor_plan import grad_summed, layer_plan, local_boxes, split_of


def tp_parts(meta_layers: list[nn.Module], tp: int, index: int) -> list[tuple[list, bool]]:
    """(boxes tp rank ``index`` holds, whether split) of every parameter of the stage, in order; with
    tp == 1, ``(None, False)`` each."""
    if tp == 1:
        return [(None, False)] * sum(1 for layer in meta_layers for _ in layer.parameters())
    return [(local_boxes(layer_plan(layer, tp), name, tuple(p.shape), tp, index),
             split_of(layer_plan(layer, tp), name) is not None)
            for layer in meta_layers for name, p in layer.named_parameters()]


def tp_grad_summed(meta_layers: list[nn.Module]) -> list[bool]:
    """Of every parameter of the stage, in order: whether its gradient is summed over the tp group
    (whole on every rank, it sees only the rank's heads: raytrain.models.tensor_plan)."""
    return [grad_summed(layer_plan(layer), name) for layer in meta_layers for name, _ in layer.named_parameters()]


def meta_stage(cfg: Config, layer_ids: list[int]):
    """The stage's layers on the meta device, their global parameter names, the loss, a generator of
    each parameter's full initial value in that order (one layer's at a time for the built-in GPT and
    a model.hf stage; a model.factory's, or a stage whose layers share a parameter, is built whole,
    once) and the stage's buffers (filled in as the generator runs)."""
    seed, buffers = cfg.train.seed, []
    by_layer = _hf_stage_by_layer(cfg, layer_ids) if cfg.model.hf is not None else None
    if by_layer is not None:
        return by_layer
    if cfg.model.factory is None and cfg.model.hf is None:
        with torch.device("meta"):
            spec = build_model(cfg.model, seed, layer_ids)

        def values():
            for layer_id in layer_ids:
                layer = build_model(cfg.model, seed, [layer_id]).layers[0]
                buffers.extend(b.detach().clone() for b in layer.buffers())
                yield from (p.detach() for p in layer.parameters())
    else:
        spec = build_model(cfg.model, seed, layer_ids)
        stage = nn.Sequential(*spec.layers)
        built = [p.detach().clone() for p in stage.parameters()]
        buffers += [b.detach().clone() for b in stage.buffers()]
        _to_meta_keeping_ties(stage)

        def values():
            while built:
                yield built.pop(0)
    return spec.layers, spec.param_names(), spec.loss_fn, values, buffers


def _hf_stage_by_layer(cfg: Config, layer_ids: list[int]):
    """``meta_stage`` for a Hugging Face stage, one layer materialised at a time (a worker never holds
    more of the full model than one layer); None when its layers share a parameter (tied embeddings)."""
    from raytrain.models.hf_weights import hf_layers
    from raytrain.models.layers import ModelSpec, cross_entropy_loss

    _, every = hf_layers(cfg.model.hf, cfg.model.hf_cut, cfg.model.trust_remote_code)
    meta = [every[i] for i in layer_ids]
    stage = nn.Sequential(*meta)
    if len({id(p) for p in stage.parameters()}) < sum(1 for layer in meta for _ in layer.parameters()):
        return None
    buffers: list[torch.Tensor] = []
    stage_buffers = list(stage.buffers())  # shared ones (the rotary tables of every decoder layer) once

    def values():
        real: dict[int, torch.Tensor] = {}
        for layer_id, meta_layer in zip(layer_ids, meta):
            layer = build_model(cfg.model, cfg.train.seed, [layer_id]).layers[0]
            for (_, shell), (_, value) in zip(meta_layer.named_buffers(remove_duplicate=False),
                                              layer.named_buffers(remove_duplicate=False)):
                real.setdefault(id(shell), value.detach().clone())
            yield from (p.detach() for p in layer.parameters())
        buffers.extend(real[id(b)] for b in stage_buffers)

    spec = ModelSpec(meta, layer_ids, len(every), cross_entropy_loss)
    return spec.layers, spec.param_names(), spec.loss_fn, values, buffers


def _to_meta_keeping_ties(module: nn.Module) -> None:
    """Free ``module``'s storage, leaving it on the meta device with its parameter objects (and so a
    parameter two layers share stays one): swapped, not replaced."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device="meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
