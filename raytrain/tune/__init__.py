"""Ray Tune sweeps over parallel layouts and hyper-parameters.

Each trial runs one raytrain coordinator inside the trial's own placement group: one bundle per
worker, and an empty head bundle for the trial's driver, which only polls. So a trial either gets all its devices
or waits; trials never over-subscribe the cluster. Trials report every step with
``ray.tune.report`` (loss, samples/s; with eval.every also the latest held-out ``eval_loss``, so a
sweep can rank trials by it: ``sweep.metric: eval_loss``) and attach each checkpoint as a
``ray.tune.Checkpoint``, so ASHA can stop trials early, PBT can exploit (clone a better trial's
checkpoint) and explore (mutate ``train.lr``), and ``Tuner.restore`` resumes a sweep.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray import tune

from raytrain.config import RENAMED_KEYS, Config, all_keys, build_config, flatten_sections
from raytrain.config.schema import EVAL_METRICS
from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.driver.placement import worker_bundle
from raytrain.driver.model_check import plan_layout
from raytrain.driver.plan import check_inputs
from raytrain.tune.stall import StallWatch, StopWhenStalled, SweepStalled, take_verdict

LAYOUT_KEYS = ("parallel.dp", "parallel.fsdp", "parallel.tp", "parallel.pp", "parallel.microbatches", "parallel.schedule",
               "parallel.virtual_stages")
LAYOUTS = "layouts"
"""Space key for an explicit list of layouts, each a mapping of parallel.* keys (a grid over them)."""
SCHEDULERS = ("none", "asha", "pbt")
METRICS = ("samples_per_s", "loss", "eval_loss", *(f"eval_{m}" for m in EVAL_METRICS))


@dataclass
class SweepConfig:
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
        base = build_config(flatten_sections(self.base, "sweep base"))
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
        if self.scheduler == "pbt" and not build_config(flatten_sections(self.base, "sweep base")).checkpoint.every:
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


def load_sweep_config(path: str, overrides: Optional[list[str]] = None) -> SweepConfig:
    """A sweep file: a train config (sections) plus ``space:`` and optional ``sweep:`` settings."""
    from raytrain.config.loader import parse_overrides, read_yaml_file

    raw = read_yaml_file(path, what="sweep config")
    space = raw.pop("space", None)
    if not space:
        raise ValueError(f"{path}: a sweep config needs a 'space:' section (config key -> values)")
    settings = raw.pop("sweep", {}) or {}
    known = set(SweepConfig.__dataclass_fields__) - {"base", "space", "extra"}
    for key in settings:
        if key not in known:
            raise ValueError(f"{path}: unknown sweep setting 'sweep.{key}' (valid: {', '.join(sorted(known))})")
    base = raw
    for key, value in parse_overrides(overrides):
        section, _, name = key.partition(".")
        if section == "sweep":
            settings[name] = value
        else:
            base.setdefault(section, {})[name] = value
    build_config(flatten_sections(base, path))  # the base alone must be valid
    return SweepConfig(base=base, space=space, **settings)


# --- search space ---------------------------------------------------------------------------


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


def trial_config(base: dict, params: dict) -> Config:
    """The base config with a trial's parameters (an explicit layout is expanded into its keys)."""
    return build_config(_trial_values(base, params))


def _trial_values(base: dict, params: dict) -> dict:
    values = flatten_sections(base, "sweep base")
    for key, value in params.items():
        if key == LAYOUTS:
            values.update(value)
        elif key != "__base__":
            values[key] = value
    return values


def _trial_layout(values: dict) -> Layout:
    """The layout a trial's keys set, known also when they are invalid (it names the trial in errors)."""
    chosen = {key.split(".", 1)[1]: values[key] for key in LAYOUT_KEYS if key in values}
    axes = {axis.name: chosen.pop(axis.name) for axis in dataclasses.fields(Mesh) if axis.name in chosen}
    return Layout(mesh=Mesh(**axes), **chosen)


