"""Signals to a whole process group, repeated: each run is ``python -m raytrain train`` on an embedded Ray (no
RAY_ADDRESS, no checkpoint.every), signalled once it has trained a few steps, the way a scheduler ends a job:

- ``group``: SIGTERM to the driver's process group (``kill -TERM -PGID``, Kubernetes, Slurm's first signal);
- ``timeout``: coreutils ``timeout -s TERM`` expiring (it signals the driver, then its group);
- ``twice``: SIGTERM twice 1 ms apart (a signal repeated within a second is one request);
- ``sigint``: SIGINT to the group (Ctrl-C in a terminal).

Each run must end at a step boundary with a checkpoint of that step, exit 143 (130 for SIGINT), and the JSON
summary as the last line of stdout. Prints one row per run and the tally.

    python experiments/stress_signals.py --runs 20 --how group
    python experiments/stress_signals.py --runs 5 --how group,timeout,twice,sigint
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 180
"""Bound on a run's start (Ray, workers, the first steps) and on its end after the signal."""


def start(workdir: str, wrapper: tuple = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [*wrapper, sys.executable, "-m", "raytrain", "train", "--config", "experiments/configs/tiny.yaml",
           "--set", "train.steps=100000", "--set", f"run.dir={workdir}/runs", "--set", "run.trace_steps=0",
           "--set", "checkpoint.every=0", "--set", "data.max_bytes=200000"]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def trained(workdir: str, steps: int = 3) -> bool:
    for metrics in Path(workdir, "runs").glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if sum("loss" in r and "event" not in r for r in rows) >= steps:
            return True
    return False


def signal_run(proc: subprocess.Popen, how: str) -> None:
    if how == "timeout":  # timeout's own SIGALRM is what its expiry is: it then signals the driver and its group
        os.kill(proc.pid, signal.SIGALRM)
    elif how == "twice":
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT if how == "sigint" else signal.SIGTERM)


def one_run(how: str) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        wrapper = ("timeout", "--preserve-status", "-s", "TERM", "3600") if how == "timeout" else ()
        proc = start(workdir, wrapper)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and proc.poll() is None and not trained(workdir):
            time.sleep(0.2)
        sent = time.monotonic()
        signal_run(proc, how)
        try:
            out, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return judge(how, proc.returncode, out, err, time.monotonic() - sent)


def judge(how: str, code: int, out: str, err: str, took_s: float) -> dict:
    """What one run did, and whether it kept every promise."""
    from raytrain import checkpoint

    lines = out.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    expected = 130 if how == "sigint" else 143
    saved = summary.get("checkpoint")
    at_boundary = bool(saved) and checkpoint.read_manifest(saved)["step"] == summary.get("steps")
    ok = code == expected and len(lines) == 1 and summary.get("stopped") and at_boundary and "aborted" not in err
    return {"how": how, "exit": code, "stdout_lines": len(lines), "stopped": summary.get("stopped"),
            "steps": summary.get("steps"), "checkpoint_at_step": at_boundary, "exit_s": round(took_s, 1), "ok": bool(ok),
            "tail": "" if ok else err.strip().splitlines()[-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--how", default="group", help="comma-separated: group, timeout, twice, sigint")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        for how in args.how.split(","):
            row = one_run(how)
            rows.append(row)
            print(json.dumps({"run": i + 1, **row}), flush=True)
    for how in args.how.split(","):
        mine = [r for r in rows if r["how"] == how]
        times = sorted(r["exit_s"] for r in mine)
        print(f"{how}: {sum(r['ok'] for r in mine)} of {len(mine)} ended at a step boundary with a checkpoint, "
              f"the exit code and the summary; signal to exit {times[0]}-{times[-1]} s (median {times[len(times) // 2]})")


if __name__ == "__main__":
    main()
