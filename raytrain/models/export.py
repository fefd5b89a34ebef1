"""``python -m raytrain export --checkpoint CKPT --out DIR``: a checkpoint of a ``model.hf`` run as a
Hugging Face model directory (config.json + model.safetensors) that ``from_pretrained`` loads.

The tensors are the checkpoint's parameters under the names ``save_pretrained`` gives them (the
family's conversion mapping reversed), cast to the model's dtype (that of the directory's
safetensors, else config.json's ``dtype``, else float32; ``--dtype`` overrides it and config.json
says which): a model imported and trained at lr 0 comes back bit for bit. The export reads the run's model.hf directory for its config. The directory appears whole or
not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import torch

from raytrain import checkpoint
from raytrain.config import config_from_dict
from raytrain.models.hf_conversion import to_file_names
from raytrain.models.hf_model import load_hf_config
from raytrain.models.hf_weights import SAFETENSORS_FILE, hf_layers, hf_names, stored_dtype, weight_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
"""Files of the model.hf directory the export carries over when they exist."""


def export_hf(ckpt: str, out_dir: str, dtype: Optional[str] = None, trust_remote_code: bool = False) -> str:
    """Write checkpoint ``ckpt`` (a step directory, or a checkpoint directory: its latest) as a Hugging
    Face directory at ``out_dir``; returns the step directory exported. A ValueError names what is wrong.

    ``trust_remote_code`` is the exporting user's own choice (``--trust-remote-code``), never the
    checkpoint's: a checkpoint is data, and its manifest must not be able to turn custom code on."""
    step_dir = checkpoint.resolve(ckpt)
    cfg = config_from_dict(checkpoint.read_manifest(step_dir)["config"])
    if cfg.model.hf is None:
        raise ValueError(f"--checkpoint {ckpt}: that run trained the {'model.factory' if cfg.model.factory else 'built-in'} "
                         "model, not a model.hf directory; export writes Hugging Face models only")
    if os.path.exists(out_dir):
        raise ValueError(f"--out {out_dir}: already exists; name a new directory")
    if not os.path.isdir(os.path.expanduser(cfg.model.hf)):
        raise ValueError(f"--checkpoint {ckpt}: its run's model.hf directory {cfg.model.hf!r} is gone; the export "
                         "needs its config.json there: restore it")
    trust = trust_remote_code
    config = load_hf_config(cfg.model.hf, trust)
    model, layers = hf_layers(cfg.model.hf, cfg.model.hf_cut, trust)
    config.dtype = _dtype(config, dtype, stored_dtype(weight_files(cfg.model.hf)))
    tensors = _hf_tensors(checkpoint.load_state_dict(step_dir), hf_names(model, layers), config.dtype)
    tensors = to_file_names(model, tensors)  # named as save_pretrained names them (Mixtral's experts apart)
    _write_atomically(out_dir, config, tensors, cfg.model.hf)
    return step_dir


def _dtype(config, name: Optional[str], stored: Optional[torch.dtype]) -> torch.dtype:
    """--dtype, else the source weights' dtype, else config.json's, else float32."""
    if name is not None:
        return DTYPES[name]
    if stored is not None:
        return stored
    declared = getattr(config, "dtype", None)
    return declared if isinstance(declared, torch.dtype) else DTYPES.get(str(declared), torch.float32)


def _hf_tensors(state: dict[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    missing = sorted(set(names) - set(state))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}: it was "
                         "written for another model.hf")
    return {hf: state[name].to(dtype).contiguous() for name, hf in names.items()}


def _write_atomically(out_dir: str, config, tensors: dict[str, torch.Tensor], source_dir: str) -> None:
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, SAFETENSORS_FILE), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        for name in COPIED_FILES:
            source = os.path.join(os.path.expanduser(source_dir), name)
            if os.path.isfile(source):
                shutil.copy(source, tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