def check_layouts(sweep: SweepConfig, cluster: dict[str, float]) -> None:
    """Reject, before any trial starts, layouts that are invalid or cannot fit the cluster."""
    problems = []
    for combo in layout_combinations(sweep):
        values = _trial_values(sweep.base, combo)
        label = _trial_layout(values).label
        try:
            cfg = build_config(values)
            if cfg.parallel.auto:
                raise ValueError("parallel.auto=true: the sweep sets each trial's layout; drop parallel.auto from it")
            check_inputs(cfg)
            layout = plan_layout(cfg)
        except ValueError as e:
            problems.append(f"{label}: {e}")
            continue
        problems += [f"{label}: {problem}" for problem in _fit_problems(cfg, layout, cluster)]
    if problems:
        raise ValueError("these layouts cannot run; remove them from the sweep space or add resources:\n  "
                         + "\n  ".join(problems))


def _fit_problems(cfg: Config, layout: Layout, cluster: dict[str, float]) -> list[str]:
    """Why a valid trial cannot run on ``cluster``: more workers than it holds, a growing run, standby workers."""
    problems = []
    if (cfg.elastic.max_dp or layout.dp) > layout.dp:
        problems.append(f"elastic.max_dp={cfg.elastic.max_dp} > parallel.dp; a trial's resources are fixed by "
                        "Tune, so a trial cannot grow: drop elastic.max_dp from sweeps")
    if cfg.elastic.standby:
        problems.append(f"elastic.standby={cfg.elastic.standby}: a trial runs in the resources Tune reserved for "
                        "it, with no room for standby workers: drop elastic.standby from sweeps")
    for resource, amount in worker_bundle(cfg).items():
        need = layout.world_size * amount
        if need > cluster.get(resource, 0):
            problems.append(f"needs {need:g} {resource} ({layout.world_size} workers), the cluster has "
                            f"{cluster.get(resource, 0):g}")
    return problems


def trial_resources(cfg: Config) -> tune.PlacementGroupFactory:
    world = Layout.of(cfg.parallel).world_size
    # An empty head bundle: Tune then places the trial driver without resources, and the placement
    # group holds exactly the workers' bundles (indices 0..world-1).
    return tune.PlacementGroupFactory([{}] + [worker_bundle(cfg)] * world,
                                     strategy=cfg.resources.placement_strategy)


# --- the trainable --------------------------------------------------------------------------


def raytrain_trainable(params: dict) -> None:
    """One trial: a raytrain run in this trial's placement group, reporting every step."""
    from raytrain import checkpoint
    from raytrain.driver.plan import prepare
    from raytrain.driver.run import run

    started = time.time()
    base = params["__base__"]
    overrides = dict(params)
    trial_dir = tune.get_context().get_trial_dir()
    # Each start of the trial (first, resumed, or cloned by PBT) gets its own run and checkpoint
    # directories, so a restart never mistakes an older incarnation's checkpoint for its latest.
    run_dir = os.path.join(trial_dir, f"run-{int(started * 1000)}")
    # Tune attaches each checkpoint to the metrics of its step, so a trial saves synchronously.
    overrides.update({"run.dir": trial_dir, "run.name": os.path.basename(run_dir),
                      "checkpoint.dir": os.path.join(run_dir, "checkpoints"), "checkpoint.async_save": False})
    restored = tune.get_checkpoint()
    local_ckpt = None
    if restored is not None:
        local_ckpt = restored.to_directory(os.path.join(run_dir, "restored"))
        overrides["checkpoint.resume"] = local_ckpt
        if checkpoint.read_manifest(local_ckpt)["step"] >= trial_config(base, overrides).train.steps:
            return  # paused (PBT) or interrupted at its last step: nothing is left to train
    cfg = trial_config(base, overrides)
    state = {"first_step_s": None, "samples": 0, "seconds": 0.0, "eval_step": 0, "ended": False,
             "eval": {"eval_loss": float("nan"), **{f"eval_{m}": float("nan") for m in cfg.eval.metrics}}}

    def report(rows: list[dict]) -> None:
        for row in rows:
            if "step" not in row or "loss" not in row or state["ended"]:
                continue
            if state["first_step_s"] is None:
                state["first_step_s"] = time.time() - started
            # The first step pays for warm-up; a step rolled forward after a repair has no timing.
            if (row["step"] > 1 or local_ckpt is not None) and "step_s" in row:
                state["samples"] += cfg.train.global_batch
                state["seconds"] += row["step_s"]
            metrics = {
                "step": row["step"], "loss": row["loss"],
                "samples_per_s": state["samples"] / state["seconds"] if state["seconds"] else row.get("samples_per_s", 0.0),
                "bubble": row.get("bubble"), "layout": cfg.layout().label, "first_step_s": state["first_step_s"],
            }
            if "eval_loss" in row:
                state["eval"].update({k: row[k] for k in state["eval"]})
                state["eval_step"] = row["step"]
            if cfg.eval.every:  # every report has the latest values (NaN before the first): Tune wants its metric in each
                metrics.update(state["eval"], eval_step=state["eval_step"])
            ckpt = tune.Checkpoint.from_directory(row["checkpoint"]) if row.get("checkpoint") else None
            try:
                tune.report(metrics, checkpoint=ckpt)
            except SystemExit:
                # Tune ends a paused or stopped trial's thread with SystemExit from report; the run
                # stops on it, and the rows its teardown still forwards must not report again, for
                # a second report would wait forever on the session's lock.
                state["ended"] = True
                raise

    pg = ray.util.get_current_placement_group()
    run(prepare(cfg), stream=open(os.devnull, "w"), on_rows=report, placement=(pg, 0))


