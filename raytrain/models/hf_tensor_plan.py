"""A Hugging Face family's tensor-parallel plan, read from its config's ``base_model_tp_plan``.

transformers declares per family which projections of a decoder layer split by columns or by rows
(``"layers.*.self_attn.q_proj": "colwise"``). raytrain maps the plain styles, the gathered ones
(``colwise_gather_output``, ``rowwise_split_input``: OLMo 2, Phi-3) and ``replicated_with_grad_allreduce``
(a per-head norm: Qwen3's, Gemma 3's q_norm and k_norm), ``mla_kv_a_proj`` (DeepSeek-V2's latent
attention: ``tail_grad_sum``) and ``colwise`` on a bare parameter with ``local_params`` on its module
(the attention sinks of Granite SWA, its MoE and MiMo-V2-Flash, one per head: ``param_rows``) onto
its own plan (raytrain.models.tensor_plan) for each cut decoder layer. A mixture of experts (Mixtral's
``moe_tp_experts``) splits every expert's packed gate and up and its down projection over the tp ranks,
each rank running its slice of every expert and the parts summed (``experts_plan``); its router stays
whole (its input, and, once summed, its gradients are the same on every rank). Experts the plan does
not split that way (a bias of their own) stay whole on every rank. A family whose layers need any
other style (packed projections outside experts, embeddings split inside a layer) is refused for
parallel.tp, with the style named, before any actor starts. No family declares sequence parallelism:
raytrain's own entries (``sequence_plan``) split the tokens between a layer's submodules.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from raytrain.models.tensor_plan import (EXPERT_COLWISE, EXPERT_ROWWISE, GRAD_SUM, PARAM_ROWS, SEQUENCE_REGION,
                                         SUMMED_EXPERTS, TAIL_GRAD_SUM, WHOLE_OUTPUT_REGION, TpPlan, param_split_problem)

LAYER_PREFIX = "layers.*."
"""How a base-model plan names a submodule of every decoder layer."""
STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_gather_output",
          "rowwise_split_input": "rowwise_split_input", "replicated_with_grad_allreduce": GRAD_SUM,
          "mla_kv_a_proj": TAIL_GRAD_SUM}
"""transformers' style -> raytrain's, for the styles raytrain applies."""
LOCAL_PARAMS = "local_params"
"""transformers' style for a module that reads a split bare parameter of its own (attention sinks) with
local tensors: raytrain's split linears return local tensors already, so it needs nothing more."""
EXPERTS = "moe_tp_experts"
"""transformers' style for a module of experts, whose output its split weights' parts sum to."""
EXPERT_STYLES = {"packed_colwise": (EXPERT_COLWISE, 2), "colwise": (EXPERT_COLWISE, 1), "rowwise": (EXPERT_ROWWISE, 1)}
"""transformers' styles on an (experts, out, in) weight -> raytrain's entries."""


def declared_plan(config) -> dict[str, str]:
    """The family's ``base_model_tp_plan`` entries for its decoder layers, relative to one layer, but
    for the experts' (``experts_plan`` reads those)."""
    return {name: style for name, style in _layer_entries(config).items()
            if not any(name == e or name.startswith(f"{e}.") for e in _experts(config))}


def decoder_layer_plan(config, decoder_layer: Optional[nn.Module] = None) -> TpPlan:
    """raytrain's plan for one decoder layer (its wrapper holds the layer as ``layer``): the entries of
    the styles it applies, one part each (transformers' plain styles split unfused projections), for
    the submodules ``decoder_layer`` has when given (a plan names optional ones: DeepSeek-V2's q_proj
    or q_b_proj, by q_lora_rank)."""
    plan = {f"layer.{name}": (STYLES[style], _second_field(config, style)) for name, style in declared_plan(config).items()
            if style in STYLES and (decoder_layer is None or _submodule(decoder_layer, name) is not None)}
    if decoder_layer is not None:  # a bare parameter split by heads (colwise in transformers' plan): param_rows
        plan.update({f"layer.{name}": (PARAM_ROWS, 1) for name, style in declared_plan(config).items()
                     if style == "colwise" and _parameter(decoder_layer, name) is not None})
        plan.update({f"layer.{name}": entry for name, entry in experts_plan(config, decoder_layer).items()})
        plan.update({name: entry for name, entry in sequence_plan(config, decoder_layer).items() if name not in plan})
    return plan


def experts_plan(config, decoder_layer: nn.Module) -> TpPlan:
    """The entries that split a decoder layer's module of experts (relative to the layer): each of its
    (experts, out, in) weights by the family's plan (``packed_colwise``: the packed gate and up, two parts;
    ``colwise``; ``rowwise``), and the module summed over the tp ranks (``moe_tp_experts``). None where
    the module holds a parameter the plan does not split that way (an expert's bias, a list of expert
    MLPs), or the family has experts that return their input (``moe_identity_expert``): those experts
    stay whole on every rank."""
    declared = _layer_entries(config)
    if "moe_identity_expert" in declared.values():
        return {}
    plan: TpPlan = {}
    for experts in _experts(config):
        module = _submodule(decoder_layer, experts)
        if module is None:
            continue
        splits = {f"{experts}.{name}": EXPERT_STYLES.get(declared.get(f"{experts}.{name}"))
                  for name, param in module.named_parameters() if param.dim() == 3}
        # a packed gate and up that the plan calls plain colwise would split gate from up
        packed_as_one = any("gate_up" in name and declared.get(name) == "colwise" for name in splits)
        if not splits or None in splits.values() or len(splits) < sum(1 for _ in module.parameters()) or packed_as_one:
            return {}
        plan.update(splits)
        plan[experts] = (SUMMED_EXPERTS, 1)
    return plan


