"""A user's data objects checked and handed to the workers, before any actor starts: a map-style torch
Dataset (pickled into Ray's object store once: ``Objects``) or a Ray Dataset (materialised in order into
the object store, its blocks numbered: ``Blocks``), given to ``raytrain.train(cfg, dataset=...,
eval_dataset=...)`` or returned by data.factory.

A Ray Dataset is consumed materialised and indexed: its ``map_batches`` preprocessing runs once, on Ray's
CPU workers, with the order of its rows preserved (so a resume sees the same order), and the blocks stay in
the object store (spilled to disk when it is full) for the run; each worker fetches the blocks its samples
fall in, as a file's. That is what keeps every sample exactly once per epoch across resizes and resumes:
the order over the rows is a permutation of their numbers, as it is over files.
"""

from __future__ import annotations

from typing import Any, Optional

from raytrain.config import Config
from raytrain.data.row_checks import range_union
from raytrain.data.rows import MapDataset, block_part, column_sampler
from raytrain.data.samples import Blocks, Objects, SampleSpec, TensorSpec
from raytrain.data.datasets import load_transform
from raytrain.driver.connect import ensure_ray

EXAMPLE_ROWS = 2
"""Samples a check decodes to learn a sample's shape (and that the model takes it)."""


def is_ray_dataset(value: Any) -> bool:
    return type(value).__module__.startswith("ray.data") and hasattr(value, "to_numpy_refs")


def user_samples(dataset: Any, key: str, cfg: Config):
    """``dataset`` (named by ``key`` in the messages) as (samples, their spec, an example batch, the targets'
    range where every target was read: a Ray Dataset's): a ValueError naming ``key`` and the fix when it cannot
    be read."""
    if is_ray_dataset(dataset):
        return ray_blocks(dataset, key, cfg)
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        if cfg.data.inputs is not None or cfg.data.transform is not None:
            raise ValueError(f"{key} is a torch Dataset, which gives (inputs, target) pairs itself: unset data.inputs, "
                             "data.targets and data.transform (they read the columns of Parquet rows or a Ray Dataset)")
        return (*torch_objects(dataset, key), None)
    raise ValueError(f"{key} is {type(dataset).__name__}; give a map-style torch.utils.data.Dataset (index -> "
                     "(inputs, target), with __len__) or a ray.data.Dataset")


def torch_objects(dataset: Any, key: str):
    """A map-style dataset pickled into the object store, its first samples decoded."""
    import ray
    from ray import cloudpickle

    count = len(dataset)
    if count == 0:
        raise ValueError(f"{key} is empty (len 0); give it samples")
    try:
        payload = cloudpickle.dumps(dataset)
    except Exception as e:  # noqa: BLE001 -- any pickling error means the workers cannot have it
        raise ValueError(f"{key} ({type(dataset).__name__}) cannot be pickled for the workers: {type(e).__name__}: "
                         f"{e}; keep open files, locks and connections out of it (open them in __getitem__)") from e
    example = _example(lambda ids: MapDataset(dataset).batch(ids), count, key)
    ensure_ray()  # checked: only now does anything start
    return Objects(ray.put(payload), count), spec_of(example), example


def ray_blocks(dataset: Any, key: str, cfg: Config):
    """A Ray Dataset materialised in order into the object store, its blocks counted and its first rows
    decoded through data.inputs / data.targets (and data.transform)."""
    import ray

    ensure_ray()
    d = cfg.data
    if d.inputs is None:
        raise ValueError(f"{key} is a Ray Dataset: set data.inputs and data.targets to the columns holding each "
                         "sample's inputs and target")
    dataset.context.execution_options.preserve_order = True  # the same order in every run that resumes it
    refs = dataset.to_numpy_refs()
    count_rows = ray.remote(num_cpus=0)(_block_rows)  # where each block lives: nothing travels but its count
    kept = [(ref, n) for ref, n in zip(refs, ray.get([count_rows.remote(ref) for ref in refs])) if n > 0]
    if not kept:
        raise ValueError(f"{key} (a Ray Dataset) is empty: it holds no rows")
    names = _block_columns(ray.get(kept[0][0]))
    wanted = [d.inputs] if isinstance(d.inputs, str) else list(d.inputs)
    missing = [c for c in wanted + [d.targets] if c not in names]
    if missing:
        which = "data.targets" if missing[0] == d.targets else "data.inputs"
        raise ValueError(f"{which} names column {missing[0]!r}, which {key} (a Ray Dataset) lacks; its columns: {names}")
    blocks = Blocks(tuple(ref for ref, _ in kept), tuple(n for _, n in kept))
    target_range = _scan_blocks(blocks, list(dict.fromkeys(wanted + [d.targets])), d.targets, key)
    sample = column_sampler(d.inputs, d.targets, load_transform(d.transform))
    read = block_part(blocks.refs, list(dict.fromkeys(wanted + [d.targets])))
    first = read(0)
    example = _example(lambda ids: sample({k: v[ids] for k, v in first.items()}, _seeds(len(ids)), True),
                       blocks.samples[0], key)
    return blocks, spec_of(example), example, target_range


