"""The search space: Tune's domains for a sweep's ``space``, the trials it makes, and each trial's config.

A list is a grid (every value, in every combination with the other grids), a one-key mapping a random
domain (choice, uniform, loguniform, randint); ``layouts`` is a grid over whole layouts. Tune passes each
trial its parameters with the base under ``__base__`` (``param_space``), from which ``trial_config``
builds the trial's config.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ray import tune

from raytrain.config import Config, build_config, flatten_sections
from raytrain.tune.sweep_config import LAYOUT_KEYS, LAYOUTS, SweepConfig

BASE_KEY = "__base__"
"""The trial parameter that carries the sweep's base config (nested sections) to each trial."""


def _domain(key: str, spec: Any):
    if key == LAYOUTS or isinstance(spec, list):
        return tune.grid_search(spec)
    if isinstance(spec, dict) and len(spec) == 1:
        kind, args = next(iter(spec.items()))
        builders = {"choice": lambda a: tune.choice(a), "uniform": lambda a: tune.uniform(*a),
                    "loguniform": lambda a: tune.loguniform(*a), "randint": lambda a: tune.randint(*a)}
        if kind in builders:
            return builders[kind](args)
    raise ValueError(f"sweep space '{key}': use a list (grid) or one of choice/uniform/loguniform/randint, got {spec!r}")


def param_space(sweep: SweepConfig) -> dict:
    """Tune's ``param_space``: a domain per space key, and the base config under ``__base__``."""
    space = {key: _domain(key, spec) for key, spec in sweep.space.items()}
    space[BASE_KEY] = sweep.base
    return space


def layout_combinations(sweep: SweepConfig) -> list[dict]:
    """Every combination of the discrete layout values in the space (others from the base)."""
    options = [[(LAYOUTS, layout) for layout in sweep.space[LAYOUTS]]] if LAYOUTS in sweep.space else []
    for key in LAYOUT_KEYS:
        spec = sweep.space.get(key)
        if isinstance(spec, list):
            options.append([(key, v) for v in spec])
        elif isinstance(spec, dict) and "choice" in spec:
            options.append([(key, v) for v in spec["choice"]])
    return [dict(combo) for combo in itertools.product(*options)]


def expected_trials(sweep: SweepConfig) -> int:
    """How many trials the sweep runs in all: Tune creates them as it goes, so a stopped sweep's
    ResultGrid may hold fewer."""
    grid = [len(spec) for key, spec in sweep.space.items() if key == LAYOUTS or isinstance(spec, list)]
    return sweep.num_samples * math.prod(grid)


def trial_config(base: dict, params: dict) -> Config:
    """The base config with a trial's parameters (an explicit layout is expanded into its keys)."""
    return build_config(trial_values(base, params))


def trial_values(base: dict, params: dict) -> dict:
    """A trial's config as flat keys, not yet built (nor checked)."""
    values = flatten_sections(base, "sweep base")
    for key, value in params.items():
        if key == LAYOUTS:
            values.update(value)
        elif key != BASE_KEY:
            values[key] = value
    return values
