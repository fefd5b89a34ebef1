"""A Hugging Face family's tensor-parallel plan, read from its config's ``base_model_tp_plan``.

transformers declares per family which projections of a decoder layer split by columns or by rows
(``"layers.*.self_attn.q_proj": "colwise"``). raytrain maps the plain styles and
``replicated_with_grad_allreduce`` (a per-head norm: Qwen3's, Gemma 3's q_norm and k_norm) onto its own
plan (raytrain.models.tensor_plan) for each cut decoder layer; a family whose layers need any other
style (packed, gathered or fused projections, experts) is refused for parallel.tp, with the style
named, before any actor starts.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from raytrain.models.tensor_plan import GRAD_SUM, Plan

LAYER_PREFIX = "layers.*."
"""How a base-model plan names a submodule of every decoder layer."""
STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": GRAD_SUM}
"""transformers' style -> raytrain's, for the styles raytrain applies."""


def declared_plan(config) -> dict[str, str]:
    """The family's ``base_model_tp_plan`` entries for its decoder layers, relative to one layer."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    return {key[len(LAYER_PREFIX):]: style for key, style in plan.items() if key.startswith(LAYER_PREFIX)}


def decoder_layer_plan(config) -> Plan:
    """raytrain's plan for one decoder layer (its wrapper holds the layer as ``layer``): the entries of
    the styles it applies, one part each (transformers' plain styles split unfused projections)."""
    return {f"layer.{name}": (STYLES[style], 1) for name, style in declared_plan(config).items() if style in STYLES}


def tp_problem(config, decoder_layer: nn.Module, tp: int) -> Optional[str]:
    """Why ``tp`` ranks cannot split this family's decoder layers (None when they can)."""
    declared = declared_plan(config)
    if not declared:
        return "its config declares no tensor-parallel plan for its decoder layers (base_model_tp_plan)"
    for name, style in declared.items():
        if style not in STYLES:
            return (f"its plan splits {name} as {style!r}, and raytrain applies only "
                    f"{', '.join(map(repr, STYLES))}")
        try:
            module = decoder_layer.get_submodule(name)
        except AttributeError:
            module = None
        if STYLES[style] == GRAD_SUM:
            if module is None:
                return f"its plan names {name}, which this model's decoder layers do not have"
        elif not isinstance(module, nn.Linear):
            return f"its plan names {name}, which is not a linear layer in this model"
    text = config.get_text_config()
    partial = (getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:  # Phi ends 4.8e-4 from one process after one step at tp=2 (2.5e-5 at fsdp=2), and
        # matches with full rotary: unexplained yet (a tp fault, or AdamW amplifying noise on tiny gradients)
        return (f"its rotary embedding covers part of each head (partial_rotary_factor={partial}), which "
                "raytrain's tensor parallelism does not yet match one process on")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and value % tp:
            return f"parallel.tp={tp} does not divide its {key}={value} (each tp rank holds 1/tp of them)"
    return None

