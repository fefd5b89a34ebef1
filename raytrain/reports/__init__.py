"""What workers tell the coordinator, and what the coordinator tells the driver: typed replies of the
worker protocol (raytrain.control.workergroup.WorkerGroup) and the run's summary.

Pure dataclasses (no torch, no Ray): the worker builds them, Ray pickles them, the coordinator and
the tests' fake worker group read them by attribute, so a misspelt field fails where it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class DrainNotice:
    """A worker was told to leave (a SIGTERM: a preemption notice, ``ray stop``; its node draining); it
    leaves the run at a step boundary: the next, or the first after a replacement started at the notice
    is up (raytrain.worker.drain, raytrain.control.drain)."""

    why: str
    noticed_at: float
    """time.time() when the notice arrived."""
    deadline: Optional[float] = None
    """time.time() by which the worker exits on its own (elastic.drain_grace_s after the notice)."""


@dataclass
class JoinReport:
    """A worker joined a generation's groups."""

    rank: int
    committed: int
    """Steps this worker has applied: the generation brings every member to the same step."""
    pid: int = 0
    node: str = ""
    """The node it runs on: Ray's node id (its host name outside Ray)."""
    params: int = 0
    """Parameters this worker holds (its stage, or its shard of the stage)."""


@dataclass
class StepReport:
    """One worker's reply to ``run_step``: whether the step was applied here (``ok``), where the worker
    stands (``committed``, ``prepared``), and the step's timings and values."""

    rank: int
    step: int
    ok: bool
    committed: int
    prepared: Optional[int] = None
    """The step whose update is computed but not applied (it voted; a survivor may roll it forward)."""
    error: str = ""
    nonfinite: bool = False
    """The world-wide vote found a non-finite loss or gradient: nothing of the step was applied."""
    busy_s: float = 0.0
    wall_s: float = 0.0
    data_s: float = 0.0
    """Of ``wall_s``, the time reading this worker's batch (first and last stages read it)."""
    compile_s: float = 0.0
    """Of ``wall_s``, the time torch.compile spent compiling this worker's layers (train.compile)."""
    pipeline_s: float = 0.0
    """Time from the step's start to the end of this worker's pipeline work (its span in the bubble)."""
    peak_live: int = 0
    """Most micro-batches whose activations this worker held at once."""
    grad_norm: Optional[float] = None
    """The global gradient norm before clipping (None without train.grad_clip)."""
    peak_mem_mb: float = 0.0
    samples: int = 0
    loss_sum: Optional[float] = None
    """Sum of the losses of this worker's rows: only a last stage has it."""
    events: Optional[list] = None
    """(name, start s, end s) of the step's work on this worker, when the step is traced."""
    sample_ids: Optional[list] = None
    """Rows this worker read (run.record_samples, first stages only)."""
    saved: Optional["BackgroundSave"] = None
    """This worker's last background save (checkpoint.async_save) once it has finished, until the next starts."""
    draining: Optional[DrainNotice] = None
    """Set once the worker was told to leave: the coordinator re-forms without it at a boundary."""
    drain_after: bool = False
    """The step's vote counted a worker told to leave (in a step not held): the run re-forms after it."""
    drain_skipped: bool = False
    """Not run: the step before it was the boundary where a worker leaves, so the step sent ahead waits
    for the re-formed run (every worker of the generation skips it alike)."""
    aborted: bool = False
    """The coordinator had this worker abort its process groups during the step (a peer was lost)."""


@dataclass
class EvalReport:
    """One worker's reply to ``evaluate``: a last stage's sum of held-out losses over its rows, and of each
    of eval.metrics over its targets' elements (with their counts)."""

    rank: int
    step: int
    ok: bool
    error: str = ""
    loss_sum: Optional[float] = None
    rows: int = 0
    metric_sums: dict = field(default_factory=dict)
    metric_counts: dict = field(default_factory=dict)


@dataclass
class ShardReport:
    """One worker's reply to ``save``: its file's entry for the manifest, and whether its state was finite."""

    entry: dict
    """The manifest's record of the file (raytrain.checkpoint.save_shard: name, size, checksum, slice)."""
    finite: bool


@dataclass
class BackgroundSave:
    """A shard written on a worker's own thread while training went on (checkpoint.async_save): its
    report once the file is durable, or the error that stopped the write."""

    ckpt_dir: str
    shard: Optional[ShardReport] = None
    error: str = ""


@dataclass
class RunSummary:
    """What the coordinator's ``run`` returns to the driver (which builds the user's Result from it)."""

    steps: int
    checkpoint: Optional[str]
    stopped: Optional[str] = None
    """Why the run stopped before train.steps (a signal), else None."""
    digests: dict = field(default_factory=dict)
    worker_pids: list = field(default_factory=list)
    final_pids: list = field(default_factory=list)
    committed_steps: list = field(default_factory=list)
    failures: int = 0
    recovery_s: list = field(default_factory=list)
    skipped_steps: list = field(default_factory=list)
    time_book: dict = field(default_factory=dict)
    """The coordinator's accounts of its time (raytrain.control.goodput.TimeBook.record); empty when
    the run ended without one (a signal that also ended the coordinator)."""