def _scan_blocks(blocks: Blocks, names: list[str], targets: str, key: str) -> Optional[tuple[float, float]]:
    """Every row of the named columns checked where its block lives (as a Parquet file's are: no missing
    value), and the targets' range kept; a ValueError naming ``key``, the column and the row."""
    import ray

    scan = ray.remote(num_cpus=0)(_scan_block)
    target_range, first = None, 0
    for (bad, block_range), rows in zip(ray.get([scan.remote(ref, names, targets) for ref in blocks.refs]),
                                        blocks.samples):
        if bad is not None:
            column, row = bad
            raise ValueError(f"{key} (a Ray Dataset): column {column!r} has no value at row {first + row}: a sample "
                             "needs every value; drop or fill such rows (ray.data's filter or map_batches)")
        target_range = range_union(target_range, block_range)
        first += rows
    return target_range


def _scan_block(block, names: list[str], targets: str) -> tuple[Optional[tuple[str, int]],
                                                                 Optional[tuple[float, float]]]:
    """((column, row) of the first missing value or None, (the targets' smallest, largest) or None) of a block."""
    import numpy as np

    block = block if isinstance(block, dict) else {names[0]: block}
    for name in names:
        values = np.asarray(block[name])
        if values.dtype == object:
            missing = [i for i, v in enumerate(values) if v is None]
            if missing:
                return (name, missing[0]), None
    values = np.asarray(block[targets])
    if values.dtype == object or values.ndim != 1 or not len(values) or not np.issubdtype(values.dtype, np.number):
        return None, None
    return None, (float(values.min()), float(values.max()))


def _block_columns(block) -> list[str]:
    return list(block) if isinstance(block, dict) else ["(one unnamed column)"]


def _block_rows(block) -> int:
    if isinstance(block, dict):
        return len(next(iter(block.values()))) if block else 0
    return len(block)


def _seeds(count: int):
    import numpy as np

    return np.arange(count, dtype=np.uint64)


def _example(batch, count: int, key: str):
    """The first samples (``batch(ids)``), with a ValueError naming ``key`` when reading them fails."""
    ids = list(range(min(EXAMPLE_ROWS, count)))
    try:
        return batch(ids)
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise ValueError(f"{key}: its first samples cannot be read as (inputs, target) tensors: "
                         f"{type(e).__name__}: {e}") from e


def spec_of(example) -> SampleSpec:
    """The SampleSpec of an example batch (inputs, targets)."""
    x, y = example
    return SampleSpec(TensorSpec(tuple(x.shape[1:]), _dtype(x)), TensorSpec(tuple(y.shape[1:]), _dtype(y)))


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def data_factory(cfg: Config) -> tuple[Any, Optional[Any]]:
    """data.factory's datasets: (training, held-out or None). A ValueError naming the key when it does not
    import, raises, or returns something else."""
    from raytrain.models.user_code import import_user_module

    module_name, _, fn_name = cfg.data.factory.partition(":")
    key = f"data.factory={cfg.data.factory!r}"
    try:
        fn = getattr(import_user_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot import it ({e}); check the module is importable here and on every node") from e
    try:
        made = fn(cfg.data)
    except Exception as e:  # noqa: BLE001 -- the user's code: one line naming it
        raise ValueError(f"{key} raised {type(e).__name__}: {e}") from e
    if isinstance(made, tuple):
        if len(made) != 2:
            raise ValueError(f"{key} returned a tuple of {len(made)}; return a dataset or (train, held_out)")
        if made[0] is None:
            raise ValueError(f"{key} returned (None, ...): return (train, held_out) with a training dataset")
        return made
    if made is None:  # else the run would fall back to data.path or the built-in data, silently
        raise ValueError(f"{key} returned None: return the training data (a torch Dataset or a Ray Dataset), or "
                         "(train, held_out); did the function miss its return?")
    return made, None
