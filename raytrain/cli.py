"""``python -m raytrain train --config FILE [--set key=value ...]``; a thin shell over raytrain.train."""

from __future__ import annotations

import argparse
import json
import sys

from raytrain.config import load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raytrain", description=__doc__)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "sweep":
        return _sweep(args)
    from raytrain.api import ResourcesUnavailable, train
    from raytrain.coordinator import CapacityLost

    try:
        # train() validates data, resume and layout (raytrain.api.prepare) before any actor starts.
        result = train(load_config(args.config, args.overrides))
    except ValueError as e:
        print(f"raytrain: config error: {e}", file=sys.stderr)
        return 2
    except ResourcesUnavailable as e:
        print(f"raytrain: {e}", file=sys.stderr)
        return 3
    except CapacityLost as e:  # raised in the coordinator actor; its cause holds the plain message
        print(f"raytrain: capacity lost: {getattr(e, 'cause', e)}", file=sys.stderr)
        return 4
    print(json.dumps(result.summary()))
    return 0


def _sweep(args) -> int:
    from raytrain import tune as rt_tune
    from raytrain.placement import ResourcesUnavailable

    try:
        sweep = rt_tune.load_sweep_config(args.config, args.overrides)
        grid = rt_tune.run_sweep(sweep, resume=args.resume)
    except ValueError as e:
        print(f"raytrain: sweep config error: {e}", file=sys.stderr)
        return 2
    except ResourcesUnavailable as e:  # RAY_ADDRESS names no reachable cluster
        print(f"raytrain: {e}", file=sys.stderr)
        return 3
    rows = rt_tune.summarize(grid, sweep)
    print(rt_tune.format_table(rows), file=sys.stderr)
    csv_path, png_path = rt_tune.write_reports(grid, rows, grid.experiment_path)
    best = rows[0] if rows else None
    print(json.dumps({"experiment": grid.experiment_path, "trials": len(rows), "csv": csv_path, "plot": png_path,
                      "best": None if best is None else {"layout": best.layout, "params": best.params,
                                                         "samples_per_s": best.samples_per_s, "loss": best.loss}}))
    return 0 if not any(r.status == "error" for r in rows) else 1
