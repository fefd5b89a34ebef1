"""``python -m raytrain train --config FILE [--set key=value ...]``; a thin shell over raytrain.train."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from typing import TYPE_CHECKING, Optional, TextIO

from raytrain.config import load_config

if TYPE_CHECKING:
    from raytrain.driver.signals import ProcessSignals


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raytrain", description=__doc__, epilog=EXIT_CODES)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model (connects to RAY_ADDRESS, else starts a local Ray)")
    t.add_argument("--config", help="YAML config file (see experiments/configs/)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.dp=2 (repeatable)")
    s = sub.add_parser("sweep", help="Ray Tune sweep over layouts and hyper-parameters")
    s.add_argument("--config", required=True, help="sweep YAML: a train config plus 'space:' (and 'sweep:')")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a base key (train.steps=20) or a sweep setting (sweep.scheduler=asha)")
    s.add_argument("--resume", metavar="EXPERIMENT_DIR", help="resume an interrupted sweep from its experiment directory")
    e = sub.add_parser("export", help="write a model.hf run's checkpoint as a Hugging Face model directory")
    e.add_argument("--checkpoint", required=True, help="a step directory, or a checkpoint directory (its latest)")
    e.add_argument("--out", required=True, help="the directory to create (config.json + model.safetensors)")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="run the model.hf directory's auto_map code (only code you have read; off: refused)")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="tensor dtype (default: the model's own, from its config.json; else float32)")
    return parser


EXIT_CODES = """exit codes: 0 done; 1 a step failed (the worker's error is printed); 2 bad configuration or
input (nothing started); 3 the cluster cannot be reached or cannot grant the resources; 4 capacity lost
during the run, or out of memory (a worker ran out and the run could not go on: the line names it and
what to change); 5 a non-finite loss or gradient (nothing of that step applied); 130 / 143 stopped by
SIGINT / SIGTERM at a step boundary, after a checkpoint (the same signal again within a second is the same
request; a later one aborts, naming the last checkpoint committed). The last line of stdout is a JSON
summary"""


def main(argv: list[str] | None = None, out: Optional[TextIO] = None,
         signals: Optional["ProcessSignals"] = None) -> int:
    """Run one command; its exit code. Its result (a JSON line) goes to ``out`` (default stdout);
    ``signals`` are the process's stop-signal handlers when the CLI is the process (raytrain.__main__)."""
    from raytrain.driver.signals import ProcessSignals

    args = _parser().parse_args(argv)
    out = out or sys.stdout
    signals = signals or ProcessSignals()  # not entered: its reports change nothing
    if args.command == "sweep":
        return _sweep(args, out)
    if args.command == "export":
        return _export(args, out)
    return _train(args, out, signals)


def _train(args, out: TextIO, signals: "ProcessSignals") -> int:
    """``train``: its summary line however it ends, unless it ends on bad input or a failure (a line on stderr)."""
    from raytrain.api import ResourcesUnavailable, train
    from raytrain.control.coordinator import CapacityLost, NonFiniteLoss, OutOfMemoryLost, StepFailed
    from raytrain.driver.signals import exit_code

    result = None
    try:
        with warnings_on_one_line():
            cfg = load_config(args.config, args.overrides)
        # train() validates data, resume and layout (raytrain.driver.prepare.prepare) before any actor starts.
        result = train(cfg)
        signals.ended()
    except ValueError as e:
        return _fail(f"config error: {e}", 2)
    except ResourcesUnavailable as e:
        return _fail(str(e), 3)
    except OutOfMemoryLost as e:
        return _fail(f"out of memory: {e}", 4)
    except CapacityLost as e:
        return _fail(f"capacity lost: {e}", 4)
    except NonFiniteLoss as e:
        return _fail(f"non-finite loss: {e}", 5)
    except StepFailed as e:
        return _fail(f"step failed: {e}", 1)
    except KeyboardInterrupt as e:  # an aborting signal (signals.Aborted), or Ctrl-C before the run started
        signals.ended()
        if result is None:
            return _report_abort(out, e, signals)
    return _report(out, result.summary(), exit_code(result.stopped) if result.stopped else 0, signals)


def _report_abort(out: TextIO, error: KeyboardInterrupt, signals: "ProcessSignals") -> int:
    """An aborted run's line on stderr and summary line on stdout, naming the last checkpoint it committed."""
    from raytrain.driver.signals import Aborted, exit_code

    reason = getattr(error, "reason", "SIGINT")
    summary = (error if isinstance(error, Aborted) else Aborted(reason)).summary()
    kept = (f"the last checkpoint it committed, {summary['checkpoint']} (step {summary['steps']}), is intact "
            "(--set checkpoint.resume=latest)" if summary["checkpoint"] else "it committed no checkpoint")
    _fail(f"aborted by {reason}: the run did not wait for a step boundary; {kept}", exit_code(reason))
    return _aborted(_report(out, summary, exit_code(reason), signals))


def _report(out: TextIO, summary: dict, code: int, signals: "ProcessSignals") -> int:
    """Write the command's result line (the last line of its stdout); returns ``code``."""
    out.write(json.dumps(summary) + "\n")
    out.flush()
    signals.reported(code)
    return code


@contextlib.contextmanager
def warnings_on_one_line():
    """Warnings while the config is read (a renamed key's DeprecationWarning), each printed once as one
    line: they are meant for the person at the terminal, and Python hides a DeprecationWarning raised
    outside __main__."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            yield
        finally:
            for line in dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught):
                print(f"raytrain: {line}", file=sys.stderr)


def _fail(message: str, code: int) -> int:
    print(f"raytrain: {message}", file=sys.stderr)
    return code


def _export(args, out: TextIO) -> int:
    from raytrain.models.export import export_hf

    try:
        step_dir = export_hf(args.checkpoint, args.out, args.dtype, args.trust_remote_code)
    except ValueError as e:  # a CheckpointError too
        return _fail(f"export: {e}", 2)
    print(json.dumps({"exported": step_dir, "out": args.out}), file=out, flush=True)
    return 0


def _sweep(args, out: TextIO) -> int:
    from raytrain import tune as rt_tune
    from raytrain.driver.placement import ResourcesUnavailable
    from raytrain.driver.signals import exit_code

    stop, where = rt_tune.SweepStop(sys.stderr), None
    try:
        with stop:
            with warnings_on_one_line():
                sweep = rt_tune.named(rt_tune.load_sweep_config(args.config, args.overrides))
            where = rt_tune.resumable_dir(args.resume) if args.resume else rt_tune.planned_dir(sweep)
            # checked: now the driver (its import starts a background import of torch) and Ray
            from raytrain.driver.run import ensure_ray

            ensure_ray()  # here, not in run_sweep, so that the handlers go back on top of Ray's
            stop.install()
            stop.resume_command = _resume_command(args, where)
            grid = rt_tune.run_sweep(sweep, resume=args.resume)
            stop.reporting()
            return _sweep_report(grid, sweep, stop.reason, _resume_command(args, where), out)
    except ValueError as e:
        print(f"raytrain: sweep config error: {e}", file=sys.stderr)
        return 2
    except ResourcesUnavailable as e:  # RAY_ADDRESS names no reachable cluster, or trials waited too long
        hint = f"; continue it with: {_resume_command(args, where)}" if isinstance(e, rt_tune.SweepStalled) else ""
        print(f"raytrain: {e}{hint}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # a second signal, or one before Tune started
        from ray import tune

        hint = (f"; continue it with: {_resume_command(args, where)}" if where and tune.Tuner.can_restore(where)
                else "")
        print(f"raytrain: sweep {e}{hint}", file=sys.stderr, flush=True)
        return _aborted(exit_code(stop.reason or "SIGINT"))


def _aborted(code: int, bound_s: float = 20.0) -> int:
    """After an abort's one line: mute stderr, where Ray's teardown prints what the workers and trial
    processes stopped mid-step raised (it says nothing the line has not said), and bound that teardown."""
    import os
    import threading

    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    timer = threading.Timer(bound_s, os._exit, (code,))
    timer.daemon = True  # still runs while atexit's ray.shutdown does; never holds the exit back
    timer.start()
    return code


def _sweep_report(grid, sweep, reason, command: str, out: TextIO) -> int:
    """The ranked table, reports and JSON line; a stopped sweep's are marked partial, with no "best"."""
    from raytrain import tune as rt_tune
    from raytrain.driver.signals import exit_code

    rows = rt_tune.summarize(grid, sweep)
    print(rt_tune.format_table(rows), file=sys.stderr)
    csv_path, png_path = rt_tune.write_reports(grid, rows, grid.experiment_path)
    total = max(rt_tune.expected_trials(sweep), len(rows))
    finished = sum(r.status in ("finished", "stopped early") for r in rows)
    summary = {"experiment": grid.experiment_path, "trials": total, "finished": finished, "csv": csv_path,
               "plot": png_path}
    if reason or finished + sum(r.status == "error" for r in rows) < total:
        for line in rt_tune.progress_lines(rows, total, reason, command):
            print(line, file=sys.stderr)
        print(json.dumps({**summary, "interrupted": True, "signal": reason, "resume": command, "best": None}),
              file=out, flush=True)
        return exit_code(reason) if reason else 1
    best = next((r for r in rows if r.status in ("finished", "stopped early")), None)  # rows come best first
    if best is None:
        print(f"[raytrain] no trial finished: all {len(rows)} failed (see the table); the best is none", file=sys.stderr)
    print(json.dumps({**summary, "interrupted": False, "best": None if best is None else {
        "layout": best.layout, "params": best.params, "samples_per_s": best.samples_per_s, "loss": best.loss}}),
        file=out, flush=True)
    return 0 if not any(r.status == "error" for r in rows) else 1


def _resume_command(args, where: str) -> str:
    """The command that continues this sweep, runnable from any directory."""
    import os
    import shlex

    sets = "".join(f" --set {shlex.quote(text)}" for text in args.overrides)
    return (f"python -m raytrain sweep --config {shlex.quote(os.path.abspath(args.config))}{sets} "
            f"--resume {shlex.quote(where)}")
