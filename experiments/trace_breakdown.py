"""Where a pipeline step's time goes, per worker, from a run's trace.json (``run.trace_steps``).

For each traced step after the first (the first warms up): the schedule's span, and per worker the time in
forwards, backwards and weight halves, in receives (waiting for a peer), and idle between actions.
The figures behind "What raytrain's step is made of" in experiments/RESULTS.md:

    python -m raytrain train --set model.n_layer=8 --set model.d_model=256 --set model.n_head=4 \\
        --set model.seq_len=128 --set model.vocab_size=256 --set train.global_batch=32 --set train.steps=14 \\
        --set parallel.pp=2 --set parallel.schedule=zbv --set parallel.virtual_stages=2 \\
        --set parallel.microbatches=4 --set train.grad_clip=0 --set run.trace_steps=14 --set run.dir=/tmp/trace-runs
    python experiments/trace_breakdown.py /tmp/trace-runs/<run>
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

KINDS = {"F": "forward", "B": "backward", "W": "weight", "<": "receive", ">": "send"}


def breakdown(events: list[dict], step: int) -> tuple[float, dict[int, dict[str, float]]]:
    """The step's span (ms) and, per worker, milliseconds by kind of action plus ``idle``."""
    mine = [e for e in events if e["args"].get("step") == step]
    start, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
    workers: dict[int, dict[str, float]] = {}
    for tid in sorted({e["tid"] for e in mine}):
        spent: dict[str, float] = defaultdict(float)
        for e in (e for e in mine if e["tid"] == tid):
            spent[KINDS.get(e["name"][0], "other")] += e["dur"] / 1e3
        spent["idle"] = (end - start) / 1e3 - sum(spent.values())
        workers[tid] = dict(spent)
    return (end - start) / 1e3, workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory holding trace.json")
    args = parser.parse_args()
    with open(os.path.join(args.run_dir, "trace.json")) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "step" in e.get("args", {})]
    steps = sorted({e["args"]["step"] for e in events})
    columns = ["forward", "backward", "weight", "receive", "send", "other", "idle"]
    print(f"{'step':>4} {'worker':>6} {'span ms':>8} " + " ".join(f"{c:>8}" for c in columns) + f" {'busy':>5}")
    for step in steps[1:]:
        span, workers = breakdown(events, step)
        for tid, spent in workers.items():
            busy = sum(spent.get(k, 0.0) for k in ("forward", "backward", "weight")) / span
            print(f"{step:>4} {tid:>6} {span:>8.1f} " + " ".join(f"{spent.get(c, 0.0):>8.1f}" for c in columns)
                  + f" {busy:>5.2f}")


if __name__ == "__main__":
    main()