class _TrialLog(tune.Callback):
    """One line per finished trial, for people watching and for tests waiting on progress."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        print(f"[raytrain] trial {trial.trial_id} finished: {r.get('layout')} loss={r.get('loss', float('nan')):.4f} "
              f"samples/s={r.get('samples_per_s', 0):.1f}", flush=True)


def _param_space(sweep: SweepConfig) -> dict:
    space = {key: _domain(key, spec) for key, spec in sweep.space.items()}
    space["__base__"] = sweep.base
    return space


def _scheduler(sweep: SweepConfig):
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    steps = build_config(flatten_sections(sweep.base, "sweep base")).train.steps
    if sweep.scheduler == "asha":
        return ASHAScheduler(metric="loss", mode="min", time_attr="step", max_t=steps,
                             grace_period=sweep.grace_period, reduction_factor=2)
    if sweep.scheduler == "pbt":
        every = build_config(flatten_sections(sweep.base, "sweep base")).checkpoint.every
        # Perturb exactly at checkpoints: a cloned trial resumes from the step its donor reached.
        return PopulationBasedTraining(metric="loss", mode="min", time_attr="step", perturbation_interval=every,
                                       quantile_fraction=sweep.quantile_fraction, synch=sweep.synch,
                                       hyperparam_mutations={"train.lr": tune.loguniform(1e-5, 1e-1)})
    return None


def _trainable_for(sweep: SweepConfig):
    # Resources depend on the trial's layout: Tune asks per trial.
    return tune.with_resources(
        raytrain_trainable,
        lambda params: trial_resources(trial_config(params["__base__"], params)),
    )


def run_sweep(sweep: SweepConfig, resume: Optional[str] = None):
    """Run (or resume, from an experiment path) a sweep; returns the Tune ResultGrid."""
    from raytrain.driver.run import ensure_ray

    where = resumable_dir(resume) if resume is not None else None  # a bad path fails before Ray starts
    ensure_ray()
    cluster = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    check_layouts(sweep, cluster)
    if where is not None:
        try:
            tuner = tune.Tuner.restore(where, _trainable_for(sweep), resume_unfinished=True, resume_errored=True)
        except Exception as e:  # a damaged experiment state: one line, not Tune's traceback
            raise _cannot_restore(resume, where, e) from None
    else:
        name = sweep.name or time.strftime("sweep-%Y%m%d-%H%M%S")
        watch = StallWatch(sweep.resources_wait_s)
        storage = os.path.abspath(os.path.expanduser(sweep.storage_path))
        tuner = tune.Tuner(
            _trainable_for(sweep),
            param_space=_param_space(sweep),
            tune_config=tune.TuneConfig(
                num_samples=sweep.num_samples, scheduler=_scheduler(sweep),
                max_concurrent_trials=sweep.max_concurrent_trials,
                # A trial of the same resources reuses a warm process (imports, torch), but only where
                # trials end on their own: Tune errors a trial whose reused process still runs the
                # trial it paused or stopped (a schedule's), as one's teardown may outlast Tune's 2 s.
                reuse_actors=sweep.scheduler == "none",
                **({} if sweep.scheduler != "none" else {"metric": sweep.metric, "mode": sweep.mode}),
            ),
            run_config=tune.RunConfig(name=name, storage_path=storage, callbacks=[_TrialLog(), watch],
                                      stop=StopWhenStalled(watch), verbose=0),
        )
    take_verdict()  # a verdict left by an earlier sweep in this process is not this one's
    with warnings.catch_warnings():
        # Tune's advice to reuse processes under PBT, which reuse_actors above explains not taking
        warnings.filterwarnings("ignore", message="Consider boosting PBT performance", category=UserWarning)
        grid = tuner.fit()
    stalled = take_verdict()
    if stalled is not None:
        raise SweepStalled(f"sweep {grid.experiment_path} stopped: {stalled}")
    return grid


def experiment_dir(path: str) -> str:
    """A ``--resume`` path as Tune's restore needs it: a URI as given; a local path (relative, ``~``)
    absolute, because Tune reads a relative path as a URI without a scheme."""
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def resumable_dir(path: str) -> str:
    """The experiment directory ``--resume path`` names, or a one-line ValueError saying what to pass."""
    where = experiment_dir(path)
    if tune.Tuner.can_restore(where):
        _check_tuner_state(path, where)
        return where
    fix = "pass the 'experiment' directory a sweep printed (runs/sweeps/<name>)"
    if os.path.isdir(where):
        inside = sorted(d for d in os.listdir(where) if tune.Tuner.can_restore(os.path.join(where, d)))
        if inside:
            fix = f"it holds the sweeps {', '.join(inside)}: pass one of them, e.g. {os.path.join(path, inside[-1])}"
        what = "holds no Ray Tune experiment (no tuner.pkl)"
    else:
        what = "does not exist"
    raise ValueError(f"--resume {path}: {where} {what}; {fix}")


def _check_tuner_state(path: str, where: str) -> None:
    """A local experiment's ``tuner.pkl`` must unpickle, which Tune finds out only after Ray started.
    Tune unpickles that file on restore anyway: reading it here trusts it no more than before."""
    state = os.path.join(where, "tuner.pkl")
    if "://" in where or not os.path.isfile(state):
        return
    import ray.cloudpickle

    try:
        with open(state, "rb") as f:
            ray.cloudpickle.load(f)
    except Exception as e:
        raise _cannot_restore(path, where, e) from None


def _cannot_restore(path: str, where: str, error: Exception) -> ValueError:
    """The one line for an experiment whose saved state does not load: the first line of why."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ValueError(f"--resume {path}: {where} holds a sweep Tune cannot restore ({first}); "
                      "start it again without --resume")


