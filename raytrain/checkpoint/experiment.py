"""Which experiment a checkpoint is of: the ``model.*`` and ``data.*`` keys of the config its manifest
records, against a run's config. A resume may change how a run trains (``train.*``, the layout), never the
model's parameters; ``checkpoint.resume=latest`` takes only a checkpoint of the same model and data."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from raytrain.config import Config

MODEL_KEYS = ("factory", "options", "n_layer", "d_model", "n_head", "vocab_size")
"""The ``model.*`` keys that decide the parameters of every kind of model (a Hugging Face model's are read from
its config.json; model.hf, where that directory lies, may move). Also model.seq_len for the built-in GPT and a
factory (the GPT's position table), model.hf_cut for a Hugging Face model, and whether model.hf is set."""
DATA_KEYS = ("path", "builtin", "factory", "column", "text_column", "tokenizer", "inputs", "targets", "transform",
             "eval_fraction", "eval_path")
"""The ``data.*`` keys that decide which samples a run trains on (with the built-in corpus, max_bytes too)."""


@dataclass(frozen=True)
class KeyDifference:
    """A config key whose value in a checkpoint's recorded config (``there``) is not this run's (``here``)."""

    key: str
    there: Any
    here: Any

    def __str__(self) -> str:
        return f"{self.key}={self.there!r} (this run: {self.here!r})"


def model_difference(cfg: Config, recorded: Optional[dict]) -> Optional[KeyDifference]:
    """The first ``model.*`` key that decides the parameters on which ``cfg`` differs from ``recorded`` (the
    config a checkpoint's manifest records); None when they agree, or when none is recorded (a checkpoint
    written by hand, not by a raytrain run)."""
    there = recorded.get("model") if isinstance(recorded, dict) else None
    if not isinstance(there, dict):
        return None
    keys = list(MODEL_KEYS) + (["hf_cut"] if cfg.model.hf is not None else ["seq_len"])
    if (there.get("hf") is None) != (cfg.model.hf is None):
        keys.insert(0, "hf")
    return _first_difference("model", there, dataclasses.asdict(cfg.model), keys)


def experiment_difference(cfg: Config, recorded: Optional[dict]) -> Optional[str]:
    """What makes a checkpoint whose recorded config is ``recorded`` another experiment than ``cfg``'s: its
    first differing model key (``model_difference``) or data key (DATA_KEYS), or that it records no config;
    None for the same experiment."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("data"), dict):
        return "no config recorded (written by hand, not by a raytrain run)"
    keys = list(DATA_KEYS) + (["max_bytes"] if cfg.data.path is None else [])
    data = _first_difference("data", recorded["data"], dataclasses.asdict(cfg.data), keys)
    differs = model_difference(cfg, recorded) or data
    return None if differs is None else str(differs)


def _first_difference(section: str, there: dict, here: dict, keys: list[str]) -> Optional[KeyDifference]:
    return next((KeyDifference(f"{section}.{k}", there[k], here[k]) for k in keys if k in there and there[k] != here[k]),
                None)
