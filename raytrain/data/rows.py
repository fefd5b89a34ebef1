"""Datasets of samples of any shape, as a worker reads them: rows of data.inputs / data.targets columns in
Parquet files or a Ray Dataset's blocks (``RowDataset``), or a user's map-style torch Dataset
(``MapDataset``). Each answers ``len`` and ``batch(sample_ids, seeds, training) -> (inputs, targets)``.

``seeds`` are one per sample (raytrain.data.order.sample_seeds: a function of the run's seed, the epoch and
the sample id): data.transform draws its randomness from them, and a torch Dataset's ``__getitem__`` runs
with torch's, numpy's and Python's global generators seeded from them (torchvision's random transforms draw
from torch's), so every layout, and every resize, sees the same augmented samples.
"""

from __future__ import annotations

import inspect
import pickle
import random
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import numpy as np

from raytrain.data.columns import Columns, as_sample_array, sample_arrays
from raytrain.data.samples import Blocks
from raytrain.data.shards import Files

if TYPE_CHECKING:
    import torch

Transform = Callable[..., tuple]
"""data.transform: (columns of a batch of rows, seeds=..., training=...) -> (inputs, targets)."""


class RowDataset:
    """The rows of many parts (Parquet files, or a Ray Dataset's blocks) under one numbering, part k's rows
    being global ids [offset_k, offset_k + rows_k); a part is read (``read_part(k)``: its columns) the first
    time a batch needs one of its rows. ``make_sample`` turns a batch's columns into (inputs, targets)."""

    def __init__(self, parts: Union[Files, Blocks], read_part: Callable[[int], Columns],
                 make_sample: Callable[[Columns, np.ndarray, bool], tuple]):
        self.parts, self._read_part, self._make_sample = parts, read_part, make_sample
        self.opened: dict[int, Columns] = {}

    def __len__(self) -> int:
        return self.parts.total

    def part(self, k: int) -> Columns:
        if k not in self.opened:
            columns = self._read_part(k)
            rows = len(next(iter(columns.values())))
            if rows != self.parts.samples[k]:
                where = self.parts.paths[k] if isinstance(self.parts, Files) else f"block {k} of the Ray Dataset"
                raise ValueError(f"{where!r} holds {rows} rows, not the {self.parts.samples[k]} it held when the run "
                                 "was prepared: the data changed during the run; restore it, or start a new run")
            self.opened[k] = columns
        return self.opened[k]

    def columns(self, sample_ids: Sequence[int]) -> Columns:
        """The batch's rows of every column, in the order of ``sample_ids``."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        which = self.parts.locate(ids)
        offsets = self.parts.offsets
        order = np.argsort(which, kind="stable")
        gathered: dict[str, list] = {}
        for k in np.unique(which).tolist():
            rows = ids[which == k] - offsets[k]
            for name, values in self.part(k).items():
                gathered.setdefault(name, []).append(values[rows])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return {name: np.concatenate(pieces)[inverse] for name, pieces in gathered.items()}

    def batch(self, sample_ids: Sequence[int], seeds: Optional[np.ndarray] = None,
              training: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
        seeds = np.zeros(len(sample_ids), dtype=np.uint64) if seeds is None else seeds
        return self._make_sample(self.columns(sample_ids), seeds, training)


def column_sampler(inputs: Union[str, list], targets: str,
                   transform: Optional[Transform]) -> Callable[[Columns, np.ndarray, bool], tuple]:
    """How a batch's columns become (inputs, targets) tensors: data.transform when set, else the columns
    themselves (raytrain.data.columns.sample_arrays)."""
    def sample(columns: Columns, seeds: np.ndarray, training: bool):
        if transform is None:
            x, y = sample_arrays(columns, inputs, targets)
        else:
            x, y = call_transform(transform, columns, seeds, training)
        return as_tensor(x, "inputs"), as_tensor(y, "targets")

    return sample


def call_transform(transform: Transform, columns: Columns, seeds: np.ndarray, training: bool) -> tuple:
    """``transform(columns, seeds=..., training=...)``, passing only the keywords its signature takes; it
    must return (inputs, targets), each an array or a tensor with a row per sample."""
    accepts = inspect.signature(transform).parameters
    kwargs = {k: v for k, v in (("seeds", seeds), ("training", training)) if k in accepts}
    out = transform(columns, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"data.transform returned {type(out).__name__}; it must return (inputs, targets), each an "
                        "array or a tensor whose first dimension is the batch")
    rows = len(seeds)
    for what, value in zip(("inputs", "targets"), out):
        if len(value) != rows:
            raise TypeError(f"data.transform's {what} hold {len(value)} rows for a batch of {rows}: return one per row")
    return out


def as_tensor(value, what: str) -> "torch.Tensor":
    """An array (numeric: float32 or int64, as a column would give) or a tensor, as a tensor; float64 becomes
    float32 either way (numpy's and torch's default float differ; the layers' weights are float32)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype == torch.float64 else value
    # contiguous and writable: a view of Arrow's (read-only) buffers is copied, torch's tensors are writable
    return torch.from_numpy(np.require(as_sample_array(np.asarray(value), what), requirements=["C", "W"]))


def parquet_part(paths: Sequence[str], names: list[str]) -> Callable[[int], Columns]:
    """``read_part`` over Parquet files: file k's named columns, read whole on first use."""
    def read(k: int) -> Columns:
        import pyarrow.parquet as pq

        from raytrain.data.columns import table_columns
        from raytrain.data.shards import open_input

        import pyarrow as pa

        try:
            table = pq.ParquetFile(open_input(paths[k])).read(columns=names, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"data file {paths[k]!r} cannot be read ({type(e).__name__}: {str(e)[:200]}): it is "
                             "damaged or was rewritten during the run; restore it") from e
        return table_columns(table, names)

    return read


def block_part(refs: Sequence, names: list[str]) -> Callable[[int], Columns]:
    """``read_part`` over a Ray Dataset's blocks (dicts of numpy arrays in the object store)."""
    def read(k: int) -> Columns:
        import ray

        block = ray.get(refs[k])
        if not isinstance(block, dict):  # a dataset of one column comes as that column's array
            block = {names[0]: block}
        return {name: np.asarray(block[name]) for name in names}

    return read


class MapDataset:
    """A user's map-style dataset (``dataset[i] -> (inputs, target)``), its samples stacked into batches
    (torch's default_collate); each item is fetched with the global generators seeded from its seed."""

    def __init__(self, dataset):
        self.dataset = dataset

    @classmethod
    def unpickled(cls, payload: bytes) -> "MapDataset":
        return cls(pickle.loads(payload))

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, sample_ids: Sequence[int], seeds: Optional[np.ndarray] = None,
              training: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch
        from torch.utils.data import default_collate

        seeds = np.zeros(len(sample_ids), dtype=np.uint64) if seeds is None else seeds
        items = []
        with torch.random.fork_rng(devices=[]):
            state = random.getstate(), np.random.get_state()
            try:
                for i, seed in zip(sample_ids, seeds.tolist()):
                    torch.manual_seed(seed)
                    np.random.seed(seed % 2**32)
                    random.seed(seed)
                    items.append(self.dataset[int(i)])
            finally:
                random.setstate(state[0])
                np.random.set_state(state[1])
        x, y = default_collate([pair(item, i) for item, i in zip(items, sample_ids)])
        return as_tensor(x, "inputs"), as_tensor(y, "targets")


def pair(item, index: int) -> tuple:
    """A dataset item as (inputs, target); a TypeError naming the index otherwise."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return tuple(item)
    raise TypeError(f"dataset[{index}] is {type(item).__name__}{f' of {len(item)}' if isinstance(item, (tuple, list)) else ''}; "
                    "a sample must be a pair (inputs, target)")