def named(sweep: SweepConfig) -> SweepConfig:
    """The sweep with its experiment name fixed now, so its directory is known before Tune starts."""
    return sweep if sweep.name else dataclasses.replace(sweep, name=time.strftime("sweep-%Y%m%d-%H%M%S"))


def planned_dir(sweep: SweepConfig) -> str:
    """Where Tune keeps a new sweep's experiment (``sweep.name`` must be set: see ``named``)."""
    return os.path.join(os.path.abspath(os.path.expanduser(sweep.storage_path)), sweep.name)


# --- stopping and resuming ----------------------------------------------------------------------

CLUSTER_POLL_S = 0.5
"""While a sweep stops: how often it checks that Ray is still there."""

TUNE_LOGGER = "ray.tune.tune"
TUNE_STOP_NOTES = ("Stop signal received", "Experiment has been interrupted", "Trials did not complete")
"""Tune's own log lines about a stop: replaced by raytrain's, which name the CLI's ``--resume`` command."""


class SweepStop(logging.Filter):
    """SIGINT or SIGTERM stops a sweep as Ctrl-C stops a Tune run: Tune stops the trials and saves its
    experiment state, so ``--resume`` continues it; ``reason`` records the signal for the exit code.

    Tune's own SIGINT handler is turned off (its documented TUNE_DISABLE_SIGINT_HANDLER) because it
    ignores SIGTERM and keeps no record of the signal; this handler passes the first signal on to
    the handler Tune installs for its other stop signal, SIGUSR1. A second signal aborts at once
    (KeyboardInterrupt), as does a first one before Tune has started. Main thread only."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.reason: Optional[str] = None
        self._previous: dict = {}
        self._env: Optional[str] = None
        self._reporting = False
        self.resume_command: Optional[str] = None
        """Printed when the sweep cannot report (Ray ended with the signal)."""

    def __enter__(self) -> "SweepStop":
        if threading.current_thread() is threading.main_thread():
            self._env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
            self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
            self.install()
            logging.getLogger(TUNE_LOGGER).addFilter(self)
        return self

    def install(self) -> None:
        """(Re)install the handlers: call again once Ray has started, as ``ray.init`` puts its own
        SIGTERM handler (a stack dump, then abort) in place of Python's."""
        if self._previous:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        if self._previous:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            if self._env is None:
                os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
            else:
                os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = self._env
            logging.getLogger(TUNE_LOGGER).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TUNE_STOP_NOTES)

    def reporting(self) -> None:
        """Tune has returned: a signal now only waits for the report (seconds), never interrupts it."""
        self._reporting = True

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._reporting:
            self.stream.write(f"\n[raytrain] {name}: the sweep has stopped; finishing its report\n")
            return
        if self.reason is not None:
            raise KeyboardInterrupt(f"aborted by a second {name}, without waiting for Tune to save its state")
        self.reason = name
        tune_stop = signal.getsignal(signal.SIGUSR1)
        if not callable(tune_stop) or tune_stop is self._previous.get(signal.SIGUSR1):
            raise KeyboardInterrupt(f"stopped by {name} before Tune started")
        self.stream.write(f"\n[raytrain] {name}: stopping the sweep; Tune saves its state so that --resume "
                          "continues it; send it again to abort now\n")
        self.stream.flush()
        threading.Thread(target=self._watch_cluster, name="raytrain-sweep-stop", daemon=True).start()
        tune_stop(signal.SIGUSR1, frame)

    def _watch_cluster(self) -> None:
        """While Tune stops: a signal to every process of the job (Slurm's, systemd's control group) ends an
        embedded Ray too, and Tune's clean-up then blocks a minute on each call to it; exit at once."""
        from raytrain.driver.connect import cluster_reachable, embedded
        from raytrain.driver.signals import exit_code

        while not self._reporting:
            time.sleep(CLUSTER_POLL_S)
            if not self._reporting and embedded() and not cluster_reachable():
                hint = f"; continue it with: {self.resume_command}" if self.resume_command else ""
                self.stream.write(f"raytrain: sweep stopped by {self.reason}, which also ended Ray; Tune's last "
                                  f"saved state is kept{hint}\n")
                self.stream.flush()
                os._exit(exit_code(self.reason))


