"""Token datasets in Parquet, read with pyarrow, and the global sample order.

Invariant (ARCHITECTURE.md: every sample exactly once per epoch): the order of samples is a pure
function of (seed, epoch); step s consumes global positions [s*B, (s+1)*B), and each data-parallel
replica takes a contiguous slice of them. So every sample is seen exactly once per epoch whatever
the layout, and a resumed run needs only the step number to continue where it stopped.

A sample is a window of model.seq_len + 1 tokens: each row of the token column is cut into consecutive,
non-overlapping windows (``windows``), numbered through the file, and a row's last len % (seq_len + 1)
tokens are unused (text data is packed the same way: raytrain.data.text). So a row of 6,500 ids at
seq_len 64 is 100 samples, not one cut to its first 65 ids; a row shorter than seq_len + 1 is an error.
The run's samples are the file's first ``num_samples`` windows: the ones data.eval_fraction holds out
for the held-out loss are its last ones, outside the order.

Many files (data.path a directory, a glob or a list: raytrain.data.shards) are numbered as their
concatenation in sorted path order, so the order is over global window numbers and the same as over one
file of the same rows; a worker reads them through ``ShardedDataset``, which opens each file only when a
batch first reaches it.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
import tempfile
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import torch

from raytrain.config import Config, DataConfig
from raytrain.data import shards
from raytrain.data import text as text_data
from raytrain.data import token_cache
from raytrain.data.shards import DataSource, Files
from raytrain.data.atomic import atomic_path

BUILTIN_COLUMN = "tokens"


# --- the built-in corpus: Python standard library source, as bytes ---------------------------


def _stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if "site-packages" not in f and os.sep + "test" not in f[len(root):]]


def builtin_corpus_path(data: DataConfig, seq_len: int) -> str:
    """Path of the cached corpus for this sequence length; builds it on first use."""
    cache = os.path.expanduser(data.cache_dir)
    key = hashlib.sha1(f"{sysconfig.get_paths()['stdlib']}|{data.max_bytes}|{seq_len}".encode()).hexdigest()[:10]
    path = os.path.join(cache, f"stdlib-bytes-fsb-T{seq_len + 1}-{key}.parquet")
    if not os.path.exists(path):
        build_builtin_corpus(path, seq_len + 1, data.max_bytes)
    return path


def build_builtin_corpus(path: str, row_len: int, max_bytes: int) -> None:
    """Concatenate stdlib sources (bytes) and cut them into rows of ``row_len`` tokens.

    Each row is one ``fixed_size_binary(row_len)`` value: Parquet stores it flat, so a worker decodes
    the 8 MB default corpus in 0.02 s, against 0.5 s (1.3 s with its peers starting at the same
    time) for a list column, whose nesting levels and dictionary pages it must unpack value by value.
    Written atomically (raytrain.data.atomic), so concurrent builders never see a half file.
    """
    chunks, total = [], 0
    for f in _stdlib_sources():
        with open(f, "rb") as fh:
            blob = fh.read()
        chunks.append(blob + b"\n\n")
        total += len(blob) + 2
        if total >= max_bytes:
            break
    stream = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    rows = len(stream) // row_len
    if rows == 0:
        raise RuntimeError(f"the Python standard library at {sysconfig.get_paths()['stdlib']} gave no data")
    values = pa.py_buffer(stream[: rows * row_len].tobytes())
    table = pa.table({BUILTIN_COLUMN: pa.FixedSizeBinaryArray.from_buffers(pa.binary(row_len), rows, [None, values])})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, use_dictionary=False)


def check_cache_dir(cache_dir: str) -> None:
    """data.cache_dir must take a file: checked on the driver before any actor starts, so that an unwritable
    one (read-only, or under a regular file: refused for root too) is one line, not a worker's traceback."""
    where = os.path.expanduser(cache_dir)
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".raytrain-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"data.cache_dir={cache_dir!r} is not a writable directory ({e.strerror or e}); point "
                         "data.cache_dir at one (the built-in corpus and the decoded data are cached there)") from e


# --- reading ------------------------------------------------------------------------------


