"""What a worker pays to open its dataset: decoding the Parquet column itself, against the per-machine
decoded cache (raytrain.data.token_cache) it memory-maps.

Writes a list<int64> token dataset (default 200,000 rows of 257 ids below 50,000: 51M tokens), then
opens it in fresh processes, as workers do: decoded directly, building the cache, and from the built
cache. Prints seconds and resident memory added (the tokens only: torch is imported first).

``--first-step``: the same tokens as one file and as ``--shards`` (200) Parquet shards (data.path a
directory), and what each costs before the first step, every part in a fresh process with cold caches:
the driver's prepare (footers, and the scan a list column needs), prepare again (the scan remembered),
and a worker's data for step 0 (open the files lazily, read step 0's ``--global-batch`` samples: only
the shards they fall in are decoded). Prints seconds, the shards decoded, and sharded / one file.
With ``--train`` also a real one-step run (raytrain.train, dp=1, a tiny GPT) of each: its first step's
wall time (``step_s``, which includes the worker's decode) and the run's, on an embedded Ray started first
and warmed by one run (the first run's workers start slower, whatever its data).

    python experiments/bench_data.py
    python experiments/bench_data.py --rows 50000
    python experiments/bench_data.py --first-step --train
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


def write_dataset(path: str, rows: int, width: int = 257, shards: int = 0) -> None:
    """``rows`` rows of ``width`` ids as one file at ``path``, or with ``shards`` as that many files of
    consecutive rows in the directory ``path`` (part-00000.parquet, ...: sorted order is row order)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = np.random.default_rng(0).integers(0, 50_000, size=rows * width).astype(np.int64)
    if not shards:
        offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
        pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, pa.array(flat))}), path)
        return
    os.makedirs(path)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        offsets = pa.array(np.arange(0, (b - a) * width + 1, width, dtype=np.int32))
        values = pa.array(flat[a * width : b * width])
        pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)}),
                       os.path.join(path, f"part-{i:05d}.parquet"))


def first_step_config(path: str, workdir: str, global_batch: int, cache: str = ""):
    from raytrain.config import load_config

    return load_config(None, [
        f"data.path={path}", f"data.cache_dir={os.path.join(workdir, 'cache-' + (cache or os.path.basename(path)))}",
        "model.seq_len=256", "model.vocab_size=50000", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        f"train.global_batch={global_batch}", "train.steps=1", f"run.dir={os.path.join(workdir, 'runs')}",
        "run.trace_steps=0", "checkpoint.every=0"])


def data_before_first_step(path: str, workdir: str, global_batch: int) -> dict:
    """Runs in a fresh process: the driver's prepare twice, then a worker's data for step 0."""
    import time

    import torch  # noqa: F401  (a worker has it already)

    from raytrain import data
    from raytrain.driver.prepare import prepare

    cfg = first_step_config(path, workdir, global_batch)
    t0 = time.perf_counter()
    prepared = prepare(cfg)
    t1 = time.perf_counter()
    prepare(cfg)
    t2 = time.perf_counter()
    dataset = data.open_dataset(prepared.source.train, prepared.cfg)  # what a worker's join opens
    dataset.batch(data.sample_ids(cfg.train.seed, prepared.num_samples, 0, global_batch))  # step 0's samples
    t3 = time.perf_counter()
    return {"prepare_s": t1 - t0, "prepare_again_s": t2 - t1, "worker_step0_data_s": t3 - t2,
            "decoded": len(dataset.opened), "files": len(prepared.source.train.paths), "samples": prepared.num_samples}


def train_one_step(path: str, workdir: str, global_batch: int, cache: str = "") -> dict:
    """A real one-step run on ``path`` (the embedded Ray is already up), with a cold data cache: the first
    step's wall time and the run's."""
    import io
    import time

    from raytrain import train

    cfg = first_step_config(path, workdir, global_batch, cache)
    shutil.rmtree(cfg.data.cache_dir, ignore_errors=True)  # cold, as on a machine new to the data
    t0 = time.perf_counter()
    result = train(cfg, stream=io.StringIO())
    return {"first_step_s": result.metrics[0]["step_s"], "run_s": time.perf_counter() - t0}


def first_step(args) -> None:
    workdir = tempfile.mkdtemp()
    try:
        one, many = os.path.join(workdir, "one.parquet"), os.path.join(workdir, f"shards{args.shards}")
        write_dataset(one, args.rows)
        write_dataset(many, args.rows, shards=args.shards)
        print(f"{args.rows * 257 / 1e6:.0f}M tokens (list<int64>, rows of 257): one file of "
              f"{os.path.getsize(one) / 2**20:.0f} MB, or {args.shards} shards; train.global_batch={args.global_batch}")
        results = {}
        for name, path in [("one file", one), (f"{args.shards} shards", many)]:
            out = subprocess.run([sys.executable, __file__, "--first-step-child", path, workdir,
                                  str(args.global_batch)], capture_output=True, text=True, check=True,
                                 timeout=3600).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
        if args.train:
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            train_one_step(many, workdir, args.global_batch, cache="warm-up")  # Ray's first workers start slower
            for name, path in [("one file", one), (f"{args.shards} shards", many)]:
                results[name].update(train_one_step(path, workdir, args.global_batch))
            ray.shutdown()
        keys = [k for k in results["one file"] if k.endswith("_s")]
        print(f"{'':<12}" + "".join(f"{k:>21}" for k in keys) + f"{'files decoded':>16}")
        for name, r in results.items():
            print(f"{name:<12}" + "".join(f"{r[k]:>21.3f}" for k in keys) + f"{r['decoded']:>9} of {r['files']:<4}")
        a, b = results["one file"], results[f"{args.shards} shards"]
        print(f"{'ratio':<12}" + "".join(f"{b[k] / a[k]:>20.3f}x" for k in keys) + "   (shards / one file)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--first-step", action="store_true", help="one file against --shards shards, before step 0")
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--train", action="store_true", help="with --first-step: also a real one-step run of each")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--first-step-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step_child:
        path, workdir, batch = args.first_step_child
        print(json.dumps(data_before_first_step(path, workdir, int(batch))))
        return
    if args.first_step:
        first_step(args)
        return
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