def expected_trials(sweep: SweepConfig) -> int:
    """How many trials the sweep runs in all: Tune creates them as it goes, so a stopped sweep's
    ResultGrid may hold fewer."""
    grid = [len(spec) for key, spec in sweep.space.items() if key == LAYOUTS or isinstance(spec, list)]
    return sweep.num_samples * math.prod(grid)


def progress_lines(rows: list["TrialRow"], total: int, reason: Optional[str], command: str) -> list[str]:
    """What a stopped sweep tells its user: which trials finished, which did not, how to continue."""
    done = [r for r in rows if r.status in ("finished", "stopped early")]
    left = [r for r in rows if r not in done]
    lines = [f"[raytrain] sweep stopped by {reason or 'Tune'}: {len(done)} of {total} trials finished"
             + (": " + "; ".join(f"{r.trial_id} ({r.layout}, {r.params})" for r in done) if done else "")]
    unfinished = [f"{r.trial_id} ({r.layout}, {r.status}{'' if r.status == 'error' else f' at step {r.steps}'})"
                  for r in left] + ([f"{total - len(rows)} not started"] if total > len(rows) else [])
    if unfinished:
        lines.append("[raytrain] not finished: " + "; ".join(unfinished))
    lines.append(f"[raytrain] continue it with: {command}")
    return lines


# --- results ----------------------------------------------------------------------------------


@dataclass
class TrialRow:
    trial_id: str
    layout: str
    params: dict
    status: str
    steps: int
    loss: float
    samples_per_s: float
    first_step_s: float
    eval_loss: float = float("nan")
    """The last held-out loss the trial reported (NaN without eval.every)."""
    eval_metrics: dict = field(default_factory=dict)
    """The last eval.metrics the trial reported, by their names (``eval_accuracy``, ...)."""

    def value(self, metric: str) -> float:
        """The trial's figure for one of METRICS (NaN when it reported none)."""
        if metric.startswith("eval_") and metric != "eval_loss":
            return self.eval_metrics.get(metric, float("nan"))
        return getattr(self, metric)


