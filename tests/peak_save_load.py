"""Run alone (``python tests/peak_save_load.py OUT_DIR``): a stage's save and load, a sharded worker's
load of its rows from another layout's checkpoint, and a load from an object store (fsspec's in-memory
filesystem behind pyarrow, as ``memory://`` URIs), each with the anonymous memory it took beyond the
worker's own state, as JSON on stdout. A subprocess of its own, so no other thread's allocations
(a Ray driver's) land in the figures."""

from __future__ import annotations

import json
import sys

import torch

from raytrain import checkpoint
from raytrain.checkpoint import storage
from raytrain.testing.peak import PeakAnon
from raytrain.worker.stage_state import StageState

SHAPES = [(512, 1024)] * 14 + [(2048, 1024)]
"""8.4M parameters: 34 MB of values, 101 MB with AdamW's moments; the largest tensor is 8 MB."""


def trained_state(rows=None) -> StageState:
    """A stage whose optimizer has state, as after a step; ``rows``: the row slice each parameter holds."""
    torch.manual_seed(0)
    shapes = SHAPES if rows is None else [(stop - start, *s[1:]) for s, (start, stop, _) in zip(SHAPES, rows)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
    return StageState([f"p{i}" for i in range(len(params))], params, optimizer, torch.device("cpu"), False, rows)


def use_memory_filesystem() -> None:
    """Route ``memory://`` URIs to one fsspec in-memory filesystem: a pyarrow filesystem that is not local,
    as an object store is (its files cannot be memory-mapped)."""
    import fsspec
    import pyarrow.fs as pafs

    store = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    local = storage.filesystem
    storage.filesystem = lambda uri: (store, uri[len("memory://"):]) if uri.startswith("memory://") else local(uri)


def warm_up(out: str) -> None:
    """One tiny save and memory-mapped load, and one large copy, first: torch sets these up once per process
    (its weights-only unpickler, the zip reader, the thread pool a large copy starts), no cost of the state."""
    import os

    probe = os.path.join(out, "warm-up.pt")
    os.makedirs(out, exist_ok=True)
    torch.save({"t": torch.ones(4)}, probe)
    torch.load(probe, weights_only=True, mmap=True)
    os.remove(probe)
    torch.empty(1 << 22).copy_(torch.ones(1 << 22))


def main(out: str) -> None:
    warm_up(out)
    whole = trained_state()
    with PeakAnon() as save:
        entry = checkpoint.save_shard(out, 0, whole.shard())
    checkpoint.publish(out, {"step": 1, "shards": [entry]})
    with PeakAnon() as load:
        whole.load(out)
    half = [(0, s[0] // 2, s[0]) for s in SHAPES]
    sharded = trained_state(half)
    with PeakAnon() as load_rows:
        sharded.load(out)
    assert all(torch.equal(p, q[: p.shape[0]]) for p, q in zip(sharded.params, whole.params)), "rows loaded wrong"
    use_memory_filesystem()
    remote = "memory://bucket/ckpt"
    checkpoint.publish(remote, {"step": 1, "shards": [checkpoint.save_shard(remote, 0, whole.shard())]})
    fresh = trained_state()
    with torch.no_grad():
        for p in fresh.params:
            p.zero_()
    with PeakAnon() as load_remote:
        fresh.load(remote)
    assert all(torch.equal(p, q) for p, q in zip(fresh.params, whole.params)), "object-store load wrong"
    print(json.dumps({
        "state_bytes": sum(3 * p.numel() * 4 for p in whole.params),
        "largest_tensor_bytes": max(p.numel() * 4 for p in whole.params),
        "save_extra": save.extra, "load_extra": load.extra, "load_rows_extra": load_rows.extra,
        "load_object_store_extra": load_remote.extra,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
