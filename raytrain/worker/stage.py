"""One pipeline stage of one data-parallel replica (or one shard of it): its layers, optimizer, data
slice and executor.

Hosted by the ``StageWorker`` actor (raytrain.worker.actor). A worker's stage and shard are fixed for its
life; its place in the grid is not. With parallel.fsdp > 1 the stage's parameters, gradients and
optimizer state are sharded over its fsdp group with FSDP2 (raytrain.worker.sharded); with parallel.tp > 1
each layer is split over its tp group (raytrain.worker.tensor_parallel); either is re-wrapped on the
groups of every generation it joins. Contract: ``join`` a generation (collective over its members)
-> optional ``load`` or ``sync_state`` -> ``run_step(step)`` for every step in order (``evaluate``
between two steps when asked) -> ``save`` on replica 0 of each stage when asked. After a failure the
coordinator may ``commit_prepared`` and call ``join`` again with a new generation; the worker keeps
its parameters and optimizer state in memory.

Commit protocol (ARCHITECTURE.md, invariants: every step applied exactly once): a step's optimizer
update happens only after every worker of the generation has reduced and clipped its gradients and
said so in a world-wide vote. A worker whose vote failed keeps its prepared gradients; if any
survivor committed, the vote had every worker's consent, and the coordinator rolls the others
forward with ``commit_prepared``. In a purely data-parallel generation the vote rides in the
gradients' first bucket (raytrain.worker.vote): its completion proves that every worker finished its
backward and sent its share, not that every worker received the sum, so a worker whose reduction failed
after a peer's completed has no prepared update; the repair then copies a committed peer's state to it
(``sync_state``), and should every worker that committed be lost too, the run reloads its checkpoint.

Tensors only move through torch.distributed: activations and their gradients point-to-point
between neighbouring stages, gradients all-reduced in the stage's dp group (reduce-scattered in
its fsdp group first when sharded), state broadcast from a live peer to new members.

At each phase point (raytrain.config.faults.PHASES) the stage calls its ``hook`` (raytrain.worker.phases),
which does nothing unless ``elastic.faults`` armed it for this worker.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import resource
import time
from typing import Callable, Optional

import torch
from torch.distributed.tensor.parallel import loss_parallel

from raytrain.config import Config
from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.config.prepared import Slot, WorkerSpec
from raytrain.models.user_code import register_api_model
from raytrain.reports import BackgroundSave, EvalReport, JoinReport, ShardReport, StepReport
from raytrain.reports.oom import reraise_out_of_memory
from raytrain.optim.optimizer import apply_step, make_optimizer
from raytrain.worker.saving import ShardSaves
from raytrain.worker.compiling import compile_clock
from raytrain.worker.executor import ScheduleExecutor
from raytrain.worker.generation import Generation, form_generation
from raytrain.worker.gradsync import clip_global_norm
from raytrain.worker.groups import Groups, abort_groups, destroy_groups
from raytrain.worker.phases import PhaseHook, phase_hook
from raytrain.worker.stage_eval import HeldOutLoss
from raytrain.worker.stage_layers import Grads, stage_layers
from raytrain.worker.stage_samples import StageSamples
from raytrain.worker.stage_state import StageBuffers, StageState
from raytrain.worker.ties import TiedParameters
from raytrain.worker.vote import step_vote

HookFactory = Callable[[list[str], int, int, int], PhaseHook]
"""(fault specs, replica, stage, shard) -> the hook of the worker at that slot."""


class Stage:
    """The layers of one stage of one replica, and how to train them; see the module docstring."""

    def __init__(self, spec: WorkerSpec, slot: Slot, make_hook: HookFactory = phase_hook,
                 leaving: Callable[[], bool] = lambda: False):
        cfg, source, num_samples, chunks = spec.cfg, spec.source, spec.num_samples, spec.chunks(slot)
        stage, shard, tp = slot.stage, slot.shard, slot.tp
        if spec.model_code is not None:  # the Python API's model function: model.factory names it
            register_api_model(pickle.loads(spec.model_code))
        self.cfg = cfg
        self.leaving = leaving  # whether this worker was told to leave (raytrain.worker.drain): its vote says so,
        # unless the step holds it (its replacement is starting: raytrain.control.drain)
        torch.set_num_threads(cfg.resources.cpus_per_worker)
        self.device = torch.device("cuda", 0) if cfg.resources.use_gpu else torch.device("cpu")
        if cfg.resources.use_gpu:
            torch.cuda.set_device(self.device)
        self.stage, self.shard_index, self.tp_index = stage, shard, tp
        # replicated, this shard's rows (fsdp), or this tp rank's boxes (tp), wrapped per generation
        self.layers = stage_layers(cfg, chunks, shard, tp, self.device)
        self.params, self.loss_fn = self.layers.params, self.layers.loss_fn
        self.grads: Optional[Grads] = None  # this generation's gradient reduction (its join makes it) ...
        self.executor: Optional[ScheduleExecutor] = None  # ... and executor
        self.optimizer = make_optimizer(self.params, cfg.train)
        held = self.layers
        buffers = StageBuffers(held.buffer_names, held.buffers, writes=held.part in (None, 0))
        self.ties = TiedParameters(spec.ties, spec.stage_layers, stage, held.names)  # shared with other stages
        written = [w and t for w, t in zip(held.written or [True] * len(held.names), self.ties.written(len(held.names)))]
        self.state = StageState(self.ties.global_names(held.names), self.params, self.optimizer, self.device,
                                cfg.train.fused_optimizer, held.rows, held.slices, written, buffers)
        self.samples = StageSamples(cfg, source, num_samples, self.device)
        self.held_out = HeldOutLoss(cfg, source, num_samples, self.device)
        self.committed = 0  # steps applied so far; the next step to run
        self.prepared: Optional[int] = None  # a step whose gradients are reduced but not yet applied
        self.drain_boundary: Optional[int] = None  # a step not to run in this generation: a worker leaves before it
        self.gen: Optional[Generation] = None  # the generation this worker is a member of (None after leave)
        self.rank: Optional[int] = None  # its rank in the last generation it joined: reports after leave name it
        self.make_hook = make_hook
        self.hook = PhaseHook()  # called at every phase point; the last join's faults arm it
        self.saves = ShardSaves(self.state, stage, self.layers.part)
        self.joins = 0  # join attempts so far, successful or not
        self.aborted: set[int] = set()  # generations whose groups this worker aborted
        self.compile_clock = compile_clock(cfg.train)

    # --- membership ------------------------------------------------------------------------------

    def join(self, rank: int, mesh: Mesh, shares: list[int], store: StoreAddress, generation: int,
             faults: list[str]) -> JoinReport:
        """Leave the previous generation's groups (if any) and form ``generation``'s (collective)."""
        self.leave()
        self.joins += 1
        self.drain_boundary = None
        replica, stage = mesh.coords(rank)
        assert (stage, mesh.shard(rank), mesh.tp_index(rank)) == (self.stage, self.shard_index, self.tp_index), \
            f"worker of stage {self.stage} shard {self.shard_index} tp {self.tp_index} placed at {mesh.label(rank)}"
        self.rank, self.hook = rank, self.make_hook(faults, replica, stage, self.shard_index)
        if generation > 0:  # generation 0 is the start; a join fault names a repair's
            self.hook("join", self.committed)
        self.gen = form_generation(self.cfg, rank, mesh, shares, store, generation,
                                   lambda chunk, example: self.executor.output_of(chunk, example), self.device,
                                   self.samples.inputs, on_groups=lambda groups: self._on_groups(groups, mesh, rank),
                                   tie_workers=self.ties.worker_sets)
        self.samples.open_for(self.gen)
        return JoinReport(rank=rank, committed=self.committed, pid=os.getpid(), node=os.uname().nodename,
                          params=sum(p.numel() for p in self.params))

    def _on_groups(self, groups: Groups, mesh: Mesh, rank: int) -> None:
        """Wrap the layers on this generation's groups (a sharded or tensor-parallel stage re-wraps), and make
        the executor that runs them."""
        self.grads = self.layers.wrap(groups, mesh, rank, self.optimizer)
        self.executor = ScheduleExecutor(self.layers.module, self.layers.chunks, self.loss_fn, self.grads,
                                         self.device, _autocast(self.cfg, self.device), self.cfg.train.global_batch,
                                         loss_parallel if self.cfg.parallel.tp > 1 else contextlib.nullcontext)

    def leave(self) -> None:
        """Drop this worker's process groups (after a failure they may be broken); state stays. Every reference
        to the groups goes, so their connections close and peers blocked in a collective with this worker fail
        at once, not at the timeout. The layers keep the values and the prepared gradients (a vote that failed
        may still be rolled forward)."""
        self.gen = self.executor = self.grads = None  # a sharded or tp stage's gradient reducer holds the groups
        self.layers.release()
        destroy_groups()
        if self.joins:
            gc.collect()  # a full collection: worth it only once a join may have left groups behind

    def abort(self, generation: int) -> None:
        """A member of ``generation`` was lost (the coordinator says so through the heartbeat's thread): abort
        this worker's process groups of it, so that a collective blocked on the lost peer returns. Groups of
        a later generation are left alone."""
        gen = self.gen
        if gen is not None and gen.number <= generation and gen.number not in self.aborted:
            self.aborted.add(gen.number)
            abort_groups(gen.groups)

    def commit_prepared(self, step: int) -> int:
        """Roll forward: apply the prepared update of ``step`` (every worker voted for it)."""
        if self.prepared == step and self.committed == step:
            apply_step(self.optimizer, self.cfg.train, step)
            self.committed, self.prepared = step + 1, None
        return self.committed

    def sync_state(self, src_rank: int) -> int:
        """Broadcast parameters, optimizer state and step count from ``src_rank`` to this stage's dp group."""
        group = self.gen.groups.dp_group
        if group is None:
            return self.committed
        self.committed, self.prepared = self.state.broadcast(src_rank, group, self.committed), None
        return self.committed

    # --- one step ---------------------------------------------------------------------------------

    def run_step(self, step: int, trace: bool = False, hold: bool = False) -> StepReport:
        """Run ``step``; returns its metrics with ``ok``, and the background save once it has finished.
        ``hold``: a worker told to leave does not say so in this step's vote (the coordinator is starting
        its replacement, and picks the boundary where it goes)."""
        self.saves.writer.release()  # a background save's write runs beside this step
        report = self._run_step(step, trace, hold)
        report.saved = self.saves.writer.finished()
        report.compile_s = self.compile_clock.take()
        return report

    def _run_step(self, step: int, trace: bool, hold: bool) -> StepReport:
        """Run ``step``; returns its metrics with ``ok``. A failed collective returns ``ok=False``. A step
        sent ahead of one that failed here finds no groups, or the step before it uncommitted: it is skipped."""
        if self.gen is None or step != self.committed:
            assert self.gen is None or step == self.committed + 1, (step, self.committed)
            return StepReport(rank=self.rank, step=step, ok=False, committed=self.committed, prepared=self.prepared,
                              error="skipped: the step before it was not committed here")
        if step == self.drain_boundary:
            return StepReport(rank=self.rank, step=step, ok=False, committed=self.committed, drain_skipped=True,
                              error="skipped: a worker leaves the run before this step")
        report = StepReport(rank=self.rank, step=step, ok=False, committed=self.committed)
        step_gen = self.gen  # leave() drops it on a failure: the report still says whether it was aborted
        try:
            self.state.buffers.before_step(step)  # a step tried again starts from the statistics it started from
            leaving = lambda: self.leaving() and not hold  # noqa: E731 -- asked at the vote, however it is cast
            self._prepare(step, trace, report, leaving)
            self.prepared = step
            finite, report.drain_after = step_vote(self.grads, report, leaving, self.device)
            if not finite:
                self.prepared = None
                report.nonfinite, report.error = True, "a loss or gradient norm was not finite"
                return report
            if report.drain_after:
                self.drain_boundary = step + 1
            self.hook("optimizer", step)
            t0 = time.perf_counter()
            apply_step(self.optimizer, self.cfg.train, step)
            self.committed, self.prepared = step + 1, None
            report.wall_s += time.perf_counter() - t0
            report.ok = True
        except Exception as e:  # noqa: BLE001 -- a failed collective is reported; anything else raises
            report.error = self._step_failed(e)
            if report.error is None:
                raise  # here, not in _step_failed: its frame would hold the error in a cycle, and the groups with it
        report.committed, report.prepared = self.committed, self.prepared
        report.aborted = step_gen is not None and step_gen.number in self.aborted
        return report

    def _step_failed(self, error: Exception) -> Optional[str]:
        """A failed collective's report (a RuntimeError: a peer died or timed out), or None for any other error
        (the user's code or data: the caller raises it). Either way this worker leaves its groups first; one
        that ran out of memory leaves the run instead (raytrain.worker.actor)."""
        reraise_out_of_memory(error)
        if isinstance(error, RuntimeError):
            error.__traceback__ = None  # its frames hold the step's buffers, and through them the groups
        self.leave()  # peers blocked on us fail at once, not after elastic.detect_timeout_s; groups re-form on join
        return f"{type(error).__name__}: {str(error)[:300]}" if isinstance(error, RuntimeError) else None

    def skip_step(self, step: int) -> int:
        """Count ``step`` as done without applying it (its vote found a non-finite value)."""
        assert self.committed == step and self.prepared is None, (step, self.committed, self.prepared)
        self.grads.zero()
        self.committed = step + 1
        return self.committed

    def _prepare(self, step: int, trace: bool, report: StepReport, leaving: Callable[[], bool]) -> None:
        """Forward and backward every micro-batch by the schedule, all-reduce and clip: all but the update.
        Fills in ``report``'s timings and values. ``leaving``: this worker's say in the vote."""
        gen, cfg = self.gen, self.cfg
        t_start = time.perf_counter()
        ids, x, y = self.samples.of_step(step, gen, self.hook)
        report.data_s = time.perf_counter() - t_start
        self.grads.zero()
        if self.grads.carries_vote:
            self.grads.open_vote(leaving)
        self.layers.comm_log = [] if trace else None  # FSDP2's all-gathers and reduce-scatters go into the trace
        buf = self.executor.run(gen, step, x, y, self.hook, trace)
        t_sync = time.perf_counter()
        self.hook("allreduce", step)  # peers are all-reducing now
        self.grads.finish()
        self.state.buffers.average((gen.groups.dp_group, gen.groups.fsdp_group))  # the replicas' statistics agree
        self.ties.reduce(self.params, gen.groups)  # a parameter tied across stages: its copies' gradients summed
        t_reduced = time.perf_counter()
        grad_norm = clip_global_norm(self.grads, cfg.train.grad_clip, (gen.groups.fsdp_group, gen.groups.pp_group),
                                     gen.groups.tp_group, self.ties.counted_elsewhere(self.params))
        t_end = time.perf_counter()
        report.busy_s, report.wall_s, report.pipeline_s = buf.busy_s, t_end - t_start, t_sync - t_start
        report.peak_live, report.grad_norm, report.samples = buf.peak_live, grad_norm, len(ids)
        report.peak_mem_mb = peak_memory_mb(self.device)
        if gen.is_last and gen.tp_index == 0:  # the other tp ranks computed the same loss
            report.loss_sum = float(buf.loss_sum)
        if trace:
            report.events = step_events(buf.events, self.layers.comm_log, t_start, t_sync, t_reduced, t_end)
        if cfg.run.record_samples and gen.is_first and gen.tp_index == 0:
            report.sample_ids = ids

    def evaluate(self) -> EvalReport:
        """The held-out loss of the committed parameters (raytrain.worker.stage_eval): the last stage reports
        ``loss_sum`` over its ``rows``; a failed collective returns ``ok=False``, any other error raises."""
        report = EvalReport(rank=self.rank, step=self.committed, ok=False)
        if self.gen is None:
            report.error = "skipped: this worker is in no generation (its groups broke)"
            return report
        self.hook("eval", self.committed)
        try:
            return self.held_out.evaluate(self.executor, self.gen, self.committed, self.samples.dataset, report)
        except Exception as e:  # noqa: BLE001 -- a failed collective is reported; anything else raises
            report.error = self._step_failed(e)
            if report.error is None:
                raise
            return report

    # --- state ----------------------------------------------------------------------------------

    def save(self, ckpt_dir: str) -> ShardReport:
        """Write this stage's shard (its rows of it, when sharded) into ``ckpt_dir``; what the manifest
        records of it."""
        return self.saves.save(ckpt_dir, self.committed, self.hook)

    def start_save(self, ckpt_dir: str) -> float:
        """Snapshot this stage's shard and write it in the background; the seconds training stalled."""
        return self.saves.start(ckpt_dir, self.committed, self.hook)

    def finish_save(self) -> Optional[BackgroundSave]:
        """Wait for the background save in flight; its result (None if none was started)."""
        return self.saves.writer.wait()

    def load(self, ckpt_dir: str) -> None:
        """Take this stage's parameters and optimizer state from any layout's checkpoint."""
        self.committed, self.prepared = self.state.load(ckpt_dir), None

    def state_digest(self) -> str:
        """A hash of this stage's parameters, optimizer state and committed step: every replica of a
        stage holds the same state exactly when their digests are equal."""
        return self.state.digest(self.committed)

    def shutdown(self) -> None:
        self.saves.writer.wait()  # a shard being written is not cut off
        self.leave()


def _autocast(cfg: Config, device: torch.device):
    """The context each forward runs in: bf16 autocast with resources.bf16, else a no-op."""
    return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=cfg.resources.bf16)


def step_events(executed: list, comm_log: Optional[list], t_start: float, t_sync: float, t_reduced: float,
                t_end: float) -> list[tuple[str, float, float]]:
    """A traced step's events, relative to its start: the executor's actions, the wait for the reduction,
    the clip, and FSDP2's collectives."""
    events = executed + [("allreduce wait", t_sync, t_reduced), ("clip", t_reduced, t_end)] + (comm_log or [])
    return [(name, a - t_start, b - t_start) for name, a, b in events]


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory (GPU) or peak resident set (CPU) of this process so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