def trial_statuses(experiment_path: str) -> dict[str, str]:
    """Trial directory name -> Tune's status (TERMINATED, ERROR; PENDING, RUNNING, PAUSED if the sweep
    was stopped), as Tune last saved them. Read from the saved state because a stopped sweep's
    ResultGrid has its trials already marked TERMINATED, and a restored trial's ``done`` metric is
    stale; {} when the state cannot be read."""
    from ray.tune import ExperimentAnalysis

    try:
        return {os.path.basename(t.path): t.status for t in ExperimentAnalysis(experiment_path).trials}
    except Exception:  # noqa: BLE001 - a report without statuses is still a report
        return {}


def summarize(grid, sweep: SweepConfig) -> list[TrialRow]:
    """One row per trial, sorted best first by the sweep's metric."""
    rows = []
    statuses = trial_statuses(grid.experiment_path)
    base_steps = build_config(flatten_sections(sweep.base, "sweep base")).train.steps
    for result in grid:
        m = result.metrics or {}
        params = {k: v for k, v in (result.config or {}).items() if k != "__base__"}
        ended = statuses.get(os.path.basename(result.path or ""), "TERMINATED") in ("TERMINATED", "ERROR")
        status = ("error" if result.error else "not finished" if not ended
                  else "finished" if m.get("step") == base_steps else "stopped early")
        rows.append(TrialRow(
            trial_id=m.get("trial_id", "?"), layout=m.get("layout", "?"), params=params, status=status,
            steps=m.get("step", 0), loss=m.get("loss", float("nan")), samples_per_s=m.get("samples_per_s", 0.0),
            first_step_s=m.get("first_step_s") or float("nan"), eval_loss=m.get("eval_loss", float("nan")),
            eval_metrics={k: v for k, v in m.items() if k.startswith("eval_") and k not in ("eval_loss", "eval_step")},
        ))
    return sorted(rows, key=lambda r: _rank_value(r.value(sweep.metric), sweep.mode), reverse=sweep.mode == "max")


def _rank_value(value: float, mode: str) -> float:
    """A trial's metric for sorting: NaN (never computed) ranks last either way."""
    if value != value:
        return -math.inf if mode == "max" else math.inf
    return value


def format_table(rows: list[TrialRow]) -> str:
    lines = [f"{'trial':<12} {'layout':<24} {'status':<14} {'steps':>5} {'loss':>8} {'eval_loss':>9} {'samples/s':>10} "
             f"{'first step s':>12}  params"]
    for r in rows:
        lines.append(f"{r.trial_id:<12} {r.layout:<24} {r.status:<14} {r.steps:>5} {r.loss:>8.4f} {r.eval_loss:>9.4f} "
                     f"{r.samples_per_s:>10.1f} {r.first_step_s:>12.1f}  {r.params}")
    return "\n".join(lines)


def write_reports(grid, rows: list[TrialRow], out_dir: str) -> tuple[str, str]:
    """results.csv (one row per trial) and layouts.png (throughput per layout, loss curves)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    csv_path, png_path = os.path.join(out_dir, "results.csv"), os.path.join(out_dir, "layouts.png")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial_id", "layout", "status", "steps", "loss", "eval_loss", "samples_per_s", "first_step_s",
                         "params"])
        for r in rows:
            writer.writerow([r.trial_id, r.layout, r.status, r.steps, r.loss, r.eval_loss, r.samples_per_s,
                             r.first_step_s, r.params])
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r.layout}\n{r.trial_id}" for r in rows]
    bars.barh(labels, [r.samples_per_s for r in rows], color="#4C72B0")
    bars.invert_yaxis()
    bars.set_xlabel("steady samples/s")
    bars.set_title("throughput per trial")
    for result in grid:
        df = result.metrics_dataframe
        if df is not None and "loss" in df:
            curves.plot(df["step"], df["loss"], label=(result.metrics or {}).get("layout", "?"))
    curves.set_xlabel("step")
    curves.set_ylabel("loss")
    curves.set_title("loss per trial")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return csv_path, png_path
