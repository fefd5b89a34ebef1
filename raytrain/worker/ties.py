"""Parameters tied across pipeline stages (an input embedding tied to the output head): each worker that
holds one keeps its own copy, and the copies stay equal because every step sums their gradients over the
workers that hold them (DeepSpeed's TiedLayerSpec does the same); the global norm counts them once, and
the worker holding the parameter's first layer writes it to checkpoints, under its global name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytrain.config.prepared import Tie
from raytrain.worker.gradsync import all_reduce_flat
from raytrain.worker.groups import Groups


@dataclass(frozen=True)
class _Held:
    index: int
    """Its place in the stage's parameters."""
    name: str
    """Its global name."""
    workers: tuple[int, ...]
    """The pipeline workers that hold it."""
    owner: bool
    """This worker holds its first layer: it counts it in the norm and writes it."""


class TiedParameters:
    """This worker's share of the run's ties across stages (``ties``: those of the run; ``stage``: this
    worker's pipeline index; ``names``: its parameters' names as its layers give them)."""

    def __init__(self, ties: tuple[Tie, ...], stage_layers: list[list[list[int]]], stage: int, names: list[str]):
        self.held: list[_Held] = []
        for tie in ties:
            workers = tie.workers(stage_layers)
            index = next((i for i, n in enumerate(names) if n in tie.names), None)
            if stage in workers and index is not None:
                owner = any(tie.layers[0] in chunk for chunk in stage_layers[stage])
                self.held.append(_Held(index, tie.name, workers, owner))

    @property
    def worker_sets(self) -> tuple[tuple[int, ...], ...]:
        return tuple(h.workers for h in self.held)

    def global_names(self, names: list[str]) -> list[str]:
        """``names`` with each tied parameter under its global name."""
        renamed = list(names)
        for h in self.held:
            renamed[h.index] = h.name
        return renamed

    def written(self, count: int) -> list[bool]:
        """Of each of ``count`` parameters: whether this worker writes it (it does not write a tie it does not own)."""
        return [not any(h.index == i and not h.owner for h in self.held) for i in range(count)]

    def reduce(self, params: list[torch.Tensor], groups: Groups) -> None:
        """Sum each tied parameter's gradient over the workers that hold it (collective over each tie group)."""
        for workers in sorted(set(self.worker_sets)):
            grads = [params[h.index].grad for h in self.held if h.workers == workers]
            all_reduce_flat(grads, groups.tie_groups[workers])

    def counted_elsewhere(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tied parameters another worker counts in the global norm."""
        return [params[h.index] for h in self.held if not h.owner]
