"""What ``prepare`` checks and fills in for a Hugging Face model (``model.hf``), before any actor starts."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import torch
from torch import nn

from raytrain.config import Config
from raytrain.models.hf_model import (UncuttableModel, WholeModel, causal_attention_problem, cut_layers, describe,
                               load_hf_config, meta_model, not_causal_lm, transformers_module)
from raytrain.config.layout import Layout
from raytrain.models.hf_tensor_plan import sequence_problem, tp_problem
from raytrain.models.hf_weights import hf_layers, missing_weights, weight_files
from raytrain.models.tensor_plan import layer_plan, split_of, token_split_problem

VERIFY_MAX_PARAMS = 500_000_000
"""The largest two-layer copy ``resolve_cut`` builds to check the cut (2 GB in float32)."""
VERIFY_VOCAB = 1024
"""The two-layer copy's vocabulary at most: the vocabulary's size does not change how the model cuts."""
CAUSAL_LM_NEEDED = ("raytrain trains decoder-only causal LMs (architectures a *ForCausalLM, or a model type "
                    "AutoModelForCausalLM builds, whose attention is causal); point model.hf at one")


def with_hf_architecture(cfg: Config) -> Config:
    """``cfg`` with model.vocab_size, n_layer, d_model and n_head read from the directory's config.json
    (data checks, memory estimates and progress lines use them); a ValueError when model.seq_len
    exceeds the model's positions, or when the directory is not a decoder-only causal LM."""
    hf = load_hf_config(cfg.model.hf, cfg.model.trust_remote_code)
    problem = not_causal_lm(hf)
    if problem is not None:
        raise ValueError(f"model.hf={cfg.model.hf!r} is {problem}: {CAUSAL_LM_NEEDED}")
    text = hf.get_text_config()
    max_positions = getattr(text, "max_position_embeddings", None)
    if max_positions is not None and cfg.model.seq_len > max_positions:
        raise ValueError(f"model.seq_len={cfg.model.seq_len} exceeds the {max_positions} positions of "
                         f"model.hf={cfg.model.hf!r} (max_position_embeddings); lower model.seq_len")
    model = dataclasses.replace(cfg.model, vocab_size=text.vocab_size, n_layer=text.num_hidden_layers,
                                d_model=text.hidden_size, n_head=text.num_attention_heads)
    return dataclasses.replace(cfg, model=model)


def hf_layout(cfg: Config, layers: list[nn.Module]) -> Layout:
    """The configured layout over the model's pipeline layers; a ValueError naming parallel.pp when the
    family cannot be cut."""
    if isinstance(layers[0], WholeModel) and cfg.parallel.pp > 1:
        raise ValueError(f"model.hf={cfg.model.hf!r}: parallel.pp={cfg.parallel.pp} needs the model cut into "
                         f"layers, and {layers[0].reason}; use parallel.pp=1 (data parallel trains any causal LM)")
    return Layout.of(cfg.parallel).for_model(len(layers), f"model.hf={cfg.model.hf!r} (embedding, decoder layers, head)")


def resolve_cut(cfg: Config) -> Config:
    """``cfg`` with model.hf_cut=auto resolved, so every worker cuts the same way: ``layers`` when the
    cut reproduces the model's own forward on a two-layer copy of its config and the directory's
    weights make every parameter (through the family's conversion mapping); else ``whole``, loaded
    by transformers itself (pp=1 only: a ValueError naming the family for pp > 1, or with model.hf_cut=layers). The same
    copy must attend causally, whatever the cut: a ValueError naming what the directory is otherwise."""
    m = cfg.model
    weights = weight_files(m.hf)  # refuses weights it cannot read, whatever the cut
    probe = _two_layer_model(load_hf_config(m.hf, m.trust_remote_code), m.trust_remote_code, m.hf_cut)
    ids = None if probe is None else _probe_ids(probe.config, m.seq_len)
    problem = None if probe is None else causal_attention_problem(probe, ids)
    if problem is not None:
        raise ValueError(f"model.hf={m.hf!r} ({describe(probe.config)}): {problem}; {CAUSAL_LM_NEEDED}")
    if m.hf_cut == "whole":
        return cfg
    if m.hf_cut == "auto" and probe is not None:
        problem = _cut_problem(probe, ids)
    if problem is None and weights:
        model, layers = hf_layers(m.hf, "layers", m.trust_remote_code)
        missing = missing_weights(model, layers, weights)
        if missing:
            problem = f"its safetensors lack {missing[0]!r} (not even its family's conversion mapping makes it)"
    if problem is None:
        return dataclasses.replace(cfg, model=dataclasses.replace(m, hf_cut="layers"))
    if cfg.parallel.pp > 1 or m.hf_cut == "layers":
        raise ValueError(f"model.hf={m.hf!r}: {problem}, so it cannot be cut into pipeline layers; use "
                         "parallel.pp=1 with model.hf_cut=auto or whole (data parallel trains any causal LM)")
    print(f"raytrain: model.hf: {problem}; it trains whole (data parallel)", file=sys.stderr)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, hf_cut="whole"))