def _layer_entries(config) -> dict[str, str]:
    """Every entry of the family's ``base_model_tp_plan`` for its decoder layers, relative to one layer."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    return {key[len(LAYER_PREFIX):]: style for key, style in plan.items() if key.startswith(LAYER_PREFIX)}


def sequence_plan(config, decoder_layer: nn.Module) -> TpPlan:
    """Sequence parallelism's entries for a decoder layer (kept by layer_plan only with
    parallel.sequence_parallel): its norms run on the rank's tokens, and every other child with
    parameters (the attention, the MLP or mixture of experts) is a ``sequence_region``: transformers'
    attention reads the sequence length off its input, so the region takes every token and hands back
    the rank's. One holding experts (summed whole over the ranks) keeps its rowwise linears' outputs
    whole too, to meet theirs. The residual adds between them run on the rank's tokens."""
    plan = {}
    for name, child in decoder_layer.named_children():
        if not any(True for _ in child.parameters()):
            continue
        experts = any(_submodule(decoder_layer, e) is not None for e in _experts(config) if e.startswith(f"{name}."))
        region = WHOLE_OUTPUT_REGION if experts else SEQUENCE_REGION
        plan[f"layer.{name}"] = ("sequence_parallel" if _is_norm(child) else region, 1)
    return plan


def _experts(config) -> list[str]:
    """The family's modules of experts, relative to one decoder layer."""
    return [name for name, style in _layer_entries(config).items() if style == EXPERTS]


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())


def runs_per_token(module: nn.Module) -> bool:
    """Whether ``module`` can run on each rank's tokens under parallel.sequence_parallel: a norm (its class
    says so; no submodules), or a module without parameters (whose gradients would be parts)."""
    return _is_norm(module) or not any(True for _ in module.parameters())


def sequence_problem(config, decoder_layer: nn.Module) -> Optional[str]:
    """Why a decoder layer's tokens cannot be split over the tp ranks between its submodules (None when
    they can): a parameter of the layer itself would see only the rank's tokens, and raytrain sums the
    gradients of the norms' parameters alone; experts the layer calls itself get its tokens flattened,
    not a (batch, tokens, width) input a region can gather."""
    own = next((name for name, _ in decoder_layer.named_parameters(recurse=False)), None)
    if own is not None:
        return f"its decoder layer holds a parameter of its own ({own}), which would see each rank's tokens alone"
    direct = next((e for e in _experts(config) if "." not in e and _submodule(decoder_layer, e) is not None), None)
    if direct is not None:
        return f"its decoder layer calls its experts ({direct}) itself, on flattened tokens"
    return None


def _second_field(config, style: str) -> int:
    """One part for every style, but the latent attention's: the width of its rotary key (tail_grad_sum)."""
    return getattr(config.get_text_config(), "qk_rope_head_dim", 0) if STYLES[style] == TAIL_GRAD_SUM else 1


def _submodule(module: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _parameter(module: nn.Module, name: str) -> Optional[nn.Parameter]:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def tp_problem(config, decoder_layer: nn.Module, tp: int) -> Optional[str]:
    """Why ``tp`` ranks cannot split this family's decoder layers (None when they can)."""
    declared = declared_plan(config)
    if not declared and not _experts(config):
        return "its config declares no tensor-parallel plan for its decoder layers (base_model_tp_plan)"
    for name, style in declared.items():
        if style == LOCAL_PARAMS:
            continue
        if style not in STYLES:
            return (f"its plan splits {name} as {style!r}, and raytrain applies only "
                    f"{', '.join(map(repr, STYLES))}")
        if STYLES[style] == TAIL_GRAD_SUM and not _second_field(config, style):
            return f"its plan splits {name} as {style!r}, which needs the config's qk_rope_head_dim"
        module, param = _submodule(decoder_layer, name), _parameter(decoder_layer, name)
        if param is not None and style == "colwise" and param.shape[0] % tp:
            return f"parallel.tp={tp} does not divide the {param.shape[0]} rows of its {name} (one per head)"
        if module is None or STYLES[style] == GRAD_SUM:
            continue  # a submodule this configuration leaves out, a bare parameter, or a whole one: no linear
        if not isinstance(module, nn.Linear):
            return f"its plan names {name}, which is not a linear layer in this model"
    for name, (style, parts) in experts_plan(config, decoder_layer).items():
        problem = None if style == SUMMED_EXPERTS else param_split_problem(decoder_layer, "its plan", name, style,
                                                                             parts, tp)
        if problem is not None:
            return problem
    text = config.get_text_config()
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and value % tp:
            return f"parallel.tp={tp} does not divide its {key}={value} (each tp rank holds 1/tp of them)"
    return None

