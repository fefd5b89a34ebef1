"""Columns as sample tensors: data.inputs and data.targets read from Arrow (a Parquet file's row group, a
Ray Dataset's block) into numpy arrays whose first dimension is the row.

What a column gives (``column_array``):

- a numeric scalar: one value per row, a 0-D sample;
- a fixed-size list (nested: ``list<list<float, 8>, 8>``) or Arrow's ``fixed_shape_tensor``: its shape;
- a variable-size list whose rows all have one length: that length (a row of another length is refused);
- binary or a string (an encoded image, a path): one Python object per row, for data.transform to decode.

Then (``sample_arrays``): data.inputs as one column, or a list of numeric columns stacked into one float
vector; floating values become float32 (the dtype of a model's parameters), integers int64 (ids an
embedding takes, class ids cross entropy takes). With data.transform the named columns go to it as they
are, and it returns the inputs and targets.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import pyarrow as pa

Columns = dict[str, np.ndarray]
"""Column name -> one array whose first dimension is the row (an object array for binary and strings)."""


class BadColumn(ValueError):
    """A column that cannot be a sample's tensor; its message names the column, the row and the fix."""


def column_names(inputs: Union[str, list, None], targets: str) -> list[str]:
    """The columns a batch reads: data.inputs' (one, or several) and data.targets."""
    names = [inputs] if isinstance(inputs, str) else list(inputs or [])
    return [*names, targets] if targets not in names else names


def column_array(column: Union[pa.Array, pa.ChunkedArray], name: str, first_row: int = 0) -> np.ndarray:
    """One Arrow column as an array of its rows (see the module docstring); ``first_row``: the row number
    of its first row, for the messages."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if column.null_count:
        row = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise BadColumn(f"column {name!r}: row {row} is null; drop or fill the null rows")
    if isinstance(kind, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _list_rows(column, name, first_row)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind) \
            or pa.types.is_large_string(kind) or pa.types.is_fixed_size_binary(kind):
        return np.array(column.to_pylist(), dtype=object)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return column.to_numpy(zero_copy_only=False)
    raise BadColumn(f"column {name!r} is {kind}, which is no tensor: use numbers, fixed-size lists, "
                    "fixed_shape_tensor, or binary with data.transform to decode it")


def _list_rows(column: pa.Array, name: str, first_row: int) -> np.ndarray:
    """A list column's rows as one array, (rows, *row shape); every row must have the same shape."""
    shape = []
    values = column
    while pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type) \
            or pa.types.is_large_list(values.type):
        lengths = _row_lengths(values)
        if len(lengths) and lengths.min() != lengths.max():
            odd = int(np.flatnonzero(lengths != lengths[0])[0])  # lists per row: the outer levels' sizes
            raise BadColumn(f"column {name!r} is ragged: row {first_row + odd // int(np.prod(shape))} holds a list of "
                            f"{int(lengths[odd])} values where row {first_row} holds {int(lengths[0])}; every row "
                            "needs the same shape (pad or cut the rows, or decode them in data.transform)")
        shape.append(int(lengths[0]) if len(lengths) else 0)
        if values.null_count:
            raise BadColumn(f"column {name!r} holds a null list; drop or fill it")
        values = values.flatten()
    if values.null_count:
        raise BadColumn(f"column {name!r} holds a null value inside a list; every value must be a number")
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)):
        raise BadColumn(f"column {name!r} is a list of {values.type}, not of numbers; decode it in data.transform")
    return values.to_numpy(zero_copy_only=False).reshape(len(column), *shape)


def _row_lengths(values: pa.Array) -> np.ndarray:
    if pa.types.is_fixed_size_list(values.type):
        return np.full(len(values), values.type.list_size, dtype=np.int64)
    import pyarrow.compute as pc

    return pc.list_value_length(values).to_numpy(zero_copy_only=False)


def as_sample_array(values: np.ndarray, name: str) -> np.ndarray:
    """A numeric array as a sample tensor's dtype: float32 for floating values, int64 for integers, float32
    for booleans; a column of objects (binary, strings) is refused: it needs data.transform."""
    if values.dtype == object:
        raise BadColumn(f"column {name!r} holds {type(values[0]).__name__ if len(values) else 'objects'} values, "
                        "not numbers: decode them with data.transform (pkg.module:fn)")
    if np.issubdtype(values.dtype, np.floating) or values.dtype == np.bool_:
        return values.astype(np.float32, copy=False)
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64, copy=False)
    raise BadColumn(f"column {name!r} has dtype {values.dtype}, which is no tensor dtype")


def sample_arrays(columns: Columns, inputs: Union[str, list], targets: str) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of a batch of rows from their columns: data.inputs one column, or several numeric
    ones stacked into a float vector per row (in the order listed); data.targets one column."""
    if isinstance(inputs, str):
        x = as_sample_array(columns[inputs], inputs)
    else:
        parts = []
        for name in inputs:
            part = as_sample_array(columns[name], name)
            if part.ndim != 1:
                raise BadColumn(f"data.inputs lists column {name!r}, which holds {part.shape[1:]} values per row: a "
                                "list of columns stacks numbers, one per column; name it alone as data.inputs")
            parts.append(part.astype(np.float32, copy=False))
        x = np.stack(parts, axis=1) if parts else np.zeros((0, 0), np.float32)
    return x, as_sample_array(columns[targets], targets)


def table_columns(table: pa.Table, names: list[str], first_row: int = 0) -> Columns:
    """The named columns of an Arrow table as arrays (``column_array``)."""
    return {name: column_array(table.column(name), name, first_row) for name in names}
