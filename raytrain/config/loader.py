"""Reading a configuration: a YAML file (every mapping's keys unique), then ``--set key=value`` overrides
in order, each value coerced to its field's type, then the schema's checks (raytrain.config.schema).

A file that is missing, a directory, unreadable or not YAML, an unknown key and an override whose
value is not YAML are ValueErrors naming it (the CLI's one line, exit 2), never a yaml or OS traceback.
A renamed key (RENAMED_KEYS) is read under its old name too, from a file, an override or a dict alike:
``build_config``, which every one of them goes through, moves it to its new name with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import typing
import warnings
from typing import Any, Optional

import yaml

from raytrain.config.errors import config_error, require
from raytrain.config.schema import Config

RENAMED_KEYS = {
    "resources.wait_s": "resources.placement_wait_s",
    "elastic.wait_s": "elastic.capacity_wait_s",
}
"""Old name -> new name of a renamed key: the old name still works, with a DeprecationWarning."""


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. ``train.lr``."""
    return [f"{section}.{f.name}" for section, cls in _section_types().items() for f in dataclasses.fields(cls)]


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _unknown_key_error(key: str) -> ValueError:
    nearest = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.0)
    hint = f"; did you mean '{nearest[0]}'?" if nearest else ""
    return ValueError(f"unknown config key '{key}'{hint} (valid keys: see README, 'Configuration')")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML value to the field's declared type, or say which key is wrong."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:
            return _coerce_either(key, value, options)
        annotation = options[0]
        origin = typing.get_origin(annotation)
    if annotation is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise config_error(key, value, "expects a list like [2, 4]")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise config_error(key, value, "expects true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise config_error(key, value, "expects an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond any float
                number = math.inf
            if not math.isfinite(number):  # a YAML .nan or .inf passes every '<= 0' check
                raise config_error(key, value, "not a finite number; give a finite value")
            return number
        raise config_error(key, value, "expects a number")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise config_error(key, value, "expects a string")
    return value


def _coerce_either(key: str, value: Any, options: list) -> Any:
    """The value as the first of ``options`` it fits (data.path: a string, or a list of strings)."""
    for option in options:
        try:
            return _coerce(key, value, option)
        except ValueError:
            continue
    names = {str: "a string", list: "a list", int: "an integer", float: "a number", bool: "true or false"}
    raise config_error(key, value, "expects " + " or ".join(names.get(o, str(o)) for o in options))


SWEEP_SECTIONS = ("space", "sweep")
"""Sections a sweep file has beside a train config's (raytrain.tune.sweep_config)."""


def flatten_sections(raw: dict, where: str) -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": 0.1}``; ``where`` names the source in errors."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the config must be a mapping of sections (model:, train:, ...)")
    flat = {}
    sweep_only = [name for name in SWEEP_SECTIONS if name in raw]
    if sweep_only:
        raise ValueError(f"{where} is a sweep (it has a {sweep_only[0]}: section): run it with "
                         "'python -m raytrain sweep --config ...', or drop space: and sweep: to train once")
    for section, body in raw.items():
        if not isinstance(body, dict):
            raise _unknown_key_error(str(section)) if section not in _section_types() else ValueError(
                f"{where}: section '{section}' must be a mapping of keys"
            )
        for k, v in body.items():
            flat[f"{section}.{k}"] = v
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """``'train.lr=1e-3'`` -> ``('train.lr', 0.001)``; values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ValueError(f"--set expects key=value (e.g. --set train.lr=1e-3), got {text!r}")
    key, _, raw = text.partition("=")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        value = None
    return key.strip(), value


def with_new_names(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every renamed key (RENAMED_KEYS) under its new name, each with a one-line
    DeprecationWarning; a key given under both names is a ValueError naming both."""
    values = dict(values)
    for old, new in RENAMED_KEYS.items():
        if old in values:
            require(new not in values, old, values[old], f"renamed {new}, which is given too: keep only {new}")
            warnings.warn(f"config key {old} is deprecated: it is renamed {new}; write that instead",
                          DeprecationWarning, stacklevel=_levels_inside_config())
            values[new] = values.pop(old)
    return values


def _levels_inside_config() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside raytrain.config (the user's
    line, so that Python's default filters show it there)."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_globals.get("__name__", "").startswith("raytrain.config"):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def build_config(values: dict[str, Any]) -> Config:
    """Build and validate a Config from flat dotted keys (renamed keys under either name)."""
    sections = _section_types()
    per_section: dict[str, dict] = {name: {} for name in sections}
    for key, value in with_new_names(values).items():
        section, _, name = key.partition(".")
        if section not in sections:
            raise _unknown_key_error(key)
        hints = typing.get_type_hints(sections[section])
        if name not in {f.name for f in dataclasses.fields(sections[section])}:
            raise _unknown_key_error(key)
        # Scientific notation without a dot ("1e-3") is a string to YAML 1.1: accept it for floats.
        if hints[name] is float and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        per_section[section][name] = _coerce(key, value, hints[name])
    built = {name: sections[name](**kwargs) for name, kwargs in per_section.items()}
    return Config(**built)


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping: plain YAML keeps the last one
    silently, so a config with two ``train:`` sections would train with the first one dropped."""

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (first on line {first_line[key]}); keep one",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base class names it
                break
        return super().construct_mapping(node, deep)


def load_yaml(stream) -> Any:
    """A YAML document (a config or a sweep file) with every mapping's keys unique."""
    return yaml.load(stream, Loader=UniqueKeyLoader)


def read_yaml_file(path: str, what: str = "config file") -> dict:
    """A YAML file's mapping (``{}`` when empty), every mapping's keys unique. A file that is missing, a
    directory, unreadable, not UTF-8 or not YAML is a ValueError naming it (``what``) and the line."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist; pass an existing YAML file to --config")
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))[:3]
        raise ValueError(f"{what} {path!r} is a directory; pass --config a YAML file"
                         + (f" (it holds {', '.join(inside)})" if inside else ""))
    try:
        with open(path, encoding="utf-8") as f:
            raw = load_yaml(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what} {path!r}{at}: not valid YAML ({problem}); fix the YAML syntax there") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {e.start}); save it as UTF-8") from e
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read ({e.strerror}); pass --config a readable YAML file") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{what} {path!r}: the config must be a mapping of sections (model:, train:, ...), not a "
                         f"YAML {type(raw).__name__}")
    return raw


def parse_overrides(texts: Optional[list[str]]) -> list[tuple[str, Any]]:
    """``--set key=value`` strings as (key, value) pairs; a value that is not YAML is a ValueError naming it."""
    pairs = []
    for text in texts or []:
        try:
            pairs.append(parse_override(text))
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--set {text!r}: the value is not valid YAML ({problem}); fix it, or quote it "
                             "(lists: --set parallel.split_points=[2,4])") from e
    return pairs


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load ``path`` (YAML), apply ``--set`` overrides in order, validate, and return the Config.

    What needs this machine (data.path, model.factory) is checked later, by raytrain.driver.prepare.prepare.
    Every input error is a ValueError naming the file or override (the CLI's one line, exit 2)."""
    values: dict[str, Any] = flatten_sections(read_yaml_file(path), path) if path is not None else {}
    values.update(parse_overrides(overrides))
    return build_config(values)


def config_from_dict(nested: dict) -> Config:
    """Build a Config from a nested dict (as ``Config.to_dict`` produces)."""
    return build_config(flatten_sections(nested, "config"))
