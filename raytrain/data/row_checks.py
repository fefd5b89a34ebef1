"""Parquet rows of data.inputs / data.targets columns checked before any actor starts: the columns exist
and each can be a tensor (raytrain.data.columns: no nulls, no ragged lists), and the rows are counted
from the footer. The targets' smallest and largest values are kept, so that class ids can be checked
against the width of the model's output (raytrain.driver.model_check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.data import shards
from raytrain.data.columns import BadColumn, column_array, column_names
from raytrain.data.token_checks import first_line

SCAN_BATCH_ROWS = 4096
"""Rows a check decodes at a time: its memory stays bounded whatever the size of a row group."""


@dataclass(frozen=True)
class RowFacts:
    """What a check learned of a file of rows."""

    rows: int
    target_range: Optional[tuple[float, float]]
    """The smallest and largest target, when the targets are numbers (None for lists and objects)."""
    column_types: tuple[tuple[str, str], ...] = ()
    """(name, Arrow type) of each column read: every file of a run's data must agree."""


def range_union(a: Optional[tuple[float, float]], b: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """The smallest range holding both target ranges (None: unknown)."""
    return b if a is None else a if b is None else (min(a[0], b[0]), max(a[1], b[1]))


def check_row_file(path: str, inputs: Union[str, list], targets: str, key: str) -> RowFacts:
    """Check one Parquet file of rows (``key`` names it in the messages); its rows and target range."""
    source = f"{key}={path!r}"
    try:
        meta = pq.ParquetFile(shards.open_input(path), buffer_size=1 << 20, pre_buffer=False)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"{source} is not a readable Parquet file ({e})") from e
    names = meta.schema_arrow.names
    for column in column_names(inputs, targets):
        if column not in names:
            which = "data.targets" if column == targets else "data.inputs"
            raise ValueError(f"{which} names column {column!r}, which {source} lacks (columns: {names}); "
                             f"set {which} to one of them")
    types = tuple((column, str(meta.schema_arrow.field(column).type)) for column in column_names(inputs, targets))
    try:
        return dataclasses.replace(_scan(meta, source, inputs, targets), column_types=types)
    except (OSError, pa.ArrowException) as e:  # a damaged page: the footer read, its data does not
        raise ValueError(f"{source} cannot be read past its footer ({type(e).__name__}: {first_line(e)}): the file "
                         "is damaged; rewrite it, or remove it from the data") from e


def _scan(meta: pq.ParquetFile, source: str, inputs: Union[str, list], targets: str) -> RowFacts:
    """One pass over the file's columns, a batch at a time: each checked, the targets' range kept."""
    low = high = None
    first = 0
    for batch in meta.iter_batches(batch_size=SCAN_BATCH_ROWS, columns=column_names(inputs, targets),
                                   use_threads=False):
        try:
            arrays = {name: column_array(batch.column(name), name, first) for name in batch.schema.names}
        except BadColumn as e:
            raise ValueError(f"{source}: {e}") from e
        for name, array in arrays.items():
            if array.dtype != object and np.issubdtype(array.dtype, np.floating) and np.isnan(array).any():
                row = first + int(np.flatnonzero(np.isnan(array.reshape(len(array), -1)).any(axis=1))[0])
                raise ValueError(f"{source}: column {name!r} holds NaN at row {row}: a sample needs every value; "
                                 "drop or fill such rows")
        values = arrays[targets]
        if values.dtype != object and values.ndim == 1 and len(values):
            low = values.min() if low is None else min(low, values.min())
            high = values.max() if high is None else max(high, values.max())
        first += batch.num_rows
    target_range = None if low is None else (float(low), float(high))
    return RowFacts(meta.metadata.num_rows, target_range)


def first_rows(path: str, names: list[str], count: int) -> dict:
    """The named columns of the first ``count`` rows of a Parquet file, as arrays."""
    meta = pq.ParquetFile(shards.open_input(path))
    batch = next(meta.iter_batches(batch_size=count, columns=names, use_threads=False))
    return {name: column_array(batch.column(name), name) for name in names}
