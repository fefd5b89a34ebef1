"""Token columns checked before any actor starts: a Parquet file's token column (a list of integer ids per
row, or bytes), its rows' windows of model.seq_len + 1 tokens counted, ids within model.vocab_size.

A sample is a window of model.seq_len + 1 tokens: each row of the token column is cut into consecutive,
non-overlapping windows (``windows``), numbered through the file, and a row's last len % (seq_len + 1)
tokens are unused (text data is packed the same way: raytrain.data.text). So a row of 6,500 ids at
seq_len 64 is 100 samples, not one cut to its first 65 ids; a row shorter than seq_len + 1 is an error.
"""

from __future__ import annotations

from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.data import shards, token_cache
from raytrain.data.identity import Fingerprint

SCAN_BATCH_ROWS = 4096
"""Rows check_dataset decodes at a time: its memory stays bounded whatever the size of a row group
(a 1M-row group of 135 ids a row: 13 MB of Arrow memory at its peak, against 170 MB with 64k rows)."""
SCAN_BUFFER_BYTES = 1 << 20
"""check_dataset reads pages through a buffer of this size instead of loading whole column chunks."""


def check_dataset(path: str, column: str, seq_len: int, global_batch: int, vocab_size: int,
                  key: str = "data.path", cache_dir: Optional[str] = None,
                  fingerprint: Optional[Fingerprint] = None) -> int:
    """Validate a dataset before any actor starts; returns the number of samples: every row's windows of
    seq_len + 1 tokens (``windows``), which is what the run trains on. ``key`` is the config key that names
    the file (data.path, or data.eval_path for held-out rows), for the messages.

    Schema and size come from the metadata; nulls, row lengths (so the window count) and token ids in
    [0, vocab_size) from one streaming pass over the column, skipped where a fixed row width and the
    Parquet statistics already answer (the built-in corpus needs no pass at all). With ``cache_dir`` the
    pass's findings are remembered per file version (token_cache.remembered, keyed by the file's
    ``fingerprint``, read when not given): checking it again reads its footer only.
    """
    source = f"{key}={path!r}"
    try:
        meta = pq.ParquetFile(shards.open_input(path), buffer_size=SCAN_BUFFER_BYTES, pre_buffer=False)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"{source} is not a readable Parquet file ({e})") from e
    names = meta.schema_arrow.names
    if column not in names:
        raise ValueError(f"{source} has no column {column!r} (columns: {names}); set data.column")
    kind = meta.schema_arrow.field(column).type
    _check_token_type(source, column, kind, vocab_size)
    width = seq_len + 1
    memo = (lambda scan: scan()) if cache_dir is None else (
        lambda scan: token_cache.remembered(path, column, width, cache_dir, scan, fingerprint))
    try:
        n = _check_rows(meta, source, column, width, vocab_size, memo)
    except (OSError, pa.ArrowException) as e:  # a damaged page: the footer read, its data does not
        raise ValueError(f"{source} cannot be read past its footer ({type(e).__name__}: {first_line(e)}): the file "
                         "is damaged; rewrite it, or remove it from the data") from e
    if n < global_batch:
        raise ValueError(f"{source}: its {meta.metadata.num_rows} rows of {column!r} hold {n} samples (windows of "
                         f"model.seq_len + 1 = {width} tokens), fewer than train.global_batch={global_batch}; add "
                         "rows, or lower train.global_batch or model.seq_len")
    return n


def _check_token_type(source: str, column: str, kind: pa.DataType, vocab_size: int) -> None:
    """A list of integer ids per row, or bytes: ids 0..255, so they need model.vocab_size >= 256."""
    where = f"{source}: column {column!r} is {kind}"
    if is_bytes(kind):
        if vocab_size < 256:
            raise ValueError(f"{where}, one token per byte (ids 0..255), but model.vocab_size={vocab_size}; "
                             "raise model.vocab_size to 256, or store the tokens as a list of integer ids")
        return
    if not (_is_list(kind) and pa.types.is_integer(kind.value_type)):
        raise ValueError(f"{where}; it needs a list of integer token ids per row, or bytes (one token per byte): "
                         "point data.column at the token column, or rewrite the data")


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


fixed_width = token_cache.fixed_width


def windows(length: int, width: int) -> int:
    """Samples a row of ``length`` tokens holds: consecutive, non-overlapping windows of ``width``
    (= model.seq_len + 1) tokens, its last length % width tokens unused, as raytrain.data.text packs text."""
    return length // width


def _check_rows(meta: pq.ParquetFile, source: str, column: str, width: int, vocab_size: int,
                memo: Callable[[Callable[[], dict]], dict]) -> int:
    """No null rows or ids, every row >= ``width`` tokens, every id in [0, vocab_size); returns the rows'
    windows of ``width`` tokens. ``memo(scan)`` runs the streaming pass, or recalls its findings."""
    kind = meta.schema_arrow.field(column).type
    fixed = fixed_width(kind)
    if fixed is not None and fixed < width:
        raise _short_row(source, column, 0, fixed, width)
    nulls, id_range = _column_statistics(meta, column)
    ids = not is_bytes(kind)  # bytes are 0..255, checked against vocab_size with the type
    count = None if fixed is None else meta.metadata.num_rows * windows(fixed, width)
    if fixed is None or nulls != 0 or (ids and id_range is None):
        want_range = ids and id_range is None
        found = memo(lambda: _scan_findings(*_scan_rows(meta, source, column, width, want_range)))
        count, scanned = found["samples"], found["ids"]
        id_range = id_range or (None if scanned is None else tuple(scanned))
    if ids and id_range is not None:
        _check_id_range(source, column, *id_range, vocab_size)
    return count


