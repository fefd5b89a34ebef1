"""The run's data checked and counted on the driver before any actor starts: data.path's and data.eval_path's
files (token windows, text tokenised and packed, or rows of data.inputs / data.targets columns), or a user's
dataset objects (raytrain.driver.user_data), and the rows held out of training."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from raytrain import data
from raytrain.config import Config
from raytrain.data import identity, row_checks
from raytrain.data import text as text_data
from raytrain.data.columns import column_names
from raytrain.data.rows import column_sampler
from raytrain.data.samples import DataSource, SampleSpec
from raytrain.data.shards import Files
from raytrain.data.token_checks import first_line
from raytrain.driver import user_data

Example = Callable[[], tuple]
"""() -> (inputs, targets) of the first samples: what the model is tried on before any actor starts."""


@dataclass(frozen=True)
class CheckedData:
    """The data, checked: what the run reads, and what the model's check needs of it."""

    source: DataSource
    example: Example
    target_range: Optional[tuple[float, float]] = None
    """The smallest and largest training target, where the check read every one (Parquet rows)."""


def check_data(cfg: Config, dataset: Any = None, eval_dataset: Any = None) -> CheckedData:
    """The run's data checked and counted: the Python API's dataset objects or data.factory's, else
    data.path's files (or the built-in data) and data.eval_path's."""
    if cfg.data.factory is not None:
        if dataset is not None:
            raise ValueError("data.factory and raytrain.train(dataset=...) both give the training data: drop one")
        dataset, eval_dataset = user_data.data_factory(cfg)
    if dataset is not None:
        return check_objects(cfg, dataset, eval_dataset)
    if eval_dataset is not None:
        raise ValueError("raytrain.train(eval_dataset=...) needs dataset= too (or data.factory); data.eval_path "
                         "names held-out files beside data.path")
    if cfg.data.inputs is not None:
        return check_rows(cfg)
    source = check_token_data(cfg)
    return CheckedData(source, lambda: data.open_dataset(source.train, cfg).batch([0, 1]))


def check_objects(cfg: Config, dataset: Any, eval_dataset: Any) -> CheckedData:
    """A torch Dataset or a Ray Dataset (and its held-out one): pickled or materialised into Ray's object
    store; their samples must have one shape."""
    if cfg.data.eval_path is not None:
        raise ValueError("data.eval_path names held-out files, but the training data is a dataset object: pass the "
                         "held-out one as eval_dataset= (or return (train, held_out) from data.factory)")
    where = "data.factory" if cfg.data.factory is not None else "dataset"
    if eval_dataset is not None and cfg.data.eval_fraction > 0:
        raise ValueError(f"data.eval_fraction={cfg.data.eval_fraction:g} and {where}'s held-out dataset both give "
                         "held-out rows: unset one of them")
    train, spec, example, target_range = user_data.user_samples(dataset, where, cfg)
    held = None
    if eval_dataset is not None:
        held, held_spec, _, held_range = user_data.user_samples(eval_dataset, f"{where}'s held-out dataset", cfg)
        _same_shape(spec, held_spec, where)
        target_range = row_checks.range_union(target_range, held_range)
    return CheckedData(DataSource(train, spec, held), lambda: example, _class_ids_read(cfg, target_range))


def check_rows(cfg: Config) -> CheckedData:
    """Parquet rows of data.inputs and data.targets columns (data.path's files, or the built-in digits),
    each file checked; a sample's shape from the first rows, through data.transform when set."""
    key = "data.path" if cfg.data.path else f"data.builtin={cfg.data.builtin}, file"
    train, target_range = check_row_files(cfg, data.data_files(cfg), key)
    example = _first_samples(cfg, train)
    spec = user_data.spec_of(example)
    held_files = data.eval_files(cfg)
    held = None
    if held_files is not None:
        held, held_range = check_row_files(cfg, held_files, "data.eval_path")
        identity.check_no_copies(train, held)
        _same_shape(spec, user_data.spec_of(_first_samples(cfg, held)), "data.eval_path")
        target_range = row_checks.range_union(target_range, held_range)
    return CheckedData(DataSource(train, spec, held), lambda: example, _class_ids_read(cfg, target_range))