def check_tensor_parallel(cfg: Config, layers: Optional[list[nn.Module]] = None) -> None:
    """A ValueError naming parallel.tp when the family's decoder layers cannot be split over its tp
    ranks (raytrain.models.hf_tensor_plan says why); ``cfg`` has its cut resolved. ``layers``: the model's
    pipeline layers on the meta device, when the caller built them."""
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return
    if m.hf_cut != "layers":
        raise ValueError(f"parallel.tp={tp}: model.hf={m.hf!r} trains whole (model.hf_cut={m.hf_cut}), and tensor "
                         "parallelism splits the decoder layers of a cut model; use parallel.fsdp")
    config = load_hf_config(m.hf, m.trust_remote_code)
    layers = layers if layers is not None else hf_layers(m.hf, "layers", m.trust_remote_code)[1]
    problem = next(filter(None, (tp_problem(config, decoder.layer, tp) for decoder in layers[1:-1])), None)
    if problem is None and not any(_splits_a_weight(decoder, tp) for decoder in layers[1:-1]):
        problem = "its plan splits no weight of its decoder layers that raytrain splits (experts with a bias stay whole)"
    if problem is not None:  # every decoder layer: a mixture of experts may follow dense ones (DeepSeek-V2)
        raise ValueError(f"parallel.tp={tp}: model.hf={m.hf!r} ({describe(config)}): {problem}; use parallel.fsdp, "
                         "or a tp that fits")
    if cfg.parallel.sequence_parallel:
        problem = next(filter(None, (sequence_problem(config, decoder.layer) for decoder in layers[1:-1])), None)
        problem = problem or token_split_problem([layer_plan(layer, tp, sequence=True) for layer in layers])
        if problem is not None:
            raise ValueError(f"parallel.sequence_parallel=true: model.hf={m.hf!r} ({describe(config)}) cannot split "
                             f"its tokens over the tp ranks: {problem}; leave sequence_parallel false")


def _splits_a_weight(layer: nn.Module, tp: int) -> bool:
    """Whether ``tp`` ranks hold parts of any parameter of this cut layer, by its plan."""
    plan = layer_plan(layer, tp)
    return any(split_of(plan, name) is not None for name, _ in layer.named_parameters())


def _two_layer_config(config):
    """The config with at most two decoder layers and a small vocabulary: the same layer structure at a
    size the driver can build and run."""
    small = type(config).from_dict(config.to_dict())
    text = small.get_text_config()
    text.num_hidden_layers = min(text.num_hidden_layers, 2)
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[: text.num_hidden_layers]
    if text.vocab_size > VERIFY_VOCAB:
        text.vocab_size = VERIFY_VOCAB
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(text, key, None)
            if any(isinstance(i, int) and i >= VERIFY_VOCAB for i in (value if isinstance(value, list) else [value])):
                setattr(text, key, None)
    return small


def _two_layer_model(config, trust_remote_code: bool, cut: str) -> Optional[nn.Module]:
    """The model's two-layer copy (``_two_layer_config``), initialised under seed 0, in eval mode; None,
    and a note on stderr, when even that is larger than VERIFY_MAX_PARAMS."""
    config = _two_layer_config(config)
    size = sum(p.numel() for p in meta_model(config, trust_remote_code).parameters())
    if size > VERIFY_MAX_PARAMS:
        choose = "; set model.hf_cut=layers or whole to choose" if cut == "auto" else ""
        print(f"raytrain: model.hf: the causal attention and the cut of {describe(config)} are not checked "
              f"({size / 1e6:.0f}M parameters in two layers){choose}", file=sys.stderr)
        return None
    torch.manual_seed(0)
    auto = transformers_module().AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32, trust_remote_code=bool(trust_remote_code)).eval()


def _probe_ids(config, seq_len: int) -> torch.Tensor:
    """Token ids for the checks: longer than any sliding window, so that masks are checked too."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None) or 0
    return torch.randint(0, text.vocab_size, (2, min(seq_len, max(16, window + 1))))


@torch.no_grad()
def _cut_problem(model: nn.Module, ids: torch.Tensor) -> Optional[str]:
    """Why the cut layers do not compute the model's forward (None when they do, bit for bit up to 1e-6)."""
    config = model.config
    family = config.architectures[0] if getattr(config, "architectures", None) else type(config).__name__
    try:
        layers = nn.Sequential(*cut_layers(model))
    except UncuttableModel as e:
        return str(e)
    try:
        want, got = model(input_ids=ids, use_cache=False).logits, layers(ids)
    except Exception as e:  # a layer that needs what the cut does not give it (alibi, per-layer rotary)
        return f"{family}'s layers need more than the cut gives them ({type(e).__name__}: {e})"
    error = (want - got).abs().max().item() / max(1.0, want.abs().max().item())
    return None if error <= 1e-6 else f"the cut layers of {family} do not reproduce its forward (difference {error:.1e})"
