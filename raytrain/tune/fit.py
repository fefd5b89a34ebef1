"""Whether a sweep's trials can run, checked before any trial starts, and what each reserves.

Every layout the space names is built and checked as a run's would be (``check_inputs``,
``model_layout``), then against the cluster: a trial runs in the resources Tune reserved for it
(``trial_resources``: its own placement group), so it can neither grow nor keep standby workers.
"""

from __future__ import annotations

import dataclasses

from ray import tune

from raytrain.config import Config, build_config
from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.driver.model_check import model_layout
from raytrain.driver.placement import worker_bundle
from raytrain.driver.prepare import check_inputs
from raytrain.tune.space import layout_combinations, trial_values
from raytrain.tune.sweep_config import LAYOUT_KEYS, SweepConfig


def check_layouts(sweep: SweepConfig, cluster: dict[str, float]) -> None:
    """Reject, before any trial starts, layouts that are invalid or cannot fit the cluster."""
    problems = []
    for combo in layout_combinations(sweep):
        values = trial_values(sweep.base, combo)
        label = _trial_layout(values).label
        try:
            cfg = build_config(values)
            if cfg.parallel.auto:
                raise ValueError("parallel.auto=true: the sweep sets each trial's layout; drop parallel.auto from it")
            check_inputs(cfg)
            layout = model_layout(cfg)
        except ValueError as e:
            problems.append(f"{label}: {e}")
            continue
        problems += [f"{label}: {problem}" for problem in _fit_problems(cfg, layout, cluster)]
    if problems:
        raise ValueError("these layouts cannot run; remove them from the sweep space or add resources:\n  "
                         + "\n  ".join(problems))


def _trial_layout(values: dict) -> Layout:
    """The layout a trial's keys set, known also when they are invalid (it names the trial in errors)."""
    chosen = {key.split(".", 1)[1]: values[key] for key in LAYOUT_KEYS if key in values}
    axes = {axis.name: chosen.pop(axis.name) for axis in dataclasses.fields(Mesh) if axis.name in chosen}
    return Layout(mesh=Mesh(**axes), **chosen)


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
    """A trial's placement group: an empty head bundle for the trial's driver, then one bundle per worker."""
    world = Layout.of(cfg.parallel).world_size
    # An empty head bundle: Tune then places the trial driver without resources, and the placement
    # group holds exactly the workers' bundles (indices 0..world-1).
    # One placement group per trial: with tp > 1 it stays on one node, so that every tp group does.
    strategy = "STRICT_PACK" if cfg.parallel.tp > 1 else cfg.resources.placement_strategy
    return tune.PlacementGroupFactory([{}] + [worker_bundle(cfg)] * world, strategy=strategy)
