"""What a person sees of a run: a progress line, metrics.jsonl, loss.png and a Chrome trace.

With eval.every, the step rows where the held-out loss was computed carry ``eval_loss``: the
progress line shows the latest value (and its step), loss.png draws it as a second curve.

Runs in the driver, fed with the coordinator's metric rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence, TextIO

from raytrain.control.goodput import Goodput
from raytrain.driver.loggers import MetricLoggers
from raytrain.pipeline.actions import COMPUTE

if TYPE_CHECKING:
    from raytrain.config.layout import Layout

PROGRESS_INTERVAL_S = 2.0
"""Minimum seconds between progress lines when stderr is not a terminal."""


class RunReporter:
    """Writes every row it is given (``add``) and prints a progress line; draws the pictures at ``finish``.

    ``layout`` is the run's configured layout; a step row's ``dp`` (its live replicas, after a
    repair or a grow) says which variant of it the step ran on.
    """

    def __init__(self, run_dir: str, total_steps: int, layout: Layout, stream: TextIO = sys.stderr,
                 loggers: Sequence[str] = ()):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.total_steps = total_steps
        self.layout = layout
        self.stream = stream
        self.steps: list[dict] = []
        self.events: list[dict] = []
        self.goodput: Optional[Goodput] = None
        """The run's goodput, once it ended (``add_goodput``)."""
        self.traces: dict[int, dict] = {}  # step -> rank -> events
        self.last_eval: Optional[tuple[int, dict]] = None  # (step, its eval_* values) of the latest evaluation
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self._loggers = MetricLoggers(list(loggers), run_dir)  # run.loggers: TensorBoard, MLflow
        self._last_print = 0.0
        self._tty = stream.isatty()

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            if "events" in row:
                self.traces[row["step"]] = row.pop("events")
            if "event" not in row and self.steps and row["step"] <= self.steps[-1]["step"]:
                row["redone"] = True  # a restarted coordinator runs again the steps after its checkpoint
            self._metrics.write(json.dumps(row) + "\n")
            if "event" in row:
                self.events.append(row)
                if row["event"] == "started" and row.get("placement"):
                    self._print(f"[raytrain] placed: {where_placed(row['placement'])}")
                # a failure is reported once, by the caller; goodput by add_goodput
                elif row["event"] not in ("started", "failed", "goodput"):
                    self._print(f"[raytrain] {row['event']}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "event"))
            else:
                self.steps.append(row)
                if "eval_loss" in row:
                    self.last_eval = (row["step"], evaluated(row))
        self._metrics.flush()
        self._loggers.add(rows)
        stepped = any("event" not in row for row in rows)  # a batch of events alone repeats no progress line
        if stepped and self.steps[-1].get("loss") is not None and "samples_per_s" in self.steps[-1]:
            self._progress(self.steps[-1])

    def add_goodput(self, goodput: Goodput) -> None:
        """The run's goodput, once it ended: a ``goodput`` event and one line saying where the time went."""
        self.goodput = goodput
        self.add([{"event": "goodput", **goodput.record()}])
        self._print(f"[raytrain] {goodput.text()}")

    def _current_layout(self, row: dict) -> Layout:
        """The layout this step ran on: the configured one with the row's live replica count."""
        return self.layout.with_dp(row["dp"]) if "dp" in row else self.layout

    def _progress(self, row: dict) -> None:
        now = time.monotonic()
        last = row["step"] == self.total_steps
        if not self._tty and not last and now - self._last_print < PROGRESS_INTERVAL_S:
            return
        self._last_print = now
        layout = self._current_layout(row)
        bubble = f" | bubble {row['bubble']:.0%}" if layout.pp > 1 else ""
        lr = f" | lr {row['lr']:.2e}" if "lr" in row else ""
        line = (f"step {row['step']}/{self.total_steps} | loss {row['loss']:.4f}{self._eval_text(row)}{lr} | "
                f"{row['samples_per_s']:.1f} samples/s | {layout.label}{bubble}")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if last else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _eval_text(self, row: dict) -> str:
        """The latest held-out loss and eval.metrics, and the step they are of when that is not this row's."""
        if self.last_eval is None:
            return ""
        step, values = self.last_eval
        text = " ".join(f"{k} {v:.4f}" for k, v in values.items())
        return f" | {text}" + ("" if step == row["step"] else f" (step {step})")

    def _print(self, text: str) -> None:
        self.stream.write(("\n" if self._tty else "") + text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self._metrics.close()
        self._loggers.close()
        if self.steps:
            plot_loss(self.steps, os.path.join(self.run_dir, "loss.png"), self.layout.label)
        if self.traces:
            write_chrome_trace(self.traces, os.path.join(self.run_dir, "trace.json"))
            last = max(self.traces)
            plot_timeline(self.traces[last], os.path.join(self.run_dir, "timeline.png"), f"step {last}, {self.layout.label}")


def plot_loss(steps: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    known = [r for r in steps if r.get("loss") is not None]
    ax.plot([r["step"] for r in known], [r["loss"] for r in known], lw=1.5, label="training loss")
    measured = [r for r in steps if "eval_loss" in r]
    if measured:  # eval.every: the held-out loss at the steps it was computed, and eval.metrics beside it
        ax.plot([r["step"] for r in measured], [r["eval_loss"] for r in measured], "o-", lw=1.5, ms=4,
                label="held-out loss (eval_loss)")
        ax.legend(loc="upper left")
        _plot_metrics(ax, measured)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if measured else "training loss")
    ax.set_title(f"raytrain {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(per_rank: dict, path: str, title: str) -> None:
    """One step's per-worker timeline as a picture: forwards, backwards, communication, gaps = bubbles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    ranks = sorted(per_rank, key=int)
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(ranks) + 1.2))
    for row, rank in enumerate(ranks):
        for name, start, end in per_rank[rank]:
            kind = name[0] if name[0] in COMPUTE else "comm"
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8),
                           facecolors=colours.get(kind, "#BBBBBB"), edgecolor="white", linewidth=0.5)
            if kind in COMPUTE and (end - start) * 1e3 > 0:
                ax.text((start + end) / 2 * 1e3, row, name, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since step start (blue: forward, orange: backward, green: weight gradients, "
                  "grey: communication/optimizer)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_chrome_trace(traces: dict[int, dict], path: str) -> None:
    """Chrome trace (``traceEvents``) with one track per worker rank; steps laid end to end."""
    events = []
    offset_us = 0.0
    for step in sorted(traces):
        per_rank = traces[step]
        longest = 0.0
        for rank, acts in per_rank.items():
            if step == min(traces):
                events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": int(rank),
                               "args": {"name": f"worker rank {rank}"}})
            for name, start, end in acts:
                events.append({
                    "name": name, "cat": name[0] if name[0] in COMPUTE else "comm", "ph": "X", "pid": 0,
                    "tid": int(rank), "ts": offset_us + start * 1e6, "dur": max((end - start) * 1e6, 1.0),
                    "args": {"step": step},
                })
                longest = max(longest, end)
        offset_us += longest * 1e6 + 1000.0
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def evaluated(row: dict) -> dict:
    """A step row's held-out values: eval_loss, then eval.metrics' (``eval_accuracy``, ...)."""
    return {k: v for k, v in row.items() if k.startswith("eval_") and k not in ("eval_rows", "eval_s")}


def _plot_metrics(ax, measured: list[dict]) -> None:
    """eval.metrics on a second axis of the loss picture (accuracy, top5 in [0, 1]; mse, mae as measured)."""
    names = [k for k in evaluated(measured[-1]) if k != "eval_loss"]
    if not names:
        return
    right = ax.twinx()
    for name, style in zip(names, ("s--", "^--", "v--", "d--")):
        right.plot([r["step"] for r in measured], [r[name] for r in measured], style, lw=1.2, ms=4, label=name)
    right.set_ylabel(", ".join(names))
    right.legend(loc="upper right")


def where_placed(placement: dict[str, str]) -> str:
    """Which workers each node holds, one node after the other (a node by the first 8 digits of its id):
    ``node 5f3a0c1e: replica 0 stage 0 tp 0, replica 0 stage 0 tp 1; node 9b2d...: ...``."""
    by_node: dict[str, list[str]] = {}
    for place, node in placement.items():
        by_node.setdefault(node, []).append(place)
    if len(by_node) == 1:
        node, places = next(iter(by_node.items()))
        return f"all {len(places)} worker(s) on node {node[:8] or '?'}"
    return "; ".join(f"node {node[:8] or '?'}: {', '.join(places)}" for node, places in by_node.items())
