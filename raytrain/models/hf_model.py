"""Hugging Face decoder-only causal LMs cut into pipeline layers: ``[embedding, decoder layer x n, norm + head]``.

The cut is read from the family's ``base_model_pp_plan`` (transformers' list of the children a
pipeline runs) where its config declares one, else from the model's structure, never from a table of
families: the causal LM holds a base model and an output head; the base model holds the input
embedding, one ``ModuleList`` of decoder layers, a final norm, and optionally a rotary embedding, a
learned position embedding and a dropout. Each decoder-layer wrapper recomputes what the base
model's forward would hand its layers (position ids, rotary cos/sin for the layer's type, the causal
or sliding-window mask), so a stage needs nothing from another stage but the hidden states. A family with anything else in those places cannot be cut:
``UncuttableModel`` names it, and ``pp=1`` still trains it whole (``WholeModel``). A directory that is
not a causal LM at all (an encoder, an encoder-decoder, a vision model), or whose config.json names its
own Python code (``auto_map``, unless model.trust_remote_code), is refused: a model directory is data.

``transformers`` is an optional extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from raytrain.models.hf_tensor_plan import decoder_layer_plan, runs_per_token

HF_EXTRA = "pip install -e '.[hf]'"


class UncuttableModel(ValueError):
    """The model's structure is not the decoder-only shape the pipeline cut understands."""


def transformers_module():
    """``transformers``, or a ValueError saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"model.hf needs the transformers package: {HF_EXTRA}") from e
    return transformers


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The model directory's config (``config.json``); a ValueError naming model.hf when it has none, and
    naming config.json when it cannot be read or names custom code (``auto_map``) not trusted.

    ``trust_remote_code`` goes to transformers as an explicit bool, never None: None makes it ask on stdin."""
    path = os.path.expanduser(path)
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model.hf={path!r}: no config.json there; point model.hf at a local Hugging Face "
                         "model directory (save_pretrained writes one)")
    refuse_custom_code(file, trust_remote_code)
    try:
        return transformers_module().AutoConfig.from_pretrained(path, local_files_only=True,
                                                                trust_remote_code=bool(trust_remote_code))
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model.hf={path!r}: transformers cannot read {file} ({first_line(e)}); point model.hf at a "
                         "directory that save_pretrained wrote with this transformers version") from e


def first_line(error: BaseException) -> str:
    """An exception's first line (transformers' and safetensors' run to several): messages stay one line."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def refuse_custom_code(file: str, trust_remote_code: bool) -> None:
    """A ValueError naming ``file`` when it cannot be parsed, or when its ``auto_map`` names Python files
    of the directory that transformers would import: a model directory is data, like a checkpoint, and
    runs no code unless model.trust_remote_code is set."""
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model.hf: {file} is not a readable JSON config ({e}); restore it, e.g. with "
                         "transformers' save_pretrained") from e
    if not isinstance(config, dict):
        raise ValueError(f"model.hf: {file} holds no JSON object; restore it (save_pretrained writes one)")
    auto_map = config.get("auto_map")
    if auto_map and not trust_remote_code:
        named = ", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else str(auto_map)
        raise ValueError(f"model.hf: {file} names custom Python code in auto_map ({named}), which raytrain does not "
                         "run unasked; set model.trust_remote_code=true only if you trust that code, or use a "
                         "directory without auto_map")


def describe(config) -> str:
    """What a model directory's config says it is: its architectures and model type."""
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures"
    return f"{architectures}, model_type {getattr(config, 'model_type', None)!r}"


