"""A stage's share of a Hugging Face model: built on the meta device, then only its own layers
materialised, and filled from the directory's safetensors or initialised under ``(seed, layer index)``.

Global parameter names stay raytrain's (``"3.layer.self_attn.q_proj.weight"``); ``hf_names`` maps
them to the model's own names (``"model.layers.2.self_attn.q_proj.weight"``) for loading and export.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch
from torch import nn

from raytrain.hf_model import layers_of, load_hf_config, meta_model

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


def hf_layers(path: str, cut: str) -> tuple[nn.Module, list[nn.Module]]:
    """The model directory's causal LM on the meta device and its pipeline layers (``model.hf_cut``)."""
    model = meta_model(load_hf_config(path))
    return model, layers_of(model, cut)


def hf_names(model: nn.Module, layers: Sequence[nn.Module]) -> dict[str, str]:
    """Global raytrain parameter name -> the model's own name, for every parameter (tied ones once)."""
    qualified = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    names, seen = {}, set()
    for index, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            prefix = qualified[id(child)]
            for local, param in child.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    names[f"{index}.{child_name}.{local}"] = f"{prefix}.{local}" if prefix else local
    return names


def build_hf_stage(path: str, cut: str, seed: int, layer_ids: Optional[Sequence[int]]) -> tuple[list[nn.Module], int]:
    """The layers ``layer_ids`` (all when None) with real tensors, and the model's layer count."""
    model, layers = hf_layers(path, cut)
    ids = list(range(len(layers))) if layer_ids is None else list(layer_ids)
    owned = [layers[i] for i in ids]
    materialise(owned)
    weights = weight_files(path)
    names = hf_names(model, layers)
    for index, layer in zip(ids, owned):
        if weights:
            load_layer(layer, index, names, weights, path)
        else:
            torch.manual_seed(seed * 100_003 + index)
            layer.apply(model._init_weights)  # HF's per-module initialiser: the one each family defines
    for layer in owned:  # computed buffers (rotary frequencies) are not in the weights: recompute them
        for module in layer.modules():
            if any(True for _ in module.buffers(recurse=False)) and not any(True for _ in module.parameters(recurse=False)):
                model._init_weights(module)
    return owned, len(layers)


def materialise(layers: Sequence[nn.Module]) -> None:
    """Give the meta layers real (uninitialised) CPU tensors, keeping tied parameters tied."""
    slots = [(m, name, id(p)) for layer in layers for m in layer.modules() for name, p in m.named_parameters(recurse=False)]
    done: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            if id(module) not in done:
                done.add(id(module))
                module.to_empty(device="cpu", recurse=False)
    first: dict[int, nn.Parameter] = {}
    for module, name, key in slots:
        setattr(module, name, first.setdefault(key, getattr(module, name)))


def weight_files(path: str) -> dict[str, str]:
    """Parameter name -> the safetensors file holding it; empty when the directory has no weights."""
    path = os.path.expanduser(path)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.isfile(single):
        return {}
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_layer(layer: nn.Module, index: int, names: dict[str, str], weights: dict[str, str], path: str) -> None:
    """Copy this layer's parameters, and only them, from the model's safetensors (each file opened once)."""
    from safetensors import safe_open

    wanted: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for child_name, child in layer.named_children():
        for local, param in child.named_parameters():
            hf_name = names.get(f"{index}.{child_name}.{local}")
            if hf_name is None:
                continue  # a tied parameter, loaded under its first name
            if hf_name not in weights:
                raise ValueError(f"model.hf={path!r}: the weights have no tensor {hf_name!r}; the directory's "
                                 "safetensors do not match its config.json")
            wanted.setdefault(weights[hf_name], []).append((hf_name, param))
    for file, params in wanted.items():
        with safe_open(file, framework="pt") as f:
            for hf_name, param in params:
                tensor = f.get_tensor(hf_name)
                if tensor.shape != param.shape:
                    raise ValueError(f"model.hf={path!r}: {hf_name!r} has shape {tuple(tensor.shape)}, the config "
                                     f"says {tuple(param.shape)}")
                param.copy_(tensor.to(param.dtype))
