"""raytrain: a Ray-based elastic trainer for PyTorch (data, pipeline and hybrid parallelism)."""

from raytrain.api import ResourcesUnavailable, Result, train
from raytrain.config import Config, load_config

__all__ = ["Config", "Result", "ResourcesUnavailable", "load_config", "train"]
__version__ = "0.1.0"
