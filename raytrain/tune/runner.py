"""``run_sweep``: a sweep run (or resumed) by Ray Tune, each trial in a placement group of its own.

Before Ray runs any trial, every layout of the space is checked against the cluster
(raytrain.tune.fit); the scheduler (ASHA, PBT) ranks trials by loss; a sweep no trial of which can
run stops after ``sweep.resources_wait_s`` (raytrain.tune.stall) and can be resumed.
"""

from __future__ import annotations

import warnings
from typing import Optional

import ray
from ray import tune

from raytrain.tune.experiment import new_name, restore, resumable_dir, storage_dir
from raytrain.tune.fit import check_layouts, trial_resources
from raytrain.tune.space import BASE_KEY, param_space, trial_config
from raytrain.tune.stall import StallWatch, StopWhenStalled, SweepStalled, take_verdict
from raytrain.tune.sweep_config import SweepConfig
from raytrain.tune.trainable import raytrain_trainable


def run_sweep(sweep: SweepConfig, resume: Optional[str] = None):
    """Run (or resume, from an experiment path) a sweep; returns the Tune ResultGrid."""
    from raytrain.driver.run import ensure_ray

    where = resumable_dir(resume) if resume is not None else None  # a bad path fails before Ray starts
    ensure_ray()
    cluster = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    check_layouts(sweep, cluster)
    tuner = restore(resume, where, _trainable()) if where is not None else _new_tuner(sweep)
    take_verdict()  # a verdict left by an earlier sweep in this process is not this one's
    with warnings.catch_warnings():
        # Tune's advice to reuse processes under PBT, which _new_tuner's reuse_actors explains not taking
        warnings.filterwarnings("ignore", message="Consider boosting PBT performance", category=UserWarning)
        grid = tuner.fit()
    stalled = take_verdict()
    if stalled is not None:
        raise SweepStalled(f"sweep {grid.experiment_path} stopped: {stalled}")
    return grid


def _new_tuner(sweep: SweepConfig) -> tune.Tuner:
    """A tuner for a new sweep: its space, scheduler and stall watch; named by ``sweep.name`` or the time."""
    watch = StallWatch(sweep.resources_wait_s)
    return tune.Tuner(
        _trainable(),
        param_space=param_space(sweep),
        tune_config=tune.TuneConfig(
            num_samples=sweep.num_samples, scheduler=_scheduler(sweep),
            max_concurrent_trials=sweep.max_concurrent_trials,
            # A trial of the same resources reuses a warm process (imports, torch), but only where
            # trials end on their own: Tune errors a trial whose reused process still runs the
            # trial it paused or stopped (a schedule's), as one's teardown may outlast Tune's 2 s.
            reuse_actors=sweep.scheduler == "none",
            **({} if sweep.scheduler != "none" else {"metric": sweep.metric, "mode": sweep.mode}),
        ),
        run_config=tune.RunConfig(name=sweep.name or new_name(), storage_path=storage_dir(sweep),
                                  callbacks=[TrialLog(), watch], stop=StopWhenStalled(watch), verbose=0),
    )


def _trainable():
    # Resources depend on the trial's layout: Tune asks per trial.
    return tune.with_resources(
        raytrain_trainable,
        lambda params: trial_resources(trial_config(params[BASE_KEY], params)),
    )


def _scheduler(sweep: SweepConfig):
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    base = sweep.base_config
    if sweep.scheduler == "asha":
        return ASHAScheduler(metric="loss", mode="min", time_attr="step", max_t=base.train.steps,
                             grace_period=sweep.grace_period, reduction_factor=2)
    if sweep.scheduler == "pbt":
        # Perturb exactly at checkpoints: a cloned trial resumes from the step its donor reached.
        return PopulationBasedTraining(metric="loss", mode="min", time_attr="step",
                                       perturbation_interval=base.checkpoint.every,
                                       quantile_fraction=sweep.quantile_fraction, synch=sweep.synch,
                                       hyperparam_mutations={"train.lr": tune.loguniform(1e-5, 1e-1)})
    return None


class TrialLog(tune.Callback):
    """One line per finished trial, for people watching and for tests waiting on progress.

    Tune pickles a sweep's callbacks into its saved state and unpickles them on ``--resume``: this class
    must stay importable where the saved state names it."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        print(f"[raytrain] trial {trial.trial_id} finished: {r.get('layout')} loss={r.get('loss', float('nan')):.4f} "
              f"samples/s={r.get('samples_per_s', 0):.1f}", flush=True)
