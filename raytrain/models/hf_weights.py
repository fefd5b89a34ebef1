"""A stage's share of a Hugging Face model: built on the meta device, then only its own layers
materialised, and filled from the directory's safetensors or initialised under ``(seed, layer index)``.

Global parameter names stay raytrain's (``"3.layer.self_attn.q_proj.weight"``); ``hf_names`` maps
them to the model's own names (``"model.layers.2.self_attn.q_proj.weight"``) for loading and export;
the files' names may differ again, as transformers' conversion mapping says (raytrain.models.hf_conversion).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch
from torch import nn

from raytrain.models.hf_conversion import FileSource, file_sources, read_sources
from raytrain.models.hf_model import WholeModel, first_line, layers_of, load_hf_config, meta_model, transformers_module

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
"""Weight files raytrain does not read: a directory holding them (and no safetensors) is refused."""
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def hf_layers(path: str, cut: str, trust_remote_code: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    """The model directory's causal LM on the meta device and its pipeline layers (``model.hf_cut``);
    ``trust_remote_code`` is model.trust_remote_code (off: a directory with auto_map is refused)."""
    model = meta_model(load_hf_config(path, trust_remote_code), trust_remote_code)
    return model, layers_of(model, cut)


def hf_names(model: nn.Module, layers: Sequence[nn.Module]) -> dict[str, str]:
    """Global raytrain parameter name -> the model's own name, for every parameter (tied ones once)."""
    qualified: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        qualified.setdefault(id(module), name)  # a module reachable twice keeps its first name, as save_pretrained
    names, seen = {}, set()
    for index, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            prefix = qualified[id(child)]
            for local, param in child.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    names[f"{index}.{child_name}.{local}"] = f"{prefix}.{local}" if prefix else local
    return names


def build_hf_stage(path: str, cut: str, seed: int, layer_ids: Optional[Sequence[int]],
                   trust_remote_code: bool = False) -> tuple[list[nn.Module], int]:
    """The layers ``layer_ids`` (all when None) with real tensors, and the model's layer count.

    Every owned layer is first initialised by the family's own initialiser under ``(seed, layer
    index)``, which also computes its buffers (rotary frequencies, embedding scales); the directory's
    weights, when it has any, then overwrite the parameters. A whole (uncut) model with weights is
    loaded by ``from_pretrained`` itself, with every key conversion transformers knows (safetensors
    only: never a pickle; no custom code unless ``trust_remote_code``)."""
    model, layers = hf_layers(path, cut, trust_remote_code)
    weights = weight_files(path)
    if isinstance(layers[0], WholeModel) and weights:
        auto = transformers_module().AutoModelForCausalLM
        whole = auto.from_pretrained(os.path.expanduser(path), dtype=torch.float32, local_files_only=True,
                                     use_safetensors=True, trust_remote_code=bool(trust_remote_code))
        return [WholeModel(whole, layers[0].reason)], 1
    ids = list(range(len(layers))) if layer_ids is None else list(layer_ids)
    built = _with_tie_holders(layers, ids)  # a tied parameter gets the value the whole model gives it
    materialise([layers[i] for i in built])
    for index in built:
        torch.manual_seed(seed * 100_003 + index)
        layers[index].apply(model._init_weights)  # HF's per-module initialiser: the one each family defines
    if weights:
        names, sources = hf_names(model, layers), file_sources(model, weights)
        for index in built:
            load_layer(layers[index], index, names, sources, weights, model, path)
    return [layers[i] for i in ids], len(layers)


