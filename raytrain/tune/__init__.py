"""Ray Tune sweeps over parallel layouts and hyper-parameters.

Each trial runs one raytrain coordinator inside the trial's own placement group: one bundle per
worker, and an empty head bundle for the trial's driver, which only polls. So a trial either gets all its devices
or waits; trials never over-subscribe the cluster. Trials report every step with
``ray.tune.report`` (loss, samples/s; with eval.every also the latest held-out ``eval_loss``, so a
sweep can rank trials by it: ``sweep.metric: eval_loss``) and attach each checkpoint as a
``ray.tune.Checkpoint``, so ASHA can stop trials early, PBT can exploit (clone a better trial's
checkpoint) and explore (mutate ``train.lr``), and ``Tuner.restore`` resumes a sweep.

Modules, one job each: ``sweep_config`` (``SweepConfig``, its checks, loading a sweep file), ``space``
(the search space as Tune's domains, the trials and each one's config), ``fit`` (every layout checked
against the cluster before any trial; a trial's placement group), ``trainable`` (one trial: a raytrain
run reporting to Tune), ``runner`` (``run_sweep``: new or resumed, its scheduler), ``experiment`` (where
a sweep's experiment lives; what ``--resume`` may name), ``signals`` (``SweepStop``: a signal stops a
sweep so that it can resume), ``results`` (rows per trial, the table, CSV and plot, a stopped sweep's
progress), ``stall`` (the bound on a sweep no trial of which can run), ``autolayout`` (``parallel.auto``
probes). This package re-exports their public names lazily (``rt_tune.run_sweep``, ...), so that a sweep file
or a ``--resume`` path is checked before Ray Tune and torch are imported.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "experiment": ("experiment_dir", "named", "planned_dir", "resumable_dir"),
    "fit": ("check_layouts", "trial_resources"),
    "results": ("TrialRow", "format_table", "progress_lines", "summarize", "trial_statuses", "write_reports"),
    "runner": ("TrialLog", "run_sweep"),
    "signals": ("SweepStop",),
    "space": ("expected_trials", "layout_combinations", "param_space", "trial_config"),
    "stall": ("SweepStalled",),
    "sweep_config": ("LAYOUT_KEYS", "LAYOUTS", "METRICS", "SCHEDULERS", "SweepConfig", "load_sweep_config"),
    "trainable": ("raytrain_trainable",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
_ALIASES = {"_TrialLog": "TrialLog"}
"""TrialLog as sweeps saved by an older raytrain name it: Tune unpickles a sweep's callbacks on ``--resume``."""

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    """``raytrain.tune.<name>``: the public name of the module that defines it, imported on first use."""
    name = _ALIASES.get(name, name)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'raytrain.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"raytrain.tune.{module}"), name)


def __dir__() -> list[str]:
    return __all__
