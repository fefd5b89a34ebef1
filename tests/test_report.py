"""The progress line a person watches: it names the layout each step actually ran on."""

import io
import os

from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.driver.report import RunReporter


def _step(step, dp, **extra):
    """A step row as the coordinator writes it: its live replicas as data, and their label."""
    return {"step": step, "loss": 2.5, "samples_per_s": 100.0, "layout": f"dp={dp} pp=2", "dp": dp, **extra}


def test_progress_line_follows_the_layout_through_a_grow_and_a_repair(tmp_path):
    out = io.StringIO()
    reporter = RunReporter(str(tmp_path), total_steps=3, layout=Layout(mesh=Mesh(pp=2), microbatches=4), stream=out)
    reporter.add([_step(1, dp=1, bubble=0.2)])
    reporter._last_print = 0.0  # not a terminal: lines are otherwise at most one per PROGRESS_INTERVAL_S
    reporter.add([{"event": "grow", "step": 1, "new_layout": "dp=2 pp=2"}, _step(2, dp=2, bubble=0.2)])
    reporter.add([_step(3, dp=1, bubble=0.2)])  # the last step always prints
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step")]
    assert lines == ["step 1/3 | loss 2.5000 | 100.0 samples/s | dp=1 pp=2 m=4 1f1b | bubble 20%",
                     "step 2/3 | loss 2.5000 | 100.0 samples/s | dp=2 pp=2 m=4 1f1b | bubble 20%",
                     "step 3/3 | loss 2.5000 | 100.0 samples/s | dp=1 pp=2 m=4 1f1b | bubble 20%"]
    assert "[raytrain] grow: step=1, new_layout=dp=2 pp=2" in out.getvalue()


def test_a_deep_pipeline_shows_its_bubble(tmp_path):
    # Whether a pipeline runs is the layout's pp, not a "pp=1" found in the label, which "pp=12" contains.
    out = io.StringIO()
    reporter = RunReporter(str(tmp_path), total_steps=1, layout=Layout(mesh=Mesh(pp=12), microbatches=12), stream=out)
    reporter.add([{"step": 1, "loss": 2.5, "samples_per_s": 100.0, "layout": "dp=1 pp=12", "dp": 1, "bubble": 0.5}])
    assert out.getvalue().splitlines() == ["step 1/1 | loss 2.5000 | 100.0 samples/s | dp=1 pp=12 m=12 1f1b | bubble 50%"]


def test_the_progress_line_shows_the_latest_held_out_loss_and_its_step(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    curves, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, x, y, *a, **kw: curves.append((kw.get("label"), list(x), list(y)))
                        or plot(ax, x, y, *a, **kw))
    out = io.StringIO()
    reporter = RunReporter(str(tmp_path), total_steps=3, layout=Layout(), stream=out)
    reporter.add([_step(1, dp=1)])
    reporter._last_print = 0.0
    reporter.add([_step(2, dp=1, eval_loss=2.25)])
    reporter._last_print = 0.0
    reporter.add([_step(3, dp=1)])
    reporter.finish()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step")]
    assert lines == ["step 1/3 | loss 2.5000 | 100.0 samples/s | dp=1 pp=1 m=1",
                     "step 2/3 | loss 2.5000 | eval_loss 2.2500 | 100.0 samples/s | dp=1 pp=1 m=1",
                     "step 3/3 | loss 2.5000 | eval_loss 2.2500 (step 2) | 100.0 samples/s | dp=1 pp=1 m=1"]
    assert os.path.getsize(tmp_path / "loss.png") > 0
    assert curves == [("training loss", [1, 2, 3], [2.5, 2.5, 2.5]), ("held-out loss (eval_loss)", [2], [2.25])]


def test_steps_run_again_after_a_coordinator_restart_are_marked_redone(tmp_path):
    import json

    reporter = RunReporter(str(tmp_path), total_steps=3, layout=Layout(), stream=io.StringIO())
    reporter.add([_step(1, dp=1), _step(2, dp=1)])
    reporter.add([{"event": "coordinator_restarted", "resume_from": "ckpt", "restarts": 1}, _step(2, dp=1), _step(3, dp=1)])
    reporter.finish()
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [(r["step"], r.get("redone", False)) for r in rows if "event" not in r] == [
        (1, False), (2, False), (2, True), (3, False)]
