"""The samples a stage reads: which ones each step (its replica's share of the step's positions in the sample
order, raytrain.data.order), their seeds, and reading them from the dataset, which a stage opens at its first
join when it is a first or last stage (one that takes the inputs or the targets)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from raytrain import data
from raytrain.config import Config
from raytrain.data.samples import DataSource, check_class_ids
from raytrain.worker.activations import TensorShape
from raytrain.worker.generation import Generation


class StageSamples:
    """A stage's view of the run's samples (``source``, ``num_samples`` of them trained on)."""

    def __init__(self, cfg: Config, source: DataSource, num_samples: int, device: torch.device):
        self.cfg, self.source, self.num_samples, self.device = cfg, source, num_samples, device
        self.dataset: Optional[data.Dataset] = None
        """Opened at the first join of a first or last stage; its files or blocks open as steps reach them."""
        inputs = source.sample.inputs
        self.inputs = TensorShape(inputs.shape, getattr(torch, inputs.dtype))
        """A sample's inputs: what the first stage's layers take."""

    def open_for(self, gen: Generation) -> None:
        """Open the dataset if this stage reads inputs or targets in ``gen`` (once)."""
        if self.dataset is None and (gen.is_first or gen.is_last):
            self.dataset = data.open_dataset(self.source.train, self.cfg)

    def of_step(self, step: int, gen: Generation, hook: Callable[[str, int], None]):
        """(sample ids, inputs, targets) of this worker's share of ``step``: the ids for every stage, the tensors
        (on the device) only where a dataset is open; the ``data`` phase point before the read."""
        cfg = self.cfg
        begin, end = data.step_positions(step, cfg.train.global_batch, gen.batch_offset, gen.batch_offset + gen.share)
        origin = cfg.data.order_origin
        ids = data.sample_ids(cfg.train.seed, self.num_samples, begin, end, origin)
        hook("data", step)
        if self.dataset is None:
            return ids, None, None
        seeds = data.sample_seeds(cfg.train.seed, ids, data.position_epochs(self.num_samples, begin, end, origin))
        x, y = self.dataset.batch(ids, seeds)
        if gen.is_last:
            check_class_ids(y, ids, self.source.classes)
        return ids, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
