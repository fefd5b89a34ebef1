"""The values a run is carried by across its process boundaries: built once, never taken apart.

``PreparedRun``: what ``raytrain.driver.prepare.prepare`` checked and decided on the driver, before any actor
starts; the driver runs it, and the coordinator is constructed from it. ``WorkerSpec``: what the
coordinator hands every worker it starts (the same value for each), with the worker's ``Slot``. Both are
frozen; a changed run (a layout chosen by parallel.auto, a coordinator restarted from a checkpoint) is a
new value made with ``dataclasses.replace``. No torch and no Ray here: every process imports this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from raytrain.config import Config
    from raytrain.config.layout import Layout


HEARTBEAT_S = 1.0
"""How often a worker proves it is alive to its coordinator (``WorkerSpec.heartbeat_to``)."""


@dataclass(frozen=True)
class Tie:
    """A parameter that several layers share (an input embedding tied to the output head)."""

    name: str
    """Its global name: its name under the first layer that holds it."""
    layers: tuple[int, ...]
    """Every layer that holds it, in order."""
    names: tuple[str, ...] = ()
    """Its name under each of those layers (``"5.lm_head.weight"``), in the same order."""

    def workers(self, stage_layers: list[list[list[int]]]) -> tuple[int, ...]:
        """The pipeline workers that hold it (``stage_layers``: per worker, per chunk, its global layer ids)."""
        return tuple(w for w, chunks in enumerate(stage_layers) if any(i in c for c in chunks for i in self.layers))


@dataclass(frozen=True)
class ModelFacts:
    """What the driver learned of the model, building it once (on the meta device where it can, by
    arithmetic for the built-in GPT)."""

    layer_params: tuple[int, ...]
    """Parameters of each cuttable layer, in order (a shared one counted in each layer that holds it)."""
    max_fsdp: int
    """The most shards parallel.fsdp may cut the parameters into (raytrain.driver.model_check.shardable_rows)."""
    ties: tuple[Tie, ...] = ()
    """Parameters that several layers share."""

    def ties_across(self, stage_layers: list[list[list[int]]]) -> tuple[Tie, ...]:
        """The ties whose layers more than one pipeline worker holds (``stage_layers``: per worker, per
        chunk, its global layer ids)."""
        return tuple(t for t in self.ties if len(t.workers(stage_layers)) > 1)


@dataclass(frozen=True)
class Slot:
    """Which part of a replica a worker hosts: its pipeline stage, fsdp shard and tp rank. Fixed for the
    worker's life (its replica and rank change with the generations)."""

    stage: int
    shard: int = 0
    tp: int = 0


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a run starts from."""

    cfg: Config
    source: Any
    """The samples it reads (the first and last stages), and their shape: a raytrain.data.samples.DataSource
    (named, not imported: config sits below data)."""
    num_samples: int
    """Training samples: the sample order permutes ids 0..num_samples-1."""
    stage_layers: list[list[list[int]]]
    """Per pipeline worker, per model chunk: its global layer ids."""
    ties: tuple[Tie, ...] = ()
    """Parameters shared by layers that different pipeline workers hold: kept equal by summing their
    gradients over those workers."""
    model_code: Optional[bytes] = None
    """The Python API's model builder (``raytrain.train(cfg, model=fn)``), pickled; None: model.factory,
    model.hf or the built-in GPT."""
    corpus: Optional[list] = None
    """[ObjectRef of the built-in corpus's bytes], for a worker whose machine lacks the driver's copy."""
    heartbeat_to: Any = None
    """The coordinator's actor handle: a worker calls its ``beat`` every second (raytrain.control.liveness);
    None outside a Ray run (forked test harnesses)."""

    def chunks(self, slot: Slot) -> list[list[int]]:
        """The global layer ids of each model chunk the worker at ``slot`` holds."""
        return self.stage_layers[slot.stage]


@dataclass(frozen=True)
class PreparedRun:
    """A checked run: what the driver, the coordinator and its workers are started with."""

    cfg: Config
    """The config with its defaults filled in: run.name and checkpoint.dir are set."""
    layout: Layout
    """The layout, with the model's layer count and each stage's layers."""
    source: Any
    """The samples the run reads, each counted, and the shape of one (a raytrain.data.samples.DataSource)."""
    num_samples: int
    """Training samples, all files together, after those data.eval_fraction holds out."""
    model: ModelFacts
    """The model's layers' sizes and ties."""
    resume: Optional[str] = None
    """The checkpoint to resume from, checked; None to start fresh."""
    held_out: int = 0
    """Held-out samples (data.eval_fraction's, data.eval_path's or eval_dataset's); never trained on."""
    model_code: Optional[bytes] = None
    """The Python API's model builder, pickled (``WorkerSpec.model_code``)."""
    data_identity: Optional[dict] = None
    """The training data as each checkpoint's manifest records it (raytrain.data.identity.record: files, sizes,
    samples, content fingerprints; plain JSON, so the coordinator needs no data code); compared on a resume."""

    @property
    def run_dir(self) -> str:
        return os.path.join(os.path.abspath(os.path.expanduser(self.cfg.run.dir)), self.cfg.run.name)

    @property
    def stage_layers(self) -> list[list[list[int]]]:
        """Global layer indices of each model chunk of each pipeline worker: ``stage_layers[stage]`` is one
        list per chunk (one chunk without virtual stages)."""
        return self.layout.worker_layers

    @property
    def builtin_corpus(self) -> Optional[str]:
        """The built-in corpus the driver built in its own cache (data.path unset), else None."""
        return self.source.train.paths[0] if self.cfg.data.path is None and _is_files(self.source.train) else None

    def worker_spec(self, corpus: Optional[list] = None, heartbeat_to: Any = None) -> WorkerSpec:
        """What every worker of this run is started with; ``corpus``: [ObjectRef of the built-in corpus's bytes];
        ``heartbeat_to``: the coordinator's handle."""
        return WorkerSpec(cfg=self.cfg, source=self.source, num_samples=self.num_samples,
                          stage_layers=self.stage_layers, ties=self.model.ties_across(self.stage_layers),
                          model_code=self.model_code, corpus=corpus, heartbeat_to=heartbeat_to)


def _is_files(samples: Any) -> bool:
    return hasattr(samples, "paths")
