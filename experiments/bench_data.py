"""What a worker pays to open its dataset: decoding the Parquet column itself, against the per-machine
decoded cache (raytrain.data.token_cache) it memory-maps.

Writes a list<int64> token dataset (default 200,000 rows of 257 ids below 50,000: 51M tokens), then
opens it in fresh processes, as workers do: decoded directly, building the cache, and from the built
cache. Prints seconds and resident memory added (the tokens only: torch is imported first).

    python experiments/bench_data.py
    python experiments/bench_data.py --rows 50000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def open_once(path: str, cache_dir: str | None) -> dict:
    """Runs in a fresh process: open the dataset as a worker does and touch one batch."""
    import time

    import torch  # noqa: F401  (a worker has it already; keep its memory out of the figure)

    from raytrain import data

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before, t0 = rss_mb(), time.perf_counter()
    ds = data.TokenDataset(path, "tokens", 256, cache_dir=cache_dir)
    opened = time.perf_counter() - t0
    ds.batch(list(range(0, len(ds), 997)))
    return {"seconds": opened, "rss_mb": rss_mb() - before, "dtype": str(ds.rows.dtype)}


def write_dataset(path: str, rows: int, width: int = 257) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = np.random.default_rng(0).integers(0, 50_000, size=rows * width).astype(np.int64)
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, pa.array(flat))}), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, cache = args.child
        print(json.dumps(open_once(path, None if cache == "-" else cache)))
        return
    workdir = tempfile.mkdtemp()
    try:
        path, cache = os.path.join(workdir, "tokens.parquet"), os.path.join(workdir, "cache")
        write_dataset(path, args.rows)
        print(f"{args.rows * 257 / 1e6:.0f}M tokens, {os.path.getsize(path) / 2**20:.0f} MB of Parquet (list<int64>)")
        results = {}
        for name, cache_arg in [("decode in the worker", "-"), ("build the cache", cache), ("open the cache", cache)]:
            out = subprocess.run([sys.executable, __file__, "--child", path, cache_arg], capture_output=True,
                                 text=True, check=True, timeout=1800).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
        base = results["decode in the worker"]["seconds"]
        print(f"{'':<22} {'seconds':>8} {'vs decode':>10} {'RSS added MB':>13} {'rows dtype':>11}")
        for name, r in results.items():
            print(f"{name:<22} {r['seconds']:>8.3f} {r['seconds'] / base:>9.4f}x {r['rss_mb']:>13.0f} {r['dtype']:>11}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
