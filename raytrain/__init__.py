"""raytrain: a Ray-based elastic trainer for PyTorch (data, pipeline and hybrid parallelism)."""

from raytrain.config import Config, load_config

__all__ = ["Config", "Result", "ResourcesUnavailable", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that importing a light module (config, schedule) does not import Ray and torch.
    if name in ("train", "Result", "ResourcesUnavailable"):
        from raytrain import api

        return getattr(api, name)
    if name == "checkpoint":  # raytrain.checkpoint.load_state_dict(path) after a bare ``import raytrain``
        import importlib

        return importlib.import_module("raytrain.checkpoint")
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