def resolve_data_path(cfg: Config) -> str:
    """The Parquet file this run reads when it reads one: data.path as written, or the built-in corpus
    (built if needed). Many files (a directory, a glob, a list): ``data_files``."""
    if cfg.data.path is None:
        return builtin_corpus_path(cfg.data, cfg.model.seq_len)
    assert isinstance(cfg.data.path, str), cfg.data.path
    return os.path.expanduser(cfg.data.path)


def data_files(cfg: Config) -> list[str]:
    """The files of the run's training data, sorted (raytrain.data.shards.resolve); the built-in corpus is one."""
    if cfg.data.path is None:
        return [builtin_corpus_path(cfg.data, cfg.model.seq_len)]
    return shards.resolve(cfg.data.path, "data.path")


def eval_files(cfg: Config) -> Optional[list[str]]:
    """data.eval_path's files, sorted; None when it is unset."""
    return None if cfg.data.eval_path is None else shards.resolve(cfg.data.eval_path, "data.eval_path")


SCAN_BATCH_ROWS = 4096
"""Rows check_dataset decodes at a time: its memory stays bounded whatever the size of a row group
(a 1M-row group of 135 ids a row: 13 MB of Arrow memory at its peak, against 170 MB with 64k rows)."""
SCAN_BUFFER_BYTES = 1 << 20
"""check_dataset reads pages through a buffer of this size instead of loading whole column chunks."""


