"""Typed run configuration: YAML file + ``--set key=value`` overrides, validated before any actor starts.

Every field is a public, documented key (``section.field``). Errors are ``ValueError``s of one form,
``key=value: fix`` (raytrain.config.errors). The dataclasses' checks are pure (no disk, no imports of user code): every
node builds them, and what only the driver's machine can answer (data.path exists, model.factory
imports) is checked once, by ``raytrain.driver.prepare.prepare``.
"""

from raytrain.config.loader import (RENAMED_KEYS, all_keys, build_config, config_from_dict, flatten_sections,
                                    load_config, load_yaml, parse_override)
from raytrain.config.schema import (Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig,
                                    check_shardable)

__all__ = ["RENAMED_KEYS", "Config", "DataConfig", "ModelConfig", "ParallelConfig", "TrainConfig", "all_keys",
           "build_config", "check_shardable", "config_from_dict", "flatten_sections", "load_config", "load_yaml",
           "parse_override"]