def _with_tie_holders(layers: Sequence[nn.Module], ids: list[int]) -> list[int]:
    """``ids`` and every other layer that holds a parameter of theirs (tied embeddings across stages), in
    order: built beside them and initialised in the whole model's order, so that a stage holding a tied
    parameter starts it from the value every layout gives it (the last holder's initialiser, or the weights
    under its first name)."""
    mine = {id(p) for i in ids for p in layers[i].parameters()}
    holders = {i for i, layer in enumerate(layers) if any(id(p) in mine for p in layer.parameters())}
    return sorted(set(ids) | holders)


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
    """Tensor name in the files -> the safetensors file holding it; empty when the directory has no
    weights. A ValueError naming model.hf for weights raytrain cannot read, and naming the file for a
    safetensors file or index that is truncated, corrupt or disagrees with its shards (each file's
    header is read: cheap, and it checks that the file covers every tensor it declares)."""
    path = os.path.expanduser(path)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        weights = _index_weight_map(index)
        for file in sorted(set(weights.values())):
            held = _safetensors_names(file, f"listed by {index}")
            absent = [name for name, where in weights.items() if where == file and name not in held]
            if absent:
                raise ValueError(f"model.hf: {file} lacks {absent[0]!r}, which {index} places there; the shards "
                                 "and the index disagree: restore the directory (save_pretrained writes both)")
        return weights
    single = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return {name: single for name in _safetensors_names(single)}
    unread = sorted(f for f in os.listdir(path) if f.endswith(OTHER_WEIGHTS + (".safetensors",)))
    if unread:
        raise ValueError(f"model.hf={path!r} holds {unread[0]}, which raytrain does not read: it reads "
                         f"{SAFETENSORS_FILE} or {SAFETENSORS_INDEX} with its shards; convert with transformers "
                         "(from_pretrained, then save_pretrained) into a new directory")
    return {}


def _index_weight_map(index: str) -> dict[str, str]:
    """The index's tensor name -> shard path; a ValueError naming the index when it cannot be read."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(os.path.dirname(index), file) for name, file in weight_map.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"model.hf: {index} is not a readable safetensors index (no JSON weight_map: "
                         f"{type(e).__name__}: {first_line(e)}); restore it (save_pretrained writes it)") from e


def _safetensors_names(file: str, why: str = "") -> set[str]:
    """The tensor names in ``file``'s header; a ValueError naming the file when it is missing, truncated
    or not safetensors at all (the library checks the header covers the file exactly)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"model.hf: {file}{f' ({why})' if why else ''} is not a readable safetensors file "
                         f"({first_line(e)}): it is truncated, corrupt or missing; restore or re-download it") from e


def missing_weights(model: nn.Module, layers: Sequence[nn.Module], weights: dict[str, str]) -> list[str]:
    """The model's parameter names the files do not make, even through the family's conversion mapping
    (tied ones count once)."""
    sources = file_sources(model, weights)
    return [hf for hf in hf_names(model, layers).values() if hf not in sources]


@torch.no_grad()
def load_layer(layer: nn.Module, index: int, names: dict[str, str], sources: dict[str, FileSource],
               weights: dict[str, str], model: nn.Module, path: str) -> None:
    """Copy this layer's parameters, and only them, from the model's safetensors, converted by the
    family's mapping (raytrain.models.hf_conversion)."""
    wanted: dict[str, nn.Parameter] = {}
    for child_name, child in layer.named_children():
        for local, param in child.named_parameters():
            hf_name = names.get(f"{index}.{child_name}.{local}")
            if hf_name is not None:  # None: a tied parameter, loaded under its first name
                wanted[hf_name] = param
    absent = [name for name in wanted if name not in sources]
    if absent:
        raise ValueError(f"model.hf={path!r}: the weights have no tensor for {absent[0]!r}; the directory's "
                         "safetensors do not match its config.json")
    groups = {id(sources[name]): sources[name] for name in wanted}.values()
    for name, tensor in read_sources(model, groups, weights).items():
        param = wanted.get(name)
        if param is None:
            continue  # a group fills another layer's parameter too (never in the families seen so far)
        if tensor.shape != param.shape:
            raise ValueError(f"model.hf={path!r}: {name!r} has shape {tuple(tensor.shape)} in the weights, the "
                             f"config says {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))


def stored_dtype(weights: dict[str, str]) -> Optional[torch.dtype]:
    """The dtype the directory's weights are stored in (of its first tensor); None without weights."""
    if not weights:
        return None
    from safetensors import safe_open

    name, file = next(iter(weights.items()))
    with safe_open(file, framework="pt") as f:
        return SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
