"""A run's samples as a dataset a worker reads batches from: ``open_dataset`` over what prepare resolved.

Every dataset answers ``len`` and ``batch(sample_ids) -> (inputs, targets)``: tensors whose first
dimension is the batch, in the order of the ids.
"""

from __future__ import annotations

from typing import Union

from raytrain.config import Config
from raytrain.data import text as text_data
from raytrain.data.corpus import data_files, eval_files
from raytrain.data.samples import DataSource, SampleSpec
from raytrain.data.shards import Files
from raytrain.data.tokens import ShardedDataset, TokenDataset

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
    return DataSource(counted(data_files(cfg)), SampleSpec.tokens(cfg.model.seq_len),
                      None if held is None else counted(held))
