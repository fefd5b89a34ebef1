"""A sweep's results: one row per trial (``summarize``), ranked by the sweep's metric, as a table, a CSV
and a plot (``write_reports``), and what a stopped sweep tells its user (``progress_lines``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

from raytrain.tune.space import BASE_KEY
from raytrain.tune.sweep_config import SweepConfig


@dataclass
class TrialRow:
    """One trial as the sweep's table, CSV and ranking show it (its last report, and how it ended)."""

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
        """The trial's figure for one of sweep_config.METRICS (NaN when it reported none)."""
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
    base_steps = sweep.base_config.train.steps
    for result in grid:
        m = result.metrics or {}
        params = {k: v for k, v in (result.config or {}).items() if k != BASE_KEY}
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


def progress_lines(rows: list[TrialRow], total: int, reason: Optional[str], command: str) -> list[str]:
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
