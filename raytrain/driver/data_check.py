"""The run's data checked and counted on the driver before any actor starts: data.path's and data.eval_path's
files (token windows, or text tokenised and packed), and the rows held out of training."""

from __future__ import annotations

from raytrain import data
from raytrain.config import Config
from raytrain.data import text as text_data
from raytrain.data import shards
from raytrain.data.samples import DataSource, SampleSpec
from raytrain.data.shards import Files


def split_held_out(cfg: Config, source: DataSource) -> tuple[int, int]:
    """(training rows, held-out rows) of the run's data: data.eval_fraction holds out the training files'
    last rows, data.eval_path (checked like data.path) holds its own. A ValueError naming the keys when too
    few rows are left to train on, or (with eval.every) too few held out for eval.batches: an error, not a
    clamp, so that every evaluation reads exactly eval.batches x train.global_batch rows."""
    d, B, rows = cfg.data, cfg.train.global_batch, source.train.total
    if d.eval_path is not None:
        held = source.held_out.total
        where, fix = f"data.eval_path={d.eval_path!r} has {held} rows", "add rows to it"
    else:
        held = data.held_out_count(rows, d.eval_fraction)
        where = f"data.eval_fraction={d.eval_fraction:g} holds out the last {held} of the {rows} rows"
        fix = f"raise data.eval_fraction to >= {cfg.eval.batches * B / rows:.3g}"
        if rows - held < B:
            raise ValueError(f"{where}, leaving {rows - held} to train on, fewer than train.global_batch={B}; "
                             "lower data.eval_fraction, or use data.eval_path")
    need = cfg.eval.batches * B
    if cfg.eval.every and held < need:
        raise ValueError(f"{where}, fewer than the eval.batches={cfg.eval.batches} x train.global_batch={B} = "
                         f"{need} that each evaluation reads (it refuses rather than reading fewer); {fix}, "
                         "or lower eval.batches")
    return data.training_rows(cfg, rows), held


def check_data(cfg: Config) -> DataSource:
    """data.path's files and data.eval_path's, resolved (raytrain.data.shards) and each checked and counted
    (``check_files``)."""
    held = data.eval_files(cfg)
    return DataSource(check_files(cfg, data.data_files(cfg), "data.path"), SampleSpec.tokens(cfg.model.seq_len),
                      None if held is None else check_files(cfg, held, "data.eval_path"))


def check_files(cfg: Config, paths: list[str], key: str) -> Files:
    """Every file of a dataset (``key`` names it) checked and counted before any actor starts. Token data
    (data.column) needs only each Parquet footer where the column has a fixed width and statistics (the
    built-in corpus's form); otherwise each file's column is streamed (nulls, row lengths, ids) once per
    file version: the findings are remembered in data.cache_dir, so preparing the same files again reads
    footers. Text (data.text_column) is tokenised here, file by file into this machine's cache: its packed
    rows cannot be counted without the tokens (the sample order is a permutation of all of them). A bad
    file (not Parquet, wrong or missing column, empty) is named, with the fix; the training files together
    must fill a global batch."""
    B = cfg.train.global_batch
    if len(paths) == 1:
        return shards.one_file(paths[0], _check_data(cfg, paths[0], key, B if key == "data.path" else 0))
    spec = cfg.data.path if key == "data.path" else cfg.data.eval_path
    where = f"one of the {len(paths)} files {key}={spec!r} names: fix it or remove it from there"
    samples = []
    for path in paths:
        try:
            count = _check_data(cfg, path, key, 0)
        except ValueError as e:
            raise ValueError(f"{e} ({where})") from e
        if count == 0:
            raise ValueError(f"{key} file {path!r} is empty: it holds no samples ({where})")
        samples.append(count)
    total = sum(samples)
    if key == "data.path" and total < B:
        raise ValueError(f"{key}={spec!r}: its {len(paths)} files hold {total} samples (of model.seq_len + 1 = "
                         f"{cfg.model.seq_len + 1} tokens), fewer than train.global_batch={B}; add data, or lower "
                         "train.global_batch or model.seq_len")
    return Files(tuple(paths), tuple(samples))


def _check_data(cfg: Config, data_path: str, key: str, batch: int) -> int:
    """The samples in a file of the run's data (``key`` names it), checked: the windows of model.seq_len + 1
    tokens its token rows (data.column) are cut into, or text packed into such rows (data.text_column:
    tokenised here, into this machine's cache, to count them); at least ``batch`` of them."""
    m, d = cfg.model, cfg.data
    if d.text_column is not None:
        return text_data.check_text_dataset(data_path, d, m.seq_len, batch, m.vocab_size, key=key)
    if text_data.is_json_lines(data_path):
        raise ValueError(f"{key}={data_path!r} is JSON lines, read as text: set data.text_column to the key "
                         "holding the text and data.tokenizer to a directory holding tokenizer.json")
    return data.check_dataset(data_path, d.column, m.seq_len, batch, m.vocab_size, key=key, cache_dir=d.cache_dir)