def _scan_findings(id_range: Optional[tuple[int, int]], count: int) -> dict:
    return {"samples": count, "ids": None if id_range is None else list(id_range)}


def _column_statistics(meta: pq.ParquetFile, column: str) -> tuple[Optional[int], Optional[tuple[int, int]]]:
    """Nulls (in a list column: null rows, empty rows and null ids together) and the (min, max) id of the
    column, from the Parquet statistics; each None when some row group lacks it."""
    md = meta.metadata
    leaves = [j for j in range(md.num_columns) if _is_leaf_of(md.schema.column(j).path, column)]
    if len(leaves) != 1 or md.num_row_groups == 0:
        return None, None
    groups = [md.row_group(i).column(leaves[0]).statistics for i in range(md.num_row_groups)]
    nulls = sum(g.null_count for g in groups) if all(g is not None and g.has_null_count for g in groups) else None
    if not all(g is not None and g.has_min_max for g in groups):
        return nulls, None
    return nulls, (min(g.min for g in groups), max(g.max for g in groups))


def _is_leaf_of(leaf_path: str, column: str) -> bool:
    """``tokens`` (bytes) or ``tokens.list.element`` (a list) belong to column ``tokens``."""
    return leaf_path == column or leaf_path.startswith(column + ".")


def _scan_rows(meta: pq.ParquetFile, source: str, column: str, width: int,
               want_range: bool) -> tuple[Optional[tuple[int, int]], int]:
    """Read the column SCAN_BATCH_ROWS rows at a time; raise at the first null or short row. Returns the
    (min, max) id when ``want_range`` (None if there are no ids) and the rows' windows of ``width``."""
    import pyarrow.compute as pc  # not at the top: workers import this module and never check

    lo = hi = None
    first = count = 0
    for batch in meta.iter_batches(batch_size=SCAN_BATCH_ROWS, columns=[column], use_threads=False):
        rows = batch.column(0)
        count += _check_batch(rows, first, source, column, width)
        if want_range:
            bounds = pc.min_max(rows.flatten()).as_py()
            if bounds["min"] is not None:
                lo = bounds["min"] if lo is None else min(lo, bounds["min"])
                hi = bounds["max"] if hi is None else max(hi, bounds["max"])
        first += len(rows)
    return (None if lo is None else (lo, hi)), count


def _check_batch(rows: pa.Array, first: int, source: str, column: str, width: int) -> int:
    """Null rows, short rows and null ids of one batch, whose first row is row ``first`` of the file;
    returns the batch's windows of ``width`` tokens."""
    import pyarrow.compute as pc

    if len(rows) == 0:
        return 0
    if rows.null_count:
        row = first + pc.index(rows.is_null(), True).as_py()
        raise ValueError(f"{source}: row {row} of column {column!r} is null; every row needs "
                         f">= {width} token ids: drop or fill the null rows")
    fixed = fixed_width(rows.type)
    count = len(rows) * windows(fixed, width) if fixed is not None else 0
    if fixed is None:
        lengths = pc.binary_length(rows) if is_bytes(rows.type) else pc.list_value_length(rows)
        if pc.min(lengths).as_py() < width:
            i = pc.index(pc.less(lengths, width), True).as_py()
            raise _short_row(source, column, first + i, lengths[i].as_py(), width)
        count = pc.sum(pc.divide(lengths, width)).as_py()  # integer division: windows(length, width)
    if not is_bytes(rows.type):
        ids = rows.flatten()
        if ids.null_count:
            row = first + pc.list_parent_indices(rows)[pc.index(ids.is_null(), True).as_py()].as_py()
            raise ValueError(f"{source}: row {row} of column {column!r} holds a null token id; "
                             "every id must be an integer: fix the data")
    return count


def _short_row(source: str, column: str, row: int, length: int, width: int) -> ValueError:
    return ValueError(
        f"{source}: rows of column {column!r} need >= model.seq_len + 1 = {width} tokens, "
        f"row {row} has {length}; lower model.seq_len or fix the data"
    )


def _check_id_range(source: str, column: str, lo: int, hi: int, vocab_size: int) -> None:
    """Every id must index the embedding: 0 <= id < model.vocab_size."""
    if 0 <= lo and hi < vocab_size:
        return
    if lo < 0:
        fix = "token ids must be >= 0: fix the data" + (
            f" (and raise model.vocab_size to {hi + 1}, or lower the largest id)" if hi >= vocab_size else "")
    else:
        fix = f"raise model.vocab_size to {hi + 1} or fix the data"
    raise ValueError(f"{source}: column {column!r} holds token ids from {lo} to {hi}, outside "
                     f"[0, model.vocab_size={vocab_size}); {fix}")



def is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:300]
