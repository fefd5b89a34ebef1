"""The run's metrics where people already look: TensorBoard and MLflow (``run.loggers``).

metrics.jsonl stays the source of truth; a logger gets the same rows as they arrive and writes, per
step, the scalars ``loss``, ``eval_loss`` (and eval.metrics' ``eval_accuracy``, ...), ``lr``, ``grad_norm``
and ``samples_per_s``, each event
as a count (``events/repair``: how many so far, at the step it happened after), and at the end
``goodput``. TensorBoard's files go to ``<run dir>/tensorboard`` (torch's SummaryWriter, which needs
the ``tensorboard`` package); MLflow logs to its tracking URI (``MLFLOW_TRACKING_URI``, else a
SQLite database ``<run dir>/mlflow.db``, MLflow's recommended local store), one MLflow run per
raytrain run, named after its run directory.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from raytrain.config.schema import LOGGER_NAMES

SCALARS = ("loss", "eval_loss", "lr", "grad_norm", "samples_per_s")


def check_loggers(names: list[str]) -> None:
    """A ValueError naming run.loggers when a logger's package is not installed (before any actor starts)."""
    for name in names:
        assert name in LOGGER_NAMES, name  # the schema checked it
        if importlib.util.find_spec(name) is None:  # each logger is named after its package
            raise ValueError(f"run.loggers: {name!r} needs the {name} package, which is not installed: "
                             f"pip install {name}, or leave {name!r} out of run.loggers")


class MetricLoggers:
    """Every configured logger, fed the run's rows (``add``) and closed at the end (``close``)."""

    def __init__(self, names: list[str], run_dir: str):
        self._writers = [_open(name, run_dir) for name in names]
        self._events: dict[str, int] = {}
        self._step = 0

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            if "event" not in row:
                self._step = row["step"]
                values = {k: float(v) for k, v in row.items()
                          if (k in SCALARS or k.startswith("eval_")) and isinstance(v, (int, float))}
            elif row["event"] == "goodput":
                values = {"goodput": row["goodput"]}
            else:
                self._events[row["event"]] = self._events.get(row["event"], 0) + 1
                values = {f"events/{row['event']}": float(self._events[row["event"]])}
            for writer in self._writers:
                writer.log(values, self._step)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


def _open(name: str, run_dir: str):
    return TensorBoardWriter(run_dir) if name == "tensorboard" else MLflowWriter(run_dir)


class TensorBoardWriter:
    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflowWriter:
    """One MLflow run, through mlflow's client API (no global active run: sweeps run trials side by side)."""

    def __init__(self, run_dir: str):
        from mlflow.tracking import MlflowClient

        uri: Optional[str] = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(run_dir, 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("raytrain")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("raytrain")
        self.run_id = self.client.create_run(experiment_id, run_name=os.path.basename(run_dir)).info.run_id

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
