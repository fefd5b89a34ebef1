"""A run's samples as a dataset a worker reads batches from: ``open_dataset`` over what prepare resolved.

Every dataset answers ``len`` and ``batch(sample_ids, seeds, training) -> (inputs, targets)``: tensors
whose first dimension is the batch, in the order of the ids.
"""

from __future__ import annotations

from typing import Optional, Union

from raytrain.config import Config, DataConfig
from raytrain.data import text as text_data
from raytrain.data.columns import column_names
from raytrain.data.corpus import data_files, eval_files
from raytrain.data.rows import MapDataset, RowDataset, Transform, block_part, column_sampler, parquet_part
from raytrain.data.samples import Blocks, DataSource, Objects, SampleSpec, Samples, TensorSpec
from raytrain.data.shards import Files
from raytrain.data.tokens import ShardedDataset, TokenDataset

Dataset = Union[TokenDataset, ShardedDataset, RowDataset, MapDataset]


def open_dataset(source: Union[str, Samples], cfg: Config) -> Dataset:
    """The run's samples: a user's torch Dataset (``Objects``), rows of columns (data.inputs: Parquet
    ``Files``, or a Ray Dataset's ``Blocks``), or token windows: of one file at a path (opened now), or of
    prepare's ``Files`` (opened file by file as batches reach them: ShardedDataset). A token file holds
    data.column's token rows, or with data.text_column its text, tokenised and packed once per machine
    (raytrain.data.text)."""
    if isinstance(source, Objects):
        import ray

        return MapDataset.unpickled(ray.get(source.ref))
    if isinstance(source, Blocks) or (isinstance(source, Files) and cfg.data.inputs is not None):
        return open_rows(source, cfg.data)
    if isinstance(source, Files):
        return ShardedDataset(source, lambda path: open_dataset(path, cfg), cfg.model.seq_len)
    d, seq_len = cfg.data, cfg.model.seq_len
    if d.text_column is None:
        return TokenDataset(source, d.column, seq_len, d.cache_dir)
    rows = text_data.packed_rows(source, d.text_column, d.tokenizer, seq_len + 1, d.cache_dir)
    return TokenDataset.of_rows(rows, seq_len)


def counted_source(cfg: Config) -> DataSource:
    """The run's files counted by opening (decoding) every one of them in this process: for the one-process
    reference and tools; a run's driver counts them from their metadata instead (raytrain.driver.prepare)."""
    def counted(paths: list[str]) -> Files:
        if cfg.data.inputs is not None:  # rows: the footer counts them
            import pyarrow.parquet as pq

            return Files(tuple(paths), tuple(pq.ParquetFile(p).metadata.num_rows for p in paths))
        return Files(tuple(paths), tuple(len(open_dataset(p, cfg)) for p in paths))

    held = eval_files(cfg)
    train = counted(data_files(cfg))
    spec = SampleSpec.tokens(cfg.model.seq_len) if cfg.data.inputs is None else spec_of(open_rows(train, cfg.data))
    return DataSource(train, spec, None if held is None else counted(held))


def spec_of(dataset: Dataset) -> SampleSpec:
    """The shape of a dataset's samples, from its first one."""
    x, y = dataset.batch([0])
    return SampleSpec(TensorSpec(tuple(x.shape[1:]), str(x.dtype).removeprefix("torch.")),
                      TensorSpec(tuple(y.shape[1:]), str(y.dtype).removeprefix("torch.")))


def open_rows(source: Union[Files, Blocks], d: DataConfig) -> RowDataset:
    """data.inputs and data.targets rows of Parquet files or a Ray Dataset's blocks, read part by part."""
    names = column_names(d.inputs, d.targets)
    read = block_part(source.refs, names) if isinstance(source, Blocks) else parquet_part(source.paths, names)
    return RowDataset(source, read, column_sampler(d.inputs, d.targets, load_transform(d.transform)))


def load_transform(spec: Optional[str]) -> Optional[Transform]:
    """data.transform's function (``pkg.module:fn``), imported; None when unset."""
    if spec is None:
        return None
    from raytrain.models.user_code import import_user_module

    module, _, name = spec.partition(":")
    return getattr(import_user_module(module), name)
