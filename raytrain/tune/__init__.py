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
probes). This package re-exports their public names (``rt_tune.run_sweep``, ...).
"""

from raytrain.tune.experiment import experiment_dir, named, planned_dir, resumable_dir
from raytrain.tune.fit import check_layouts, trial_resources
from raytrain.tune.results import TrialRow, format_table, progress_lines, summarize, trial_statuses, write_reports
from raytrain.tune.runner import TrialLog, run_sweep
from raytrain.tune.signals import SweepStop
from raytrain.tune.space import expected_trials, layout_combinations, param_space, trial_config
from raytrain.tune.stall import SweepStalled
from raytrain.tune.sweep_config import LAYOUT_KEYS, LAYOUTS, METRICS, SCHEDULERS, SweepConfig, load_sweep_config
from raytrain.tune.trainable import raytrain_trainable

_TrialLog = TrialLog
"""TrialLog as sweeps saved by an older raytrain name it: Tune unpickles a sweep's callbacks on ``--resume``."""

__all__ = [
    "experiment_dir", "named", "planned_dir", "resumable_dir",
    "check_layouts", "trial_resources",
    "TrialRow", "format_table", "progress_lines", "summarize", "trial_statuses", "write_reports",
    "TrialLog", "run_sweep",
    "SweepStop",
    "expected_trials", "layout_combinations", "param_space", "trial_config",
    "SweepStalled",
    "LAYOUT_KEYS", "LAYOUTS", "METRICS", "SCHEDULERS", "SweepConfig", "load_sweep_config",
    "raytrain_trainable",
]
