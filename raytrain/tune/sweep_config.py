"""A sweep's settings: ``SweepConfig`` (the base config, the search space, how trials are ranked and
scheduled), checked as it is built, and ``load_sweep_config`` (a sweep file plus ``--set`` overrides).

The base config is built once per sweep (``SweepConfig.base_config``); a trial's own config is the base
with its parameters (raytrain.tune.space.trial_config).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from raytrain.config import RENAMED_KEYS, Config, all_keys, build_config, flatten_sections
from raytrain.config.schema import EVAL_METRICS

LAYOUT_KEYS = ("parallel.dp", "parallel.fsdp", "parallel.tp", "parallel.pp", "parallel.microbatches", "parallel.schedule",
               "parallel.virtual_stages")
LAYOUTS = "layouts"
"""Space key for an explicit list of layouts, each a mapping of parallel.* keys (a grid over them)."""
SCHEDULERS = ("none", "asha", "pbt")
METRICS = ("samples_per_s", "loss", "eval_loss", *(f"eval_{m}" for m in EVAL_METRICS))


@dataclass
class SweepConfig:
    """A sweep, checked as it is built: a ValueError names the ``sweep.*`` setting or space key and the fix."""

    base: dict
    """The training config every trial starts from (nested sections, as in a train config)."""
    space: dict
    """Config key -> list (grid search) or {choice|uniform|loguniform|randint: [...]}; and optionally
    ``layouts: [{parallel.dp: 2}, {parallel.pp: 2, parallel.microbatches: 4}, ...]``."""
    metric: str = "samples_per_s"
    """What to rank trials by: samples_per_s (steady throughput), loss, or eval_loss (the held-out
    loss after the last step; needs eval.every > 0 in the base config)."""
    mode: str = "max"
    """max or min."""
    num_samples: int = 1
    """Repeats of the grid (or samples of a random space)."""
    scheduler: str = "none"
    """none, asha (stop bad trials early on loss) or pbt (exploit/explore train.lr through checkpoints)."""
    grace_period: int = 3
    """ASHA: steps every trial runs before it can be stopped."""
    quantile_fraction: float = 0.25
    """PBT: the bottom fraction of trials that clone one of the top fraction at each perturbation."""
    synch: bool = False
    """PBT: pause trials at each perturbation until all reach it (fair for small populations)."""
    max_concurrent_trials: int = 1
    """Trials running at once; each still gets its own placement group."""
    storage_path: str = "runs/sweeps"
    """Where Tune keeps the experiment (results, checkpoints, state for restore)."""
    name: Optional[str] = None
    """Experiment name; default a timestamp."""
    resources_wait_s: float = 120.0
    """Bound on how long a sweep may have no trial running while trials wait (for resources, or for
    an errored trial under synchronous PBT): then it stops, naming them, and can be resumed."""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"sweep.metric={self.metric!r}: use one of {', '.join(METRICS)}")
        base = self.base_config
        if self.metric.startswith("eval_") and not base.eval.every:
            raise ValueError(f"sweep.metric={self.metric} needs eval.every > 0 in the base config (and held-out rows: "
                             "data.eval_fraction or data.eval_path), so that every trial computes it")
        if self.metric.startswith("eval_") and self.metric != "eval_loss" \
                and self.metric.removeprefix("eval_") not in base.eval.metrics:
            raise ValueError(f"sweep.metric={self.metric} needs {self.metric.removeprefix('eval_')!r} in the base "
                             "config's eval.metrics, so that every trial measures it")
        if self.mode not in ("max", "min"):
            raise ValueError(f"sweep.mode={self.mode!r}: use max or min")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"sweep.scheduler={self.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
        if self.scheduler == "pbt" and not base.checkpoint.every:
            raise ValueError("sweep.scheduler=pbt needs checkpoint.every > 0: trials clone each other through "
                             "checkpoints, and PBT perturbs every checkpoint.every steps")
        if not self.resources_wait_s > 0:
            raise ValueError(f"sweep.resources_wait_s={self.resources_wait_s}: use a number of seconds > 0")
        if not 0 < self.quantile_fraction <= 0.5:
            raise ValueError(f"sweep.quantile_fraction={self.quantile_fraction}: use a fraction in (0, 0.5]")
        valid = set(all_keys()) | set(RENAMED_KEYS)  # an old name is renamed by build_config, with a warning
        keys = [k for k in self.space if k != LAYOUTS]
        for layout in self.space.get(LAYOUTS, []):
            if not isinstance(layout, dict):
                raise ValueError(f"sweep space 'layouts' entries must be mappings like {{parallel.dp: 2}}, got {layout!r}")
            keys += list(layout)
        for key in keys:
            if key not in valid:
                import difflib

                near = difflib.get_close_matches(key, sorted(valid), n=1)
                raise ValueError(f"sweep space key '{key}' is not a config key" + (f"; did you mean '{near[0]}'?" if near else ""))

    @functools.cached_property
    def base_config(self) -> Config:
        """The base config, built (and checked) once, by ``__post_init__``: ``base`` must not change after."""
        return build_config(flatten_sections(self.base, "sweep base"))


def load_sweep_config(path: str, overrides: Optional[list[str]] = None) -> SweepConfig:
    """A sweep file: a train config (sections) plus ``space:`` and optional ``sweep:`` settings."""
    from raytrain.config.loader import parse_overrides, read_yaml_file

    raw = read_yaml_file(path, what="sweep config")
    space = raw.pop("space", None)
    if not space:
        raise ValueError(f"{path}: a sweep config needs a 'space:' section (config key -> values)")
    settings = raw.pop("sweep", {}) or {}
    base = raw
    for key, value in parse_overrides(overrides):
        section, _, name = key.partition(".")
        if section == "sweep":
            settings[name] = value
        else:
            base.setdefault(section, {})[name] = value
    known = set(SweepConfig.__dataclass_fields__) - {"base", "space", "extra"}
    for key in settings:  # the file's and --set's alike
        if key not in known:
            raise ValueError(f"{path}: unknown sweep setting 'sweep.{key}' (valid: {', '.join(sorted(known))})")
    build_config(flatten_sections(base, path))  # the base alone must be valid; its errors name the file
    return SweepConfig(base=base, space=space, **settings)
