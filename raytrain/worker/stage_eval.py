"""A stage's side of the held-out loss (eval.every): forward-only passes over the held-out rows with
the committed parameters, through the step's own executor, under ``torch.no_grad``.

Hosted by raytrain.worker.stage; the coordinator's side is raytrain.control.evaluation. The held-out rows are read
in order, ``train.global_batch`` per batch, each batch split across the replicas and into
micro-batches as a training batch is; the last stage sums the per-row losses. Nothing of the training
state changes: no gradient is produced (the buckets, the optimizer and the step count are untouched),
the layers run in eval mode (a user model's dropout draws no random numbers, its batch norm updates no
statistics) and return to their mode after, and no fault hook of a training step fires.
"""

from __future__ import annotations

from typing import Optional

import torch

from raytrain import data
from raytrain.config import Config
from raytrain.data.samples import check_class_ids
from raytrain.reports import EvalReport
from raytrain.worker.executor import ScheduleExecutor
from raytrain.worker.generation import Generation, for_evaluation
from raytrain.worker.metrics import HeldOutMetrics
from raytrain.worker.phases import PhaseHook


class HeldOutLoss:
    """One stage's evaluator: where its held-out rows are, and the forward passes over them."""

    def __init__(self, cfg: Config, source: data.DataSource, num_samples: int, device: torch.device):
        self.cfg, self.device = cfg, device
        self.source, self.num_samples = source, num_samples  # read at the first evaluation
        self.dataset: Optional[data.Dataset] = None  # data.eval_path's rows, opened on first use

    def loss_sum(self, executor: ScheduleExecutor, gen: Generation, step: int,
                 train_rows: Optional[data.Dataset]) -> tuple[float, int, HeldOutMetrics]:
        """Sum over this worker's share of the held-out rows of their mean loss (meaningful on the last
        stage only), how many rows that share is, and eval.metrics' sums over them, run by the stage's
        executor of this generation. ``train_rows``: the stage's training dataset (data.eval_fraction's rows
        follow its training rows); ``step`` only labels the pass."""
        forward, rows, B = for_evaluation(gen), self._rows(gen, train_rows), self.cfg.train.global_batch
        first = data.held_out_source(self.cfg, self.source, self.num_samples)[1]
        module, total, metrics = executor.module, 0.0, HeldOutMetrics(self.cfg.eval.metrics)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for batch in range(self.cfg.eval.batches):
                    x = y = None
                    if rows is not None:
                        ids = data.held_out_ids(first, batch, B, gen.batch_offset, gen.batch_offset + gen.share)
                        seeds = data.sample_seeds(self.cfg.train.seed, ids, [data.HELD_OUT_EPOCH] * len(ids))
                        x, y = rows.batch(ids, seeds, training=False)
                        if gen.is_last:
                            check_class_ids(y, ids, self.source.classes, held_out=True)
                        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                    total += float(executor.run(forward, step, x, y, PhaseHook(), trace=False, metrics=metrics).loss_sum)
        finally:
            module.train(was_training)
        return total, self.cfg.eval.batches * gen.share, metrics

    def evaluate(self, executor: ScheduleExecutor, gen: Generation, step: int, train_rows: Optional[data.Dataset],
                 report: EvalReport) -> EvalReport:
        """``report`` filled in with this worker's share of the held-out loss (``loss_sum``) and eval.metrics (a
        last stage's, of tp rank 0: the other tp ranks compute the same); RuntimeError for a failed collective."""
        loss_sum, rows, metrics = self.loss_sum(executor, gen, step, train_rows)
        if gen.is_last and gen.tp_index == 0:
            report.loss_sum, report.rows = loss_sum, rows
            report.metric_sums, report.metric_counts = metrics.sums, metrics.counts
        report.ok = True
        return report

    def _rows(self, gen: Generation, train_rows: Optional[data.Dataset]) -> Optional[data.Dataset]:
        """The dataset the held-out rows are read from (first and last stages only; None elsewhere)."""
        if not (gen.is_first or gen.is_last):
            return None
        if self.source.held_out is None:  # data.eval_fraction's rows: the training samples' last ones
            return train_rows
        if self.dataset is None:
            self.dataset = data.open_dataset(data.held_out_source(self.cfg, self.source, self.num_samples)[0], self.cfg)
        return self.dataset
