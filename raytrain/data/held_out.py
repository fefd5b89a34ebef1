"""Held-out rows (eval.every): which rows data.eval_fraction or data.eval_path holds out, never trained on,
and which of them each replica evaluates."""

from __future__ import annotations

from raytrain.config import Config
from raytrain.data.samples import DataSource, Samples

def held_out_count(rows: int, eval_fraction: float) -> int:
    """Rows of a dataset of ``rows`` (samples: a token column's windows, or text's packed rows) that
    data.eval_fraction holds out: floor(rows x eval_fraction), its last ones (the tolerance keeps 0.29 x
    100 at 29, not 28)."""
    return int(rows * eval_fraction + 1e-9)


def training_rows(cfg: Config, rows: int) -> int:
    """The rows of a dataset of ``rows`` that are trained on (the run's ``num_samples``): all but the
    last ones data.eval_fraction holds out (0 when the held-out rows are apart: data.eval_path, an
    eval_dataset, which the config and prepare keep from coming with a fraction)."""
    return rows - held_out_count(rows, cfg.data.eval_fraction)


def held_out_source(cfg: Config, source: DataSource, num_samples: int) -> tuple[Samples, int]:
    """Where the held-out rows are: (files, id of the first row an evaluation reads).

    Apart (data.eval_path's files, an eval_dataset): from their first row; else data.eval_fraction's rows of
    the training samples, which follow their ``num_samples`` training rows.
    """
    if source.held_out is not None:
        return source.held_out, 0
    return source.train, num_samples


def held_out_ids(first: int, batch: int, global_batch: int, begin: int, end: int) -> list[int]:
    """Row ids of held-out batch ``batch`` that a replica with batch offsets [begin, end) evaluates:
    the held-out rows are read in order, ``global_batch`` per batch, split across replicas as a step is."""
    start = first + batch * global_batch
    return list(range(start + begin, start + end))