def not_causal_lm(config) -> Optional[str]:
    """What the config is when it is not a decoder-only causal LM (None when it may be one): raytrain trains
    next-token prediction, which an encoder-decoder, a masked LM or a vision model only fakes. Read from
    config.json alone; ``causal_attention_problem`` then checks the attention itself."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    architectures = list(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder ({describe(config)})"
    if architectures:
        if not any(a in set(causal.values()) or a.endswith("ForCausalLM") for a in architectures):
            return f"not a causal LM ({describe(config)})"
    elif config.model_type not in causal and "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):
        return f"of a model type AutoModelForCausalLM does not build ({describe(config)})"
    return None


@torch.no_grad()
def causal_attention_problem(model: nn.Module, ids: torch.Tensor) -> Optional[str]:
    """Why ``model``'s forward is not causal: its logits at the first half of ``ids`` change when the second
    half does (an encoder's bidirectional attention, BERT without is_decoder); None when they do not."""
    half = ids.size(1) // 2
    if half == 0:
        return None
    later = ids.clone()
    later[:, half:] = (ids[:, half:] + 1) % model.config.get_text_config().vocab_size
    try:
        first, second = (model(input_ids=x, use_cache=False).logits[:, :half] for x in (ids, later))
    except Exception as e:  # noqa: BLE001 - a forward that needs more than token ids cannot train either
        return f"its forward fails on token ids alone ({type(e).__name__}: {first_line(e)})"
    change = (first - second).abs().max().item() / max(1.0, first.abs().max().item())
    if change <= 1e-5:
        return None
    hint = " (config.json has is_decoder false: true makes it a causal decoder)" \
        if getattr(model.config, "is_decoder", None) is False else ""
    return (f"its attention is not causal: the logits at a position change with later tokens (by {change:.1e}), "
            f"so its next-token loss would be fake{hint}")


MANY_LAYERS = 1000
"""A layer count from which building the structure is said first: transformers builds each layer's modules
in Python, about a second per thousand layers even on the meta device (1.3 s for 1200 Llama layers here)."""


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The whole causal LM on the meta device: its structure and names, no memory."""
    layers = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", 0) or 0
    if layers >= MANY_LAYERS:
        print(f"raytrain: model.hf: building the structure of its {layers} layers (no weights yet: about a second "
              "per thousand layers)", file=sys.stderr, flush=True)
    auto = transformers_module().AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.float32, trust_remote_code=bool(trust_remote_code))


@dataclass
class DecoderParts:
    """Where a decoder-only causal LM keeps the pieces the pipeline cuts it into."""

    embed: nn.Module
    position: Optional[nn.Module]
    dropout: Optional[nn.Module]
    layers: nn.ModuleList
    rotary: Optional[nn.Module]
    norm: nn.Module
    head: nn.Module


def find_parts(model: nn.Module) -> DecoderParts:
    """The model's pieces, by the family's ``base_model_pp_plan`` where its config declares one, else by
    structure; UncuttableModel naming the family and the piece otherwise."""
    family = type(model).__name__
    base, head = model.base_model, model.get_output_embeddings()
    if base is model or head is None:
        raise UncuttableModel(f"{family}: no base model and output head to cut between")
    extra = [n for n, c in model.named_children() if c is not base and c is not head and _has_state(c)]
    embed = base.get_input_embeddings()
    plan = list(getattr(base.config, "base_model_pp_plan", None) or {})
    found = _roles_by_plan(base, embed, plan) if plan else _roles_by_structure(base, embed)
    found["rotary"] = _rotaries_in_use(base, found["rotary"])
    if extra or found["other"] or len(found["layers"]) != 1 or len(found["norm"]) != 1 or \
            len(found["rotary"]) > 1 or len(found["position"]) > 1 or len(found["dropout"]) > 1:
        how = f"base_model_pp_plan {plan}" if plan else "structure"
        raise UncuttableModel(f"{family}: expected an input embedding, one list of decoder layers and one final "
                              f"norm, found by its {how} {dict(found, head_extras=extra)}")
    get = lambda role: getattr(base, found[role][0]) if found[role] else None  # noqa: E731
    return DecoderParts(embed=embed, position=get("position"), dropout=get("dropout"), layers=get("layers"),
                        rotary=get("rotary"), norm=get("norm"), head=head)


def _roles_by_structure(base: nn.Module, embed: nn.Module) -> dict[str, list[str]]:
    """The base model's children by what they are: a ModuleList of layers, a rotary, a norm ..."""
    found: dict[str, list] = {"layers": [], "rotary": [], "position": [], "dropout": [], "norm": [], "other": []}
    for name, child in base.named_children():
        if child is not embed:
            found[_role(child, base.config)].append(name)
    return found


def _roles_by_plan(base: nn.Module, embed: nn.Module, plan: list[str]) -> dict[str, list[str]]:
    """The base model's children by the family's pipeline plan (transformers' ``base_model_pp_plan``:
    the children a pipeline runs, in order): the embedding first, the decoder layers, a dropout between
    them where the plan has one, the final norm after them. The rotary embedding, which the plan leaves
    out because every stage recomputes it, is found by structure; any other child with state is not cut."""
    found: dict[str, list] = {"layers": [], "rotary": [], "position": [], "dropout": [], "norm": [], "other": []}
    layers_at = next((i for i, name in enumerate(plan) if isinstance(getattr(base, name, None), nn.ModuleList)), None)
    if layers_at is None or getattr(base, plan[0], None) is not embed:
        found["other"].append(f"plan {plan} (no input embedding first, or no list of layers)")
        return found
    found["layers"].append(plan[layers_at])
    for name in plan[1:layers_at]:
        found["dropout" if isinstance(getattr(base, name, None), nn.Dropout) else "other"].append(name)
    found["norm"].extend(plan[layers_at + 1:])
    for name, child in base.named_children():
        if name in plan or child is embed:
            continue
        if _role(child, base.config) == "rotary":
            found["rotary"].append(name)
        elif _has_state(child):  # a stateless child the plan does not run (a helper) needs no stage
            found["other"].append(name)
    return found


def _rotaries_in_use(base: nn.Module, names: list[str]) -> list[str]:
    """Of the rotary embeddings found, the one the layers use: a list of rotaries, one per base theta
    that the config's ``layer_rope_theta`` picks from for each layer, takes the place of a single rotary
    beside it, which the family's forward leaves unused (Granite SWA's ``rotary_embs``)."""
    thetas = getattr(base.config.get_text_config(), "layer_rope_theta", None)
    if thetas and not any(thetas):
        return []  # no layer has a rotary (its list of them is empty, and the single one unused)
    per_theta = [n for n in names if isinstance(getattr(base, n), nn.ModuleList)]
    return per_theta if len(per_theta) == 1 and thetas else names


def layer_rotary(rotary: Optional[nn.Module], config, index: int) -> Optional[nn.Module]:
    """The rotary embedding of decoder layer ``index``: the model's one, or, from a list of them, the one
    of the layer's base theta (``layer_rope_theta``; 0: none, the layer has no rotary)."""
    if not isinstance(rotary, nn.ModuleList):
        return rotary
    theta = config.get_text_config().layer_rope_theta[index]
    if not theta:
        return None
    found = next((r for r in rotary if r.config.rope_parameters["rope_theta"] == theta), None)
    if found is None:
        raise UncuttableModel(f"decoder layer {index}'s rope theta {theta} has no rotary embedding of its own")
    return found


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _role(child: nn.Module, config) -> str:
    kind = type(child).__name__
    if isinstance(child, nn.ModuleList):  # the decoder layers, or one rotary per base theta
        rotaries = len(child) and all(type(c).__name__.endswith("RotaryEmbedding") for c in child)
        return "rotary" if rotaries else "layers"
    if kind.endswith("RotaryEmbedding"):
        return "rotary"
    if type(child) is nn.Embedding and child.num_embeddings == getattr(config, "max_position_embeddings", None):
        return "position"
    if isinstance(child, nn.Dropout):
        return "dropout"
    if "Norm" in kind:
        return "norm"
    return "other"


def positions(x: torch.Tensor) -> torch.Tensor:
    """Position ids ``(1, T)`` of a whole-sequence forward (no cache, no padding)."""
    return torch.arange(x.size(1), device=x.device).unsqueeze(0)


class HFEmbedding(nn.Module):
    """Token ids -> hidden states: the input embedding, plus learned positions where the model has them."""

    def __init__(self, parts: DecoderParts, config):
        super().__init__()
        self.embed, self.position, self.dropout = parts.embed, parts.position, parts.dropout
        tied = getattr(parts.head, "weight", None) is getattr(parts.embed, "weight", False)
        self.tp_plan = {} if tied or not isinstance(parts.embed, nn.Embedding) else {"embed": ("vocab_embedding", 1)}
        self.tp_plan[""] = ("sequence_scatter", 1)
        """Under parallel.tp the token table is split by vocabulary, unless the head shares it; with
        parallel.sequence_parallel each rank keeps its tokens of the output."""
        self.multiplier = _family_scale(config, "granite", "embedding_multiplier")
        """Granite's families scale the embedded tokens."""

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        h_BTD = self.embed(ids_BT)
        if self.multiplier != 1.0:
            h_BTD = h_BTD * self.multiplier
        if self.position is not None:
            h_BTD = h_BTD + self.position(positions(ids_BT))
        return self.dropout(h_BTD) if self.dropout is not None else h_BTD


class HFDecoderLayer(nn.Module):
    """One decoder layer, given what the base model's forward would compute for it."""

    def __init__(self, layer: nn.Module, rotary: Optional[nn.Module], config, index: int):
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config
        self.tp_plan = decoder_layer_plan(config, layer)
        """The family's colwise / rowwise projections (raytrain.models.hf_tensor_plan): parallel.tp's split."""
        self.attention_type = _attention_type(layer, config, index)
        self.sliding = self.attention_type == "sliding_attention"
        self.rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        """Gemma 3's rotary holds one frequency table per layer type, and is told which one a layer uses."""
        self.takes_alibi = "alibi" in inspect.signature(layer.forward).parameters
        """Falcon's layers take an alibi bias; a rotary Falcon's (config.alibi false, cut_layers' only kind) is None."""
        self.tokens_split_by = 1
        """The tp ranks that hold a part of each sample's tokens each (parallel.sequence_parallel; set by
        raytrain.worker.tensor_parallel): positions, mask and rotary are those of the whole sequence."""

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        B, T, D = h_BTD.shape
        whole_BTD = h_BTD.new_empty(()).expand(B, T * self.tokens_split_by, D)  # its shape: no memory
        pos = positions(whole_BTD)
        make_mask = masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=whole_BTD, attention_mask=None, past_key_values=None,
                         position_ids=pos)
        extras = {}
        if self.rotary is not None:
            by_type = {"layer_type": self.attention_type} if self.rotary_by_type else {}
            extras["position_embeddings"] = self.rotary(whole_BTD, pos, **by_type)
        if self.takes_alibi:
            extras["alibi"] = None
        out = self.layer(h_BTD, attention_mask=mask, position_ids=pos, use_cache=False, **extras)
        return out[0] if isinstance(out, tuple) else out