def check_dataset(path: str, column: str, seq_len: int, global_batch: int, vocab_size: int,
                  key: str = "data.path", cache_dir: Optional[str] = None) -> int:
    """Validate a dataset before any actor starts; returns the number of samples: every row's windows of
    seq_len + 1 tokens (``windows``), which is what the run trains on. ``key`` is the config key that names
    the file (data.path, or data.eval_path for held-out rows), for the messages.

    Schema and size come from the metadata; nulls, row lengths (so the window count) and token ids in
    [0, vocab_size) from one streaming pass over the column, skipped where a fixed row width and the
    Parquet statistics already answer (the built-in corpus needs no pass at all). With ``cache_dir`` the
    pass's findings are remembered per file version (token_cache.remembered): checking it again reads its
    footer only.
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
        lambda scan: token_cache.remembered(path, column, width, cache_dir, scan))
    n = _check_rows(meta, source, column, width, vocab_size, memo)
    if n < global_batch:
        raise ValueError(f"{source}: its {meta.metadata.num_rows} rows of {column!r} hold {n} samples (windows of "
                         f"model.seq_len + 1 = {width} tokens), fewer than train.global_batch={global_batch}; add "
                         "rows, or lower train.global_batch or model.seq_len")
    return n


def _check_token_type(source: str, column: str, kind: pa.DataType, vocab_size: int) -> None:
    """A list of integer ids per row, or bytes: ids 0..255, so they need model.vocab_size >= 256."""
    where = f"{source}: column {column!r} is {kind}"
    if _is_bytes(kind):
        if vocab_size < 256:
            raise ValueError(f"{where}, one token per byte (ids 0..255), but model.vocab_size={vocab_size}; "
                             "raise model.vocab_size to 256, or store the tokens as a list of integer ids")
        return
    if not (_is_list(kind) and pa.types.is_integer(kind.value_type)):
        raise ValueError(f"{where}; it needs a list of integer token ids per row, or bytes (one token per byte): "
                         "point data.column at the token column, or rewrite the data")


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


_fixed_width = token_cache.fixed_width


def windows(length: int, width: int) -> int:
    """Samples a row of ``length`` tokens holds: consecutive, non-overlapping windows of ``width``
    (= model.seq_len + 1) tokens, its last length % width tokens unused, as raytrain.data.text packs text."""
    return length // width


def _check_rows(meta: pq.ParquetFile, source: str, column: str, width: int, vocab_size: int,
                memo: Callable[[Callable[[], dict]], dict]) -> int:
    """No null rows or ids, every row >= ``width`` tokens, every id in [0, vocab_size); returns the rows'
    windows of ``width`` tokens. ``memo(scan)`` runs the streaming pass, or recalls its findings."""
    kind = meta.schema_arrow.field(column).type
    fixed = _fixed_width(kind)
    if fixed is not None and fixed < width:
        raise _short_row(source, column, 0, fixed, width)
    nulls, id_range = _column_statistics(meta, column)
    ids = not _is_bytes(kind)  # bytes are 0..255, checked against vocab_size with the type
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
    fixed = _fixed_width(rows.type)
    count = len(rows) * windows(fixed, width) if fixed is not None else 0
    if fixed is None:
        lengths = pc.binary_length(rows) if _is_bytes(rows.type) else pc.list_value_length(rows)
        if pc.min(lengths).as_py() < width:
            i = pc.index(pc.less(lengths, width), True).as_py()
            raise _short_row(source, column, first + i, lengths[i].as_py(), width)
        count = pc.sum(pc.divide(lengths, width)).as_py()  # integer division: windows(length, width)
    if not _is_bytes(rows.type):
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


class TokenDataset:
    """The samples of a Parquet token column, as one (N, seq_len + 1) integer array: each row cut into
    consecutive windows of seq_len + 1 tokens (``windows``), sample ids running through row 0's windows,
    then row 1's, ...; a row's last len % (seq_len + 1) tokens are unused. Rows of exactly seq_len + 1
    tokens are one sample each.

    Columns: a list of integer ids per row, or bytes (``binary``/``fixed_size_binary``: one token per
    byte, as the built-in corpus). With ``cache_dir`` (what workers use) the rows are decoded once per
    machine and memory-mapped (raytrain.data.token_cache); without it they are decoded into this process.
    ``of_rows`` wraps rows made elsewhere (text packed by raytrain.data.text; see ``open_dataset``).
    """

    def __init__(self, path: str, column: str, seq_len: int, cache_dir: Optional[str] = None):
        width = seq_len + 1
        if cache_dir is not None:
            self.rows = token_cache.open_rows(path, column, width, cache_dir, lambda t: _decode_rows(t, column, width))
        else:
            # ParquetFile, not pq.read_table: read_table imports pyarrow.dataset, a noticeable cost per worker.
            # One thread: pyarrow's default pool (a thread per core in each worker) made the read 5x
            # slower with every worker decoding at once than alone.
            table = pq.ParquetFile(shards.open_input(path)).read(columns=[column], use_threads=False)
            self.rows = _decode_rows(table, column, width)
        self.seq_len = seq_len

    @classmethod
    def of_rows(cls, rows: np.ndarray, seq_len: int) -> "TokenDataset":
        """A dataset over rows already decoded (e.g. raytrain.data.text's packed rows), (N, seq_len + 1)."""
        assert rows.ndim == 2 and rows.shape[1] == seq_len + 1, (rows.shape, seq_len)
        dataset = cls.__new__(cls)
        dataset.rows, dataset.seq_len = rows, seq_len
        return dataset

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, sample_ids: Sequence[int]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and next-token targets, each (len(sample_ids), seq_len) int64."""
        import torch

        rows = torch.from_numpy(self.rows[np.asarray(sample_ids)].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


class ShardedDataset:
    """The samples of many files (raytrain.data.shards.Files) under one numbering: file k's samples are
    global ids [offset_k, offset_k + samples_k), so the sample order over the files is the order over their
    concatenation, file by file in sorted path order.

    Lazy: a file is opened (decoded into this machine's token cache, or tokenised) the first time a batch
    needs one of its samples, so a worker's first step waits only for the files that step reads, never for
    the whole corpus. A file whose sample count differs from the one prepare counted (rewritten during the
    run) is an error, not a silent shift of every later id.
    """

    def __init__(self, files: Files, open_file: Callable[[str], TokenDataset], seq_len: int):
        self.files, self.seq_len, self._open_file = files, seq_len, open_file
        self.offsets = files.offsets
        self.opened: dict[int, np.ndarray] = {}  # file index -> its (samples, seq_len + 1) rows

    def __len__(self) -> int:
        return self.files.total

    def file_rows(self, k: int) -> np.ndarray:
        """File k's rows, opened on first use."""
        if k not in self.opened:
            path, planned = self.files.paths[k], self.files.samples[k]
            rows = self._open_file(path).rows
            if len(rows) != planned:
                raise ValueError(f"{path!r} holds {len(rows)} samples, not the {planned} it held when the run was "
                                 "prepared: a data file changed during the run; restore it, or start a new run")
            self.opened[k] = rows
        return self.opened[k]

    def batch(self, sample_ids: Sequence[int]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and next-token targets, each (len(sample_ids), seq_len) int64, as TokenDataset.batch."""
        import torch

        ids = np.asarray(sample_ids, dtype=np.int64)
        which = self.files.locate(ids)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for k in np.unique(which).tolist():
            here = which == k
            out[here] = self.file_rows(k)[ids[here] - self.offsets[k]]
        rows = torch.from_numpy(out)
        return rows[:, :-1], rows[:, 1:]


Dataset = Union[TokenDataset, ShardedDataset]


def open_dataset(source: Union[str, Files], cfg: Config) -> Dataset:
    """The run's samples: of one file at a path (opened now), or of prepare's ``Files`` (opened file by file
    as batches reach them: ShardedDataset). A file holds data.column's token rows, or with data.text_column
    its text, tokenised and packed once per machine (raytrain.data.text)."""
    if isinstance(source, Files):
        return ShardedDataset(source, lambda path: open_dataset(path, cfg), cfg.model.seq_len)
    d, seq_len = cfg.data, cfg.model.seq_len
    if d.text_column is None:
        return TokenDataset(source, d.column, seq_len, d.cache_dir)
    rows = text_data.packed_rows(source, d.text_column, d.tokenizer, seq_len + 1, d.cache_dir)
    return TokenDataset.of_rows(rows, seq_len)


def counted_source(cfg: Config) -> DataSource:
    """The run's files counted by opening (decoding) every one of them in this process: for the one-process
    reference and tools; a run's driver counts them from their metadata instead (raytrain.driver.plan)."""
    def counted(paths: list[str]) -> Files:
        return Files(tuple(paths), tuple(len(open_dataset(p, cfg)) for p in paths))

    held = eval_files(cfg)
    return DataSource(counted(data_files(cfg)), None if held is None else counted(held))


def _decode_rows(table: pa.Table, column: str, width: int) -> np.ndarray:
    """Every row of ``table[column]`` as its windows of ``width`` tokens, in order (``windows``): a view of
    the column's values where every row is a whole number of windows (the built-in corpus), else a copy.
    Assumes what check_dataset checked: no nulls, every row >= ``width`` tokens."""
    col = table.column(column).combine_chunks()
    values, offsets = _values_and_offsets(col)
    return _cut_windows(values, offsets, width)


def _values_and_offsets(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The column's tokens as one flat array and the offsets of its rows into it (N + 1 of them)."""
    fixed = _fixed_width(col.type)
    if pa.types.is_fixed_size_binary(col.type):
        values = np.frombuffer(col.buffers()[1], dtype=np.uint8, count=len(col) * fixed, offset=col.offset * fixed)
    elif fixed is not None:
        values = _flat_values(col)
    else:
        large = pa.types.is_large_list(col.type) or pa.types.is_large_binary(col.type)
        kind = np.int64 if large else np.int32
        offsets = np.frombuffer(col.buffers()[1], dtype=kind, count=len(col) + 1,
                                offset=col.offset * np.dtype(kind).itemsize)
        data = col.buffers()[2] if _is_bytes(col.type) else None
        values = np.frombuffer(data, dtype=np.uint8) if data is not None else _int_values(col.values)
        return values, offsets.astype(np.int64)
    return values, np.arange(len(col) + 1, dtype=np.int64) * fixed


def _cut_windows(values: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """Row i = values[offsets[i]:offsets[i + 1]] cut into windows of ``width``; each row's tail dropped."""
    span = values[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    kept = lengths // width * width
    if (kept == lengths).all():
        return span.reshape(-1, width)
    base = offsets - offsets[0]
    tails = kept < lengths
    edges = np.zeros(len(span) + 1, dtype=np.int8)  # +1 where a row's tail starts, -1 where it ends
    edges[base[:-1][tails] + kept[tails]] += 1
    edges[base[1:][tails]] -= 1
    keep = np.cumsum(edges[:-1], dtype=np.int8) == 0
    return span[keep].reshape(-1, width)


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _flat_values(col: pa.FixedSizeListArray) -> np.ndarray:
    """The values of a fixed-size-list column as one flat array, without a copy where possible."""
    if col.offset:  # ``values`` ignores a slice offset of the list array itself: flatten honours it
        return _int_values(col.flatten())
    return _int_values(col.values)


def _int_values(values: pa.Array) -> np.ndarray:
    """An integer array's values, viewed in place: ``Array.to_numpy`` imports pandas, which every
    worker would pay for on its way to its first step."""
    if values.null_count or not pa.types.is_integer(values.type):
        return values.to_numpy(zero_copy_only=False)
    kind = "u" if pa.types.is_unsigned_integer(values.type) else "i"
    dtype = np.dtype(f"{kind}{values.type.bit_width // 8}")
    return np.frombuffer(values.buffers()[1], dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize)


# --- global order and per-replica slices ----------------------------------------------------


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The permutation of sample ids for one epoch: a pure function of (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_ids(seed: int, num_samples: int, start: int, stop: int) -> list[int]:
    """Sample ids at global positions [start, stop); positions run on across epochs."""
    ids = []
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos, num_samples)
        take = min(stop - pos, num_samples - offset)
        ids.extend(epoch_order(seed, epoch, num_samples)[offset : offset + take].tolist())
        pos += take
    return ids


def replica_slices(global_batch: int, shares: Sequence[int]) -> list[tuple[int, int]]:
    """Offsets [begin, end) within a step's global batch for each replica, contiguous and in order."""
    assert sum(shares) == global_batch, (shares, global_batch)
    bounds = np.cumsum([0, *shares]).tolist()
    return [(bounds[r], bounds[r + 1]) for r in range(len(shares))]


def even_shares(global_batch: int, num_replicas: int) -> list[int]:
    base, extra = divmod(global_batch, num_replicas)
    return [base + (1 if r < extra else 0) for r in range(num_replicas)]


def step_positions(step: int, global_batch: int, begin: int, end: int) -> tuple[int, int]:
    """Global positions a replica with batch offsets [begin, end) consumes at ``step``."""
    return step * global_batch + begin, step * global_batch + end


def microbatch_bounds(count: int, num_microbatches: int) -> list[tuple[int, int]]:
    sizes = even_shares(count, num_microbatches)
    bounds = np.cumsum([0, *sizes]).tolist()
    return [(bounds[i], bounds[i + 1]) for i in range(num_microbatches)]


# --- held-out rows (eval.every) --------------------------------------------------------------


def held_out_count(rows: int, eval_fraction: float) -> int:
    """Rows of a dataset of ``rows`` (samples: a token column's windows, or text's packed rows) that
    data.eval_fraction holds out: floor(rows x eval_fraction), its last ones (the tolerance keeps 0.29 x
    100 at 29, not 28)."""
    return int(rows * eval_fraction + 1e-9)


def training_rows(cfg: Config, rows: int) -> int:
    """The rows of a dataset of ``rows`` that are trained on (the run's ``num_samples``): all but the
    last ones data.eval_fraction holds out."""
    return rows - (0 if cfg.data.eval_path is not None else held_out_count(rows, cfg.data.eval_fraction))


def held_out_source(cfg: Config, source: DataSource, num_samples: int) -> tuple[Files, int]:
    """Where the held-out rows are: (files, id of the first row an evaluation reads).

    data.eval_path: its files from their first row; else data.eval_fraction's rows of the training
    files, which follow their ``num_samples`` training rows.
    """
    if cfg.data.eval_path is not None:
        assert source.held_out is not None, "prepare resolves data.eval_path's files"
        return source.held_out, 0
    return source.train, num_samples


def held_out_ids(first: int, batch: int, global_batch: int, begin: int, end: int) -> list[int]:
    """Row ids of held-out batch ``batch`` that a replica with batch offsets [begin, end) evaluates:
    the held-out rows are read in order, ``global_batch`` per batch, split across replicas as a step is."""
    start = first + batch * global_batch
    return list(range(start + begin, start + end))


def write_token_parquet(path: str, rows: np.ndarray, column: str = BUILTIN_COLUMN) -> None:
    """Write (N, L) token ids as a Parquet dataset usable as data.path (handy for tests and users)."""
    arr = pa.array([r.tolist() for r in np.asarray(rows)], type=pa.list_(pa.int64()))
    pq.write_table(pa.table({column: arr}), path)
