"""run.loggers: the run's rows as TensorBoard scalars (read back with tensorboard's own reader), and
loggers whose package is missing refused before any actor starts. On actors: tests/test_elastic.py."""

import importlib.util

import pytest

from raytrain.config import load_config
from raytrain.driver.loggers import MetricLoggers, check_loggers
from raytrain.driver.prepare import prepare


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard files: tag -> [(step, value)], by tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_the_step_scalars_event_counts_and_goodput(tmp_path):
    loggers = MetricLoggers(["tensorboard"], str(tmp_path))
    loggers.add([{"event": "started", "layout": "dp=2"}])
    loggers.add([{"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0, "samples_per_s": 40.0, "layout": "dp=2"},
                 {"event": "repair", "step": 1}, {"step": 2, "loss": 5.0, "eval_loss": 5.25, "lr": 1e-3},
                 {"event": "repair", "step": 2}])
    loggers.add([{"event": "goodput", "goodput": 0.75, "wall_s": 4.0, "good_s": 3.0, "badput_s": {}}])
    loggers.close()
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == [(1, 5.5), (2, 5.0)] and scalars["eval_loss"] == [(2, 5.25)]
    assert scalars["samples_per_s"] == [(1, 40.0)] and scalars["lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))]
    assert scalars["events/repair"] == [(1, 1.0), (2, 2.0)] and scalars["events/started"] == [(0, 1.0)]
    assert scalars["goodput"] == [(2, 0.75)]


@pytest.mark.parametrize("loggers, words", [
    ("['wandb']", ["run.loggers", "['wandb']", "tensorboard, mlflow"]),
    ("tensorboard", ["run.loggers", "expects a list"]),
])
def test_an_unknown_logger_is_refused_naming_the_key(tmp_path, loggers, words):
    with pytest.raises(ValueError) as e:
        load_config(None, [f"run.loggers={loggers}", f"run.dir={tmp_path}"])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_logger_whose_package_is_missing_is_refused_before_any_actor(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"run.loggers: 'mlflow' needs the mlflow package.*pip install mlflow"):
        prepare(load_config(None, ["run.loggers=['tensorboard', 'mlflow']", f"run.dir={tmp_path}"]))
    check_loggers(["tensorboard"])  # installed with the test extra