def _attention_type(layer: nn.Module, config, index: int) -> str:
    own = getattr(layer, "attention_type", None)  # what the layer itself says, where it says it
    if isinstance(own, str):
        return own
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


class HFHead(nn.Module):
    """Hidden states -> logits: the final norm and the output head. Under parallel.tp the head is split by
    vocabulary and the loss computed on the split logits (raytrain.models.tensor_plan), unless it is tied
    to the input embedding (both then stay whole on every rank, the head's input gathered from every
    rank's tokens under parallel.sequence_parallel)."""

    def __init__(self, parts: DecoderParts, config):
        super().__init__()
        self.norm, self.head = parts.norm, parts.head
        tied = getattr(parts.head, "weight", None) is getattr(parts.embed, "weight", False)
        split, per_token = not tied and isinstance(parts.head, nn.Linear), runs_per_token(parts.norm)
        self.tp_plan = {"head": ("vocab_parallel", 1)} if split else {}
        if per_token:  # with parallel.sequence_parallel, on the rank's tokens
            self.tp_plan["norm"] = ("sequence_parallel", 1)
        if not split:  # a whole head takes every rank's tokens (before the norm, if that cannot run on a part)
            self.tp_plan["head" if per_token else "norm"] = ("sequence_gather", 1)
        self.logit_scale = _family_scale(config, "cohere", "logit_scale")
        """Cohere's families multiply the logits by it."""
        self.logits_scaling = _family_scale(config, "granite", "logits_scaling")
        """Granite's families divide the logits by it."""
        self.softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
        """Gemma 2's (and later Gemma's) cap: logits = cap * tanh(logits / cap). Element-wise, so it holds on a
        head split by vocabulary too."""

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h_BTD))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _family_scale(config, family: str, key: str) -> float:
    """A logit scale that only ``family``'s models (by model_type prefix) mean so (1 for any other: the same
    keys mean other things elsewhere, and model.hf_cut=auto finds a cut that misses them)."""
    text = config.get_text_config()
    value = getattr(text, key, None) if str(getattr(text, "model_type", "")).startswith(family) else None
    return 1.0 if value is None else float(value)


