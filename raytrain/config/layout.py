"""A run's parallel layout as one value: how its workers divide the batch and the model.

``Layout`` answers what the config, the driver, the reporter and Tune ask of a layout: its worker grid
(``mesh``: dp x fsdp x tp x pp, raytrain.config.mesh, which owns the world size and the rank arithmetic), its
label (``dp=2 pp=2 m=4 1f1b``), and, once the model is known (``for_model``, or
``raytrain.driver.model_check.model_layout`` for the stage cuts), the layer count and each stage's layers. A label
is an answer, never an input: nothing parses it back. No torch and no Ray here: anything may import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from raytrain.config.errors import require
from raytrain.config.mesh import Mesh
from raytrain.pipeline.actions import Placement

if TYPE_CHECKING:
    from raytrain.config import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class Layout:
    mesh: Mesh = field(default_factory=Mesh)
    """The worker grid: dp replicas x fsdp shards x tp splits x pp stages."""
    microbatches: int = 1
    """Micro-batches each replica splits its share of the global batch into."""
    schedule: str = "1f1b"
    """Pipeline schedule (named in the label only when pp > 1)."""
    virtual_stages: int = 1
    """Model chunks per pipeline worker (interleaved_1f1b, zbv: raytrain.pipeline.schedule places them)."""
    cuts: Optional[tuple[int, ...]] = None
    """First layer of every model chunk after the first: parallel.split_points, or planned; None
    while not chosen."""
    num_layers: Optional[int] = None
    """Cuttable layers of the model; None until ``for_model`` is told."""

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Layout:
        """The layout a ``parallel`` config section sets (hand-set cuts included)."""
        cuts = None if parallel.split_points is None else tuple(parallel.split_points)
        return cls(mesh=Mesh(dp=parallel.dp, fsdp=parallel.fsdp, tp=parallel.tp, pp=parallel.pp),
                   microbatches=parallel.microbatches, schedule=parallel.schedule,
                   virtual_stages=parallel.virtual_stages, cuts=cuts)

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def fsdp(self) -> int:
        return self.mesh.fsdp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def world_size(self) -> int:
        """Workers the layout needs (the grid's)."""
        return self.mesh.world_size

    @property
    def grid_label(self) -> str:
        """``dp=2 pp=1``: the worker grid alone, as metric rows and repair events name a live layout."""
        return self.mesh.grid_label

    @property
    def num_chunks(self) -> int:
        """Pieces the model is cut into: pp stages of virtual_stages chunks each."""
        return self.pp * self.virtual_stages

    @property
    def needs_cuts(self) -> bool:
        """Whether the stage cuts are still to be chosen: a pipeline without parallel.split_points."""
        return self.cuts is None and self.num_chunks > 1

    @property
    def label(self) -> str:
        """``dp=2 pp=1 m=1``, ``dp=2 fsdp=2 pp=1 m=1``, or ``dp=1 pp=2 m=4 1f1b`` for a pipeline: how runs,
        rows and trials name it."""
        parts = [self.grid_label] + ([f"v={self.virtual_stages}"] if self.virtual_stages > 1 else [])
        parts += [f"m={self.microbatches}"] + ([self.schedule] if self.pp > 1 else [])
        return " ".join(parts)

    def with_dp(self, dp: int) -> Layout:
        """This layout with ``dp`` replicas, as a repair or a grow leaves it."""
        return dataclasses.replace(self, mesh=self.mesh.with_dp(dp))

    def for_model(self, num_layers: int, model: str) -> Layout:
        """This layout over a model of ``num_layers`` cuttable layers; a ValueError naming
        parallel.pp or parallel.split_points when it cannot be cut so. ``model`` names the layers'
        source in that error ("model.factory")."""
        chunked = f"x parallel.virtual_stages={self.virtual_stages} chunks " if self.virtual_stages > 1 else ""
        require(self.num_chunks <= num_layers, "parallel.pp", self.pp,
                f"{chunked}exceeds the {num_layers} layers of {model}; lower parallel.pp"
                + (" or parallel.virtual_stages" if chunked else ""))
        require(not self.cuts or (0 < self.cuts[0] and self.cuts[-1] < num_layers), "parallel.split_points",
                list(self.cuts or ()), f"out of range; cuts must lie in 1..{num_layers - 1}")
        return dataclasses.replace(self, num_layers=num_layers)

    @property
    def stage_ranges(self) -> list[range]:
        """Global layer indices of each model chunk, in pipeline order."""
        assert self.num_layers is not None, "the layer count is not known yet: call for_model (or model_layout)"
        cuts = self.cuts if self.cuts is not None else ()
        assert len(cuts) == self.num_chunks - 1, f"{self.num_chunks} chunks need {self.num_chunks - 1} cuts: {cuts}"
        bounds = [0, *cuts, self.num_layers]
        return [range(begin, end) for begin, end in zip(bounds, bounds[1:])]

    @property
    def placement(self) -> Placement:
        """Which pipeline stage each worker's chunk is (looped, or V for zbv and dualpipev)."""
        return Placement.of_schedule(self.schedule, self.pp, self.virtual_stages)

    def worker_chunks(self, stage: int) -> list[range]:
        """The layers of each model chunk pipeline worker ``stage`` holds, in chunk order (one chunk, its
        stage's layers, without virtual stages)."""
        ranges = self.stage_ranges
        return [ranges[self.placement.stage(stage, chunk)] for chunk in range(self.virtual_stages)]

    @property
    def worker_layers(self) -> list[list[list[int]]]:
        """``worker_chunks`` of every pipeline worker as lists: what the coordinator, the workers and a
        checkpoint's manifest take."""
        return [[list(r) for r in self.worker_chunks(s)] for s in range(self.pp)]
