"""The model, built once on the driver before any actor starts: its layers counted, cut into stages, and
what the run needs of it (``ModelFacts``) kept; a model that cannot take the layout is refused by name.

The built-in GPT is counted by arithmetic and built (on the meta device) only to balance its cuts, so a
run at pp=1 keeps torch out of the driver; a Hugging Face model is built on the meta device; a
model.factory (or the Python API's model) is built for real, once, as its workers will build it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from raytrain.config import Config, check_shardable
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts, Tie
from raytrain.models.memory import builtin_gpt_layers

def needs_build(cfg: Config) -> bool:
    """Whether prepare builds the model: every model but the built-in GPT at one chunk with hand-set or
    no cuts, which arithmetic answers."""
    if cfg.model.factory is not None or cfg.model.hf is not None:
        return True
    return cfg.gpt_layout().needs_cuts or cfg.parallel.auto


def model_layers(cfg: Config) -> list:
    """The model's cuttable layers: on the meta device where raytrain builds them (the built-in GPT, a
    Hugging Face model), for real for a model.factory (its values are its own: they are built as the
    workers will build them)."""
    import torch

    from raytrain.models.layers import build_model

    if cfg.model.hf is not None:
        from raytrain.models.hf_weights import hf_layers

        return hf_layers(cfg.model.hf, cfg.model.hf_cut, cfg.model.trust_remote_code)[1]
    if cfg.model.factory is None:
        with torch.device("meta"):
            return build_model(cfg.model, cfg.train.seed).layers
    return build_model(cfg.model, cfg.train.seed).layers


def model_facts(cfg: Config, layers: Optional[list]) -> ModelFacts:
    """What the run needs of the model: each layer's parameter count, how far fsdp may cut it, and the
    parameters layers share; by arithmetic for the built-in GPT when it was not built."""
    if layers is None:
        m = cfg.model
        counts, max_fsdp = builtin_gpt_layers(m.n_layer, m.d_model, m.vocab_size, m.seq_len)
        return ModelFacts(tuple(counts), max_fsdp)
    counts = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return ModelFacts(counts, shardable_rows(layers), find_ties(layers))


def find_ties(layers: list) -> tuple[Tie, ...]:
    """Parameters held by more than one layer, each under its global name (its first layer's)."""
    holders: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if index not in holders.setdefault(id(param), []):
                holders[id(param)].append(index)
            names.setdefault(id(param), f"{index}.{name}")
    return tuple(Tie(names[key], tuple(held)) for key, held in holders.items() if len(held) > 1)


def shardable_rows(layers: list) -> int:
    """The most shards parallel.fsdp may cut these layers into: the rows (dim 0, what FSDP cuts) of the
    largest parameter, so every shard owns some; 1 when a parameter is a scalar, which FSDP cannot cut."""
    shapes = [p.shape for layer in layers for p in layer.parameters()]
    return 1 if any(len(shape) == 0 for shape in shapes) else max((shape[0] for shape in shapes), default=1)


def plan_layout(cfg: Config, layers: Optional[list] = None) -> Layout:
    """The configured layout with the model's layer count and stage cuts (parallel.split_points, else
    balanced by parallel.balance); a ValueError naming parallel.pp or parallel.split_points when the
    model cannot be cut so. ``layers``: the model's, when the caller built them (else built here, when
    needed). Needs model.factory importable (raytrain.driver.plan.check_inputs)."""
    if cfg.model.hf is not None:
        return _hf_layout(cfg, layers if layers is not None else model_layers(cfg))
    if cfg.model.factory is None:
        layout = cfg.gpt_layout()
        if not layout.needs_cuts:
            return layout
        layers = layers if layers is not None and cfg.parallel.balance == "params" else _gpt_layers_to_cut(cfg)
    else:
        layers = layers if layers is not None else model_layers(cfg)
        layout = Layout.of(cfg.parallel).for_model(len(layers), "model.factory")
        check_shardable(layout.fsdp, shardable_rows(layers), "model.factory's largest parameter (or it has a scalar)")
        _check_factory_plan(cfg, layers)
        if not layout.needs_cuts:
            return layout
    from raytrain.pipeline.partition import plan_cuts

    return dataclasses.replace(layout, cuts=tuple(plan_cuts(layers, layout.num_chunks, _timing_input(cfg))))


def _gpt_layers_to_cut(cfg: Config) -> list:
    """The built-in GPT's layers with values, to time them (parallel.balance=time); on the meta device
    when only their parameter counts are wanted."""
    from raytrain.models.layers import build_model

    if cfg.parallel.balance == "params":
        return model_layers(cfg)
    return build_model(cfg.model, cfg.train.seed).layers


def _check_factory_plan(cfg: Config, layers: list) -> None:
    """parallel.tp > 1 needs the factory's layers to declare a plan their linears fit."""
    from raytrain.models.tensor_plan import plan_problem

    problem = plan_problem(layers, cfg.parallel.tp, cfg.parallel.sequence_parallel) if cfg.parallel.tp > 1 else None
    if problem is not None:
        raise ValueError(f"parallel.tp={cfg.parallel.tp}: model.factory={cfg.model.factory!r} cannot be split: "
                         f"{problem}. Declare tp_plan on its layers (README: Any model) or use parallel.fsdp")


def _hf_layout(cfg: Config, layers: list) -> Layout:
    """A Hugging Face model's layout: cut by parameter counts of its meta-device layers (or timed)."""
    from raytrain.models.hf_plan import check_ties, hf_layout
    from raytrain.pipeline.partition import plan_cuts

    layout = hf_layout(cfg, layers)
    check_shardable(layout.fsdp, shardable_rows(layers), "model.hf's largest parameter (or it has a scalar)")
    if layout.needs_cuts:
        if cfg.parallel.balance == "time":
            raise ValueError("parallel.balance=time builds the whole model on the driver to time its layers, which "
                             "model.hf does not do; use parallel.balance=params or parallel.split_points")
        layout = dataclasses.replace(layout, cuts=tuple(plan_cuts(layers, layout.num_chunks)))
    check_ties(cfg, layers, layout)
    return layout


def _timing_input(cfg: Config):
    """One micro-batch of token ids to time the layers on (parallel.balance=time), else None."""
    if cfg.parallel.balance != "time":
        return None
    import torch

    layout = cfg.layout()
    micro_batch = max(1, cfg.train.global_batch // (layout.mesh.columns * layout.microbatches))
    return torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long)
