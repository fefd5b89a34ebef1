"""Which data a run trains on, by content: a cheap fingerprint of each file (``fingerprint``), which the
decode caches are keyed by (raytrain.data.token_cache) and which tells a copy of a training file held out.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from raytrain.data import shards
from raytrain.data.shards import Files

SCHEME = "edges-v1"
"""Names how ``fingerprint`` reads a file; fingerprints of another scheme are not compared by content."""
EDGE_BYTES = 1 << 20
"""Bytes hashed at each end of a file (a file of up to twice this is hashed whole)."""
PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class Fingerprint:
    """A data file's size and a hash of its content's ends: what its decoded cache is keyed by."""

    size: int
    digest: str
    """``<SCHEME>:<hex>``."""

    def __str__(self) -> str:
        return f"{self.size}:{self.digest}"


def fingerprint(path: str) -> Fingerprint:
    """A data file's fingerprint: its size, and the SHA-256 of its first and last EDGE_BYTES (all of it when
    smaller than twice that) and, for Parquet, of its whole footer however long.

    Catches an append, a truncation, any change of size, and a same-size rewrite that touches either end:
    for Parquet the footer alone holds every row group's offsets, sizes, row counts and min/max statistics,
    so new rows, reordered row groups or another encoding show there. Misses a same-size change confined to
    the middle of a file that leaves its footer as it was (two equal-sized rows swapped inside a row group of
    a larger, uncompressed file), and never looks at the modification time (``touch`` and ``cp -p`` change
    nothing). Reads about 2 MiB per file; opens only a regular file (shards.regular).
    """
    local = shards.local_path(shards.regular(path))
    if local is not None:
        with open(local, "rb") as f:
            return _fingerprint(f, os.fstat(f.fileno()).st_size)
    fs, where = shards.filesystem(path)
    with fs.open_input_file(where) as f:
        return _fingerprint(f, f.size())


def _fingerprint(f, size: int) -> Fingerprint:
    """``fingerprint`` of an open binary file (Python's or pyarrow's: seek and read) of ``size`` bytes."""
    digest = hashlib.sha256(f"{SCHEME}|{size}|".encode())
    if size <= 2 * EDGE_BYTES:
        digest.update(f.read(size))
        return Fingerprint(size, f"{SCHEME}:{digest.hexdigest()}")
    digest.update(f.read(EDGE_BYTES))
    tail = EDGE_BYTES
    f.seek(size - 8)
    end = f.read(8)
    if end[4:] == PARQUET_MAGIC:  # the footer's length, then the magic: hash the whole footer
        tail = max(tail, min(size - EDGE_BYTES, int.from_bytes(end[:4], "little") + 8))
    f.seek(size - tail)
    digest.update(f.read(tail))
    return Fingerprint(size, f"{SCHEME}:{digest.hexdigest()}")


def fingerprints(paths: list[str]) -> tuple[Fingerprint, ...]:
    return tuple(fingerprint(p) for p in paths)


def check_no_copies(train: Files, held: Files) -> None:
    """No held-out file (data.eval_path) has a training file's content (the same size and fingerprint): a
    copy of training rows held out makes the held-out loss a training loss. (The same file by name or link:
    shards.check_held_out_apart.)"""
    where = dict(zip(train.fingerprints, train.paths))
    for path, print_ in zip(held.paths, held.fingerprints):
        if print_ in where:
            raise ValueError(f"data.eval_path file {path!r} has the content of data.path's {where[print_]!r} (a copy: "
                             "the same size and fingerprint), so the held-out loss would be measured on training rows; "
                             "hold out other rows, or use data.eval_fraction instead")
