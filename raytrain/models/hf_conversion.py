"""Where a Hugging Face model's parameters lie in its safetensors, through transformers' own key conversion.

Some families' files name parameters unlike their modules: Mixtral's files hold each expert's
``w1``/``w2``/``w3``, its modules one fused ``experts.gate_up_proj`` per layer; GPT-NeoX's files say
``embed_out`` for its ``lm_head``. transformers keeps, per family, a conversion mapping (renamings, and
converters that merge, split or concatenate tensors) that ``from_pretrained`` applies and
``save_pretrained`` reverses. raytrain applies the same mapping, but reads only the tensors of a
stage's own layers, and the export reverses it, so that an exported directory is named as the one
the run started from.
"""

from __future__ import annotations

import copy
import functools
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn


@dataclass
class FileSource:
    """The file tensors that make one group of the model's parameters: one tensor under a (maybe
    renamed) name, or several that a converter of the family's mapping fuses (a layer's experts)."""

    target: str
    """The model's name for the group's first parameter: where transformers' converter writes."""
    converter: Optional[object]
    """The family's WeightConverter (a template, copied per use); None for a plain rename."""
    keys: list[tuple[str, str]] = field(default_factory=list)
    """(file tensor name, the converter's source pattern it matched), in the files' natural order."""

    def targets(self) -> list[str]:
        """Every model parameter the group fills (a converter that splits fills several)."""
        if self.converter is None:
            return [self.target]
        first = self.converter.target_patterns[0]
        return [self.target.replace(first, pattern) for pattern in self.converter.target_patterns]


def file_sources(model: nn.Module, weights: dict[str, str]) -> dict[str, FileSource]:
    """The model's parameter name -> the files' tensors it comes from, by the family's conversion
    mapping (``model`` may live on the meta device); names the files do not make are absent."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    own = model.state_dict()  # names and shapes only, on the meta device
    groups: dict[str, FileSource] = {}
    for key in sorted(weights, key=dot_natural_key):  # experts in index order: a merge stacks them so
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if target not in own and key in own:  # already the module's name (an export's files)
            target, pattern = key, None
        if target not in own:
            continue  # a tensor the model has no place for: transformers skips it too
        group = groups.setdefault(target, FileSource(target, by_pattern[pattern] if pattern else None))
        if group.converter is None and group.keys:
            continue  # two files' names for one parameter: the first wins, as in transformers
        group.keys.append((key, pattern or key))
    return {name: group for group in groups.values() for name in group.targets()}


@torch.no_grad()
def read_sources(model: nn.Module, groups: Iterable[FileSource], weights: dict[str, str]) -> dict[str, torch.Tensor]:
    """The groups' parameters under the model's names, converted as ``from_pretrained`` converts them
    (each file opened once)."""
    from safetensors import safe_open

    groups = list(groups)
    with ExitStack() as stack:
        files = {file: stack.enter_context(safe_open(file, framework="pt"))
                 for file in sorted({weights[key] for group in groups for key, _ in group.keys})}
        get = lambda key: files[weights[key]].get_tensor(key)  # noqa: E731
        out: dict[str, torch.Tensor] = {}
        for group in groups:
            if group.converter is None:
                out[group.target] = get(group.keys[0][0])
                continue
            converter = copy.deepcopy(group.converter)
            for key, pattern in group.keys:
                converter.add_tensor(group.target, key, pattern, functools.partial(get, key))
            for name, tensor in converter.convert(group.target, model=model, config=model.config).items():
                out[name] = tensor[0] if isinstance(tensor, list) else tensor
        return out


def to_file_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` under the model's names, renamed and split back as ``save_pretrained`` writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    return {name: tensor.contiguous() for name, tensor in revert_weight_conversion(model, tensors).items()}
