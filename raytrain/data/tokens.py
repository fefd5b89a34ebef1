"""Token datasets: the samples of Parquet token columns (or text packed into token rows), decoded once per
machine and memory-mapped, as (inputs, next-token targets) batches.

The run's samples are the files' first ``num_samples`` windows of model.seq_len + 1 tokens
(raytrain.data.token_checks.windows): the ones data.eval_fraction holds out for the held-out loss are
their last ones, outside the order. Many files (data.path a directory, a glob or a list:
raytrain.data.shards) are numbered as their concatenation in sorted path order, so the order is over
global window numbers and the same as over one file of the same rows; a worker reads them through
``ShardedDataset``, which opens each file only when a batch first reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import torch

from raytrain.data import shards, token_cache
from raytrain.data.corpus import BUILTIN_COLUMN
from raytrain.data.shards import Files
from raytrain.data.token_checks import fixed_width, is_bytes

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

    def batch(self, sample_ids: Sequence[int], seeds=None, training: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and next-token targets, each (len(sample_ids), seq_len) int64 (token windows draw nothing
        at random: ``seeds`` and ``training`` are unused)."""
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
            try:
                rows = self._open_file(path).rows
            except (OSError, pa.ArrowException) as e:
                raise ValueError(f"data file {path!r} cannot be read ({type(e).__name__}: {str(e)[:200]}): it is "
                                 "damaged or was rewritten during the run; restore it") from e
            if len(rows) != planned:
                raise ValueError(f"{path!r} holds {len(rows)} samples, not the {planned} it held when the run was "
                                 "prepared: a data file changed during the run; restore it, or start a new run")
            self.opened[k] = rows
        return self.opened[k]

    def batch(self, sample_ids: Sequence[int], seeds=None, training: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
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


def _decode_rows(table: pa.Table, column: str, width: int) -> np.ndarray:
    """Every row of ``table[column]`` as its windows of ``width`` tokens, in order (``windows``): a view of
    the column's values where every row is a whole number of windows (the built-in corpus), else a copy.
    Assumes what check_dataset checked: no nulls, every row >= ``width`` tokens."""
    col = table.column(column).combine_chunks()
    values, offsets = _values_and_offsets(col)
    return _cut_windows(values, offsets, width)


def _values_and_offsets(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The column's tokens as one flat array and the offsets of its rows into it (N + 1 of them)."""
    fixed = fixed_width(col.type)
    if pa.types.is_fixed_size_binary(col.type):
        values = np.frombuffer(col.buffers()[1], dtype=np.uint8, count=len(col) * fixed, offset=col.offset * fixed)
    elif fixed is not None:
        values = _flat_values(col)
    else:
        large = pa.types.is_large_list(col.type) or pa.types.is_large_binary(col.type)
        kind = np.int64 if large else np.int32
        offsets = np.frombuffer(col.buffers()[1], dtype=kind, count=len(col) + 1,
                                offset=col.offset * np.dtype(kind).itemsize)
        data = col.buffers()[2] if is_bytes(col.type) else None
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
def write_token_parquet(path: str, rows: np.ndarray, column: str = BUILTIN_COLUMN) -> None:
    """Write (N, L) token ids as a Parquet dataset usable as data.path (handy for tests and users)."""
    arr = pa.array([r.tolist() for r in np.asarray(rows)], type=pa.list_(pa.int64()))
    pq.write_table(pa.table({column: arr}), path)
