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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from raytrain.api import prepare

        prepare(cfg)  # data, resume and layout checks, still before any actor starts
    except ValueError as e:
        print(f"raytrain: config error: {e}", file=sys.stderr)
        return 2
    from raytrain.api import ResourcesUnavailable, train

    try:
        result = train(cfg)
    except ResourcesUnavailable as e:
        print(f"raytrain: {e}", file=sys.stderr)
        return 3
    print(json.dumps(result.summary()))
    return 0
