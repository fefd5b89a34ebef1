"""A worker's start-up CPU: its imports with Python's cyclic collector running, against raytrain's
(``raytrain.worker.actor.import_torch_uncollected``: collector paused, then the imported objects frozen).

Every repeat runs both ways in fresh interpreters that have imported Ray first (as a Ray worker process
has), alternating, and prints the median CPU seconds of the imports a StageWorker pays before it builds
its stage (torch, torch._dynamo, raytrain.worker.stage), the median cost of one full collection
afterwards (what a full collection costs during training), and raytrain's against the plain ones.

    python experiments/bench_worker_start.py              # about a minute on 2 cores
    python experiments/bench_worker_start.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import gc, json, resource, time
import ray  # a Ray worker process has imported it before raytrain's code runs

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

start = cpu()
if {uncollected}:
    from raytrain.worker.actor import import_torch_uncollected
    import_torch_uncollected()
else:
    import raytrain.worker.actor
    import torch._dynamo
    import raytrain.worker.stage
imported = cpu()
gc.collect()
print(json.dumps({{"imports_s": imported - start, "full_collection_s": cpu() - imported}}))
"""


def measure(uncollected: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(uncollected=uncollected)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for uncollected in (False, True):
            runs[uncollected].append(measure(uncollected))
    median = {way: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for way, rows in runs.items()}
    print(f"{'imports':<34}{'CPU s':>8}{'full collection s':>20}")
    for way, label in ((False, "collector running (plain)"), (True, "paused, then frozen (raytrain)")):
        print(f"{label:<34}{median[way]['imports_s']:>8.2f}{median[way]['full_collection_s']:>20.3f}")
    print(f"raytrain / plain, import CPU: {median[True]['imports_s'] / median[False]['imports_s']:.2f}x "
          f"(median of {args.repeats})")


if __name__ == "__main__":
    main()