def _class_ids_read(cfg: Config, target_range: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """The targets' range as the check read it from the columns; None with data.transform, whose samples'
    targets are not the columns (the class ids are then checked on the first samples it made)."""
    return None if cfg.data.transform else target_range


def _first_samples(cfg: Config, files: Files) -> Example:
    """The first rows of ``files`` made into samples as a worker makes them (through data.transform when set);
    a ValueError naming data.transform, or the columns, when they cannot be."""
    d = cfg.data
    sample = column_sampler(d.inputs, d.targets, data.load_transform(d.transform))
    count = min(user_data.EXAMPLE_ROWS, files.samples[0])
    try:
        return sample(row_checks.first_rows(files.paths[0], column_names(d.inputs, d.targets), count),
                      user_data._seeds(count), True)
    except Exception as e:  # noqa: BLE001 -- the user's transform: one line naming it
        what = f"data.transform={d.transform!r}" if d.transform else "data.inputs / data.targets"
        raise ValueError(f"{what} cannot make samples of the first rows of {files.paths[0]!r}: "
                         f"{type(e).__name__}: {first_line(e)}") from e


def check_row_files(cfg: Config, paths: list[str], key: str) -> tuple[Files, Optional[tuple[float, float]]]:
    """Every file of rows checked (row_checks.check_row_file), counted and fingerprinted, their columns of one
    type; the targets' range over them."""
    d, counts, target_range, first = cfg.data, [], None, None
    for path in paths:
        facts = row_checks.check_row_file(path, d.inputs, d.targets, key)
        if facts.rows == 0:
            raise ValueError(f"{key} file {path!r} is empty: it holds no rows; remove it")
        first = first or (path, facts.column_types)
        for (column, kind), (_, first_kind) in zip(facts.column_types, first[1]):
            if kind != first_kind:
                raise ValueError(f"{key}: column {column!r} is {kind} in {path!r} but {first_kind} in {first[0]!r}: "
                                 "every file of the data must give samples of one shape and type; rewrite one")
        counts.append(facts.rows)
        target_range = row_checks.range_union(target_range, facts.target_range)
    return Files(tuple(paths), tuple(counts), identity.fingerprints(paths)), target_range


def check_metrics(cfg: Config, sample: SampleSpec) -> None:
    """eval.metrics that the targets can give: accuracy and top5 count class ids (integer targets), mse and
    mae compare float targets."""
    floating = not sample.targets.is_integer
    for metric in cfg.eval.metrics:
        if metric in ("accuracy", "top5") and floating:
            raise ValueError(f"eval.metrics={cfg.eval.metrics}: accuracy and top5 count class ids, and the targets are "
                             f"{sample.targets.describe()}; use mse or mae")
        if metric in ("mse", "mae") and not floating:
            raise ValueError(f"eval.metrics={cfg.eval.metrics}: mse and mae compare float targets, and the targets are "
                             f"{sample.targets.describe()} (class ids); use accuracy or top5")


def _same_shape(train: SampleSpec, held: SampleSpec, where: str) -> None:
    if train != held:
        raise ValueError(f"{where}: the held-out samples are {held.inputs.describe()} -> {held.targets.describe()}, "
                         f"the training ones {train.inputs.describe()} -> {train.targets.describe()}; give both one shape")


def split_held_out(cfg: Config, source: DataSource) -> tuple[int, int]:
    """(training rows, held-out rows) of the run's data: data.eval_fraction holds out the training files'
    last rows, data.eval_path (checked like data.path) holds its own. A ValueError naming the keys when too
    few rows are left to train on, or (with eval.every) too few held out for eval.batches: an error, not a
    clamp, so that every evaluation reads exactly eval.batches x train.global_batch rows."""
    d, B, rows = cfg.data, cfg.train.global_batch, source.train.total
    if cfg.eval.every and d.eval_fraction == 0 and source.held_out is None:
        raise ValueError(f"eval.every={cfg.eval.every}: the held-out loss needs held-out rows: set data.eval_fraction "
                         "(e.g. 0.05: the last 5% of the rows, never trained on) or data.eval_path (files of the same "
                         "format), or pass eval_dataset=; or set eval.every=0")
    if source.held_out is not None:
        held = source.held_out.total
        name = f"data.eval_path={d.eval_path!r}" if d.eval_path is not None else "the held-out dataset"
        where, fix = f"{name} has {held} rows", "add rows to it"
        if rows < B:
            raise ValueError(f"the training data has {rows} rows, fewer than train.global_batch={B} (its held-out rows "
                             f"are {name}'s); add rows, or lower train.global_batch")
    else:
        held = data.held_out_count(rows, d.eval_fraction)
        where = f"data.eval_fraction={d.eval_fraction:g} holds out the last {held} of the {rows} rows"
        fix = f"raise data.eval_fraction to >= {cfg.eval.batches * B / rows:.3g}"
        if rows - held < B and held == 0:
            raise ValueError(f"the training data has {rows} rows, fewer than train.global_batch={B}: add rows, or "
                             "lower train.global_batch")
        if rows - held < B:
            raise ValueError(f"{where}, leaving {rows - held} to train on, fewer than train.global_batch={B}; "
                             "lower data.eval_fraction, or use data.eval_path")
    if held and not cfg.eval.every and d.eval_fraction > 0:
        warnings.warn(f"data.eval_fraction={d.eval_fraction:g} holds out {held} rows that eval.every=0 never "
                      "evaluates: set eval.every to measure the held-out loss, or data.eval_fraction=0 to train on them",
                      stacklevel=2)
    need = cfg.eval.batches * B
    if cfg.eval.every and held < need:
        raise ValueError(f"{where}, fewer than the eval.batches={cfg.eval.batches} x train.global_batch={B} = "
                         f"{need} that each evaluation reads (it refuses rather than reading fewer); {fix}, "
                         "or lower eval.batches")
    return data.training_rows(cfg, rows), held


def check_token_data(cfg: Config) -> DataSource:
    """Token data: data.path's files and data.eval_path's, resolved (raytrain.data.shards) and each checked
    and counted (``check_files``); no held-out file is a copy of a training one."""
    held_paths = data.eval_files(cfg)
    train = check_files(cfg, data.data_files(cfg), "data.path")
    held = None if held_paths is None else check_files(cfg, held_paths, "data.eval_path")
    if held is not None:
        identity.check_no_copies(train, held)
    return DataSource(train, SampleSpec.tokens(cfg.model.seq_len), held)


def check_files(cfg: Config, paths: list[str], key: str) -> Files:
    """Every file of a dataset (``key`` names it) checked and counted before any actor starts. Token data
    (data.column) needs only each Parquet footer where the column has a fixed width and statistics (the
    built-in corpus's form); otherwise each file's column is streamed (nulls, row lengths, ids) once per
    file version: the findings are remembered in data.cache_dir, so preparing the same files again reads
    footers. Text (data.text_column) is tokenised here, file by file into this machine's cache: its packed
    rows cannot be counted without the tokens (the sample order is a permutation of all of them). A bad
    file (not Parquet, wrong or missing column, empty) is named, with the fix; the training files together
    must fill a global batch. Each file is fingerprinted (raytrain.data.identity) for the checkpoints' record."""
    B = cfg.train.global_batch
    prints = identity.fingerprints(paths)
    if len(paths) == 1:
        return Files((paths[0],), (_check_data(cfg, paths[0], key, B if key == "data.path" else 0, prints[0]),), prints)
    spec = cfg.data.path if key == "data.path" else cfg.data.eval_path
    where = f"one of the {len(paths)} files {key}={spec!r} names: fix it or remove it from there"
    samples = []
    for path, print_ in zip(paths, prints):
        try:
            count = _check_data(cfg, path, key, 0, print_)
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
    return Files(tuple(paths), tuple(samples), prints)


def _check_data(cfg: Config, data_path: str, key: str, batch: int, fingerprint: identity.Fingerprint) -> int:
    """The samples in a file of the run's data (``key`` names it; ``fingerprint``: its content), checked: the
    windows of model.seq_len + 1 tokens its token rows (data.column) are cut into, or text packed into such
    rows (data.text_column: tokenised here, into this machine's cache, to count them); at least ``batch``."""
    m, d = cfg.model, cfg.data
    if d.text_column is not None:
        return text_data.check_text_dataset(data_path, d, m.seq_len, batch, m.vocab_size, key=key)
    if text_data.is_json_lines(data_path):
        raise ValueError(f"{key}={data_path!r} is JSON lines, read as text: set data.text_column to the key "
                         "holding the text and data.tokenizer to a directory holding tokenizer.json")
    return data.check_dataset(data_path, d.column, m.seq_len, batch, m.vocab_size, key=key, cache_dir=d.cache_dir,
                              fingerprint=fingerprint)


