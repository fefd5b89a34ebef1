"""A Parquet token column decoded once per machine into a ``.npy`` file that workers memory-map.

Decoding Parquet gives every worker a private copy of the whole column, and for a list column it is
slow (nesting levels and dictionary pages unpacked value by value). The cache turns that into one
decode per machine and dataset version: every later worker, run or replacement maps the same file
read-only, so the operating system's page cache holds the tokens once per machine, however many
workers read them, and opening it costs the file's fingerprint (about 2 MiB read, taken again by each
worker: the content now, not as prepare saw it, keys the cache) and a memory map.

The first worker on a machine builds it under a file lock while the others wait; it is written
atomically (raytrain.data.atomic), so no reader ever sees a half file. The key covers the source file's
path (or URI) and its content (raytrain.data.identity.fingerprint: its size and a hash of its ends and
Parquet footer, never its modification time), so a rewritten dataset gets a new cache even when its size
and mtime are the old ones, and FORMAT, so rows cut another way (before FORMAT, long rows were cut to their
first window) are never read back.

A row becomes its windows of ``width`` tokens (raytrain.data.TokenDataset), so the row count does not
give the array's size: a fixed-width column's does (rows x windows a row), and it is decoded straight
into the array; any other is decoded into a raw stream first and copied behind the ``.npy`` header.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.data import identity, shards
from raytrain.data.atomic import atomic_path


FORMAT = "windows-v1"
"""Part of the cache key of token rows: a change to how rows become samples must change it."""


def fixed_width(kind: pa.DataType) -> Optional[int]:
    """Tokens in every row when the type fixes it, else None."""
    if pa.types.is_fixed_size_list(kind):
        return kind.list_size
    if pa.types.is_fixed_size_binary(kind):
        return kind.byte_width
    return None


SCAN_FORMAT = "scan-v1"
"""Part of the key of a remembered scan (``remembered``): a change to what a scan records must change it."""


def cache_path(source: str, column: str, width: int, cache_dir: str, variant: str = FORMAT,
               folder: str = "decoded", suffix: str = ".npy",
               fingerprint: Optional[identity.Fingerprint] = None) -> str:
    """Where the decoded rows of ``source``'s ``column`` (its windows of ``width`` tokens) live, for the
    content ``source`` has now (its ``fingerprint``, read from the file when not given).

    ``variant`` names anything else the rows depend on (raytrain.data.text: the tokenizer's hash). ``source``
    is a local path or a pyarrow.fs URI (raytrain.data.shards)."""
    fingerprint = fingerprint or identity.fingerprint(source)
    where = shards.local_path(source) or source
    key = f"{where}|{fingerprint}|{column}|{width}" + (f"|{variant}" if variant else "")
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(cache_dir), folder, f"{shards.basename(source)}-{digest}{suffix}")


def remembered(source: str, column: str, width: int, cache_dir: str, compute: Callable[[], dict],
               fingerprint: Optional[identity.Fingerprint] = None) -> dict:
    """``compute()``'s facts (JSON) about this version of ``source``'s column (its content: ``fingerprint``),
    computed once per machine and kept under ``checked/``: the driver's scan of a column whose window count no
    footer gives (rows of any length), so that preparing the same files again (a resume, a restart, a sweep's
    trials) reads footers and fingerprints only. A compute that raises (a bad file) leaves nothing behind."""
    path = cache_path(source, column, width, cache_dir, variant=SCAN_FORMAT, folder="checked", suffix=".json",
                      fingerprint=fingerprint)
    with contextlib.suppress(FileNotFoundError, ValueError):
        with open(path) as f:
            return json.load(f)
    facts = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(facts, f)
    return facts


def open_rows(source: str, column: str, width: int, cache_dir: str, decode) -> np.ndarray:
    """The (N, width) token windows of ``source``, memory-mapped read-only; built with ``decode(table)``
    (one row group's table -> its windows) the first time on this machine."""
    path = cache_path(source, column, width, cache_dir)
    return open_built(path, lambda out: _build(source, column, width, out, decode))


def open_built(path: str, build: Callable[[str], None]) -> np.ndarray:
    """The ``.npy`` array at ``path``, memory-mapped read-only; when this machine lacks it, ``build(path)``
    writes it first (atomically: raytrain.data.atomic), one builder at a time while the others wait."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not os.path.exists(path):  # another worker may have built it while this one waited
                build(path)
    return np.load(path, mmap_mode="r")


def _build(source: str, column: str, width: int, path: str, decode) -> None:
    """Decode one row group at a time into the file: memory stays at one row group."""
    parquet = pq.ParquetFile(shards.open_input(source))
    dtype = _smallest_dtype(parquet, column)
    groups = (decode(parquet.read_row_group(g, columns=[column], use_threads=False))
              for g in range(parquet.num_row_groups))
    fixed = fixed_width(parquet.schema_arrow.field(column).type)
    with atomic_path(path) as tmp:
        if fixed is not None:
            _write_known(groups, parquet.metadata.num_rows * (fixed // width), width, dtype, tmp)
        else:
            _write_streamed(groups, width, dtype, tmp)


def _write_known(groups, rows: int, width: int, dtype: np.dtype, path: str) -> None:
    """Windows whose count is known ahead: straight into a preallocated ``.npy``."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, width))
    start = 0
    for windows in groups:
        out[start : start + len(windows)] = windows
        start += len(windows)
    assert start == rows, (start, rows)
    out.flush()
    del out  # unmapped before the rename


def _write_streamed(groups, width: int, dtype: np.dtype, path: str) -> None:
    """Windows counted as they come: appended to a raw stream, then copied behind the ``.npy`` header."""
    stream, rows = path + ".stream", 0
    try:
        with open(stream, "wb") as f:
            for windows in groups:
                np.ascontiguousarray(windows, dtype=dtype).tofile(f)
                rows += len(windows)
        with open(path, "wb") as out, open(stream, "rb") as raw:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (rows, width)}
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 1 << 24)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(stream)


def _smallest_dtype(parquet: pq.ParquetFile, column: str) -> np.dtype:
    """uint8 or uint16 when the column's statistics bound every token id; int64 otherwise."""
    meta = parquet.metadata
    index = next((i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == column), None)
    if index is None:
        return np.dtype(np.int64)
    top = 0
    for group in range(meta.num_row_groups):
        stats = meta.row_group(group).column(index).statistics
        if stats is None or not stats.has_min_max:
            return np.dtype(np.int64)
        low, high = stats.min, stats.max
        if isinstance(high, bytes):  # byte tokens: every value fits a uint8
            return np.dtype(np.uint8)
        if low < 0:
            return np.dtype(np.int64)
        top = max(top, high)
    return np.dtype(np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.int64)
