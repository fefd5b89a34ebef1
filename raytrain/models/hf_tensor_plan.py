"""A Hugging Face family's tensor-parallel plan, read from its config's ``base_model_tp_plan``.

transformers declares per family which projections of a decoder layer split by columns or by rows
(``"layers.*.self_attn.q_proj": "colwise"``). raytrain maps the two plain styles onto its own plan
(raytrain.models.tensor_plan) for each cut decoder layer; a family whose layers need any other style
(packed or fused projections, experts, norms whose gradient must be summed over the tp group) is
refused for parallel.tp, with the style named, before any actor starts.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from raytrain.models.tensor_plan import Plan

LAYER_PREFIX = "layers.*."
"""How a base-model plan names a submodule of every decoder layer."""
PLAIN_STYLES = ("colwise", "rowwise")


def declared_plan(config) -> dict[str, str]:
    """The family's ``base_model_tp_plan`` entries for its decoder layers, relative to one layer."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    return {key[len(LAYER_PREFIX):]: style for key, style in plan.items() if key.startswith(LAYER_PREFIX)}


def decoder_layer_plan(config) -> Plan:
    """raytrain's plan for one decoder layer (its wrapper holds the layer as ``layer``): the plain
    colwise / rowwise entries, one part each (transformers' plain styles split unfused projections)."""
    return {f"layer.{name}": (style, 1) for name, style in declared_plan(config).items() if style in PLAIN_STYLES}


def tp_problem(config, decoder_layer: nn.Module, tp: int) -> Optional[str]:
    """Why ``tp`` ranks cannot split this family's decoder layers (None when they can)."""
    declared = declared_plan(config)
    if not declared:
        return "its config declares no tensor-parallel plan for its decoder layers (base_model_tp_plan)"
    for name, style in declared.items():
        if style not in PLAIN_STYLES:
            return (f"its plan splits {name} as {style!r}, and raytrain splits only plain colwise / rowwise "
                    "linears")
        try:
            module = decoder_layer.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear):
            return f"its plan names {name}, which is not a linear layer in this model"
    text = config.get_text_config()
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and value % tp:
            return f"parallel.tp={tp} does not divide its {key}={value} (each tp rank holds 1/tp of them)"
    return None