class WholeModel(nn.Module):
    """A causal LM the pipeline cannot cut, as one layer: data parallel only."""

    def __init__(self, model: nn.Module, reason: str):
        super().__init__()
        self.model, self.reason = model, reason

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids_BT, use_cache=False).logits


def cut_layers(model: nn.Module) -> list[nn.Module]:
    """The model as pipeline layers (sharing the model's own modules, so its names stay reachable)."""
    if getattr(model.config.get_text_config(), "alibi", False):
        raise UncuttableModel(f"{describe(model.config)} uses alibi, whose bias its model's forward folds into the "
                              "attention mask: the cut does not reproduce that")
    parts = find_parts(model)
    decoders = [HFDecoderLayer(layer, layer_rotary(parts.rotary, model.config, i), model.config, i)
                for i, layer in enumerate(parts.layers)]
    return [HFEmbedding(parts, model.config), *decoders, HFHead(parts, model.config)]


def layers_of(model: nn.Module, cut: str) -> list[nn.Module]:
    """The pipeline layers by ``model.hf_cut``: ``layers`` cuts (UncuttableModel if it cannot),
    ``whole`` is one ``WholeModel`` layer, ``auto`` cuts where the structure allows."""
    if cut == "whole":
        return [WholeModel(model, "model.hf_cut=whole")]
    try:
        return cut_layers(model)
    except UncuttableModel as e:
        if cut == "layers":
            raise UncuttableModel(f"model.hf_cut=layers: {e}; use model.hf_cut=whole with parallel.pp=1") from e
        return [WholeModel(model, str(e))]
