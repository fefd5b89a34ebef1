"""The actor that owns a run, as a small state machine: starting, running, evaluating,
checkpointing, repairing, growing, stopping, finished (a failure raises out of ``run``).

It sends one small message per worker per step (``run_step(step)``) and gets metrics back; no tensor
passes through it. The next step's message is sent before the current step's replies arrive (when
no evaluation, checkpoint or membership change falls between them), so a worker goes from one step
to the next without waiting a round trip. The driver polls ``poll()`` for new metric rows while ``run()`` runs.

Who is in the run is one ``Membership``; what to do after a loss, while short of workers, when a
stage has no up-to-date copy or a step is not finite is an ``ElasticPolicy`` decision, recorded in
the event it causes. Every membership change (a loss during a step, a save or a re-forming, a
replica that joins) goes through REPAIRING or GROWING, so each is counted and reported one way.

Repair (DESIGN invariants 3 and 4): survivors are not restarted. They agree on the last committed
step (rolling forward a step that every worker voted for), broken replicas are dropped (their live
workers wait as spares), the groups re-form among the remaining replicas under a new generation,
and the global batch is divided among them. A replacement starts on the lost worker's bundle and
joins at a step boundary, taking its stage's state by broadcast from a live peer. Only when some
stage has no up-to-date worker left does the run reload its last checkpoint, and it says so.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

import ray

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.control import steps
from raytrain.control.evaluation import Evaluation
from raytrain.control.membership import Member, Membership
from raytrain.control.policy import Action, Decision, ElasticPolicy
from raytrain.control.repair import Repairs
from raytrain.control.runstate import Progress, RunState
from raytrain.control.steps import NonFiniteStep, StepLost, may_send_ahead
from raytrain.control.workergroup import SETUP_TIMEOUT_S, RayWorkerGroup, StepFailed, WorkersLost, spawn_in_granted
from raytrain.data import even_shares

__all__ = ["CapacityLost", "Coordinator", "NonFiniteLoss", "StepFailed", "may_send_ahead"]

GRANT_AT_START_S = 1.0
"""How long the start waits for replicas beyond parallel.dp before starting without them."""

SETTLE_MARGIN_S = 5.0
"""Beyond elastic.detect_timeout_s, how long after a failed reply the rest of a step's replies may take:
every live peer's collective has failed by then, so a worker still silent is hung and is killed."""



class NonFiniteLoss(StepFailed):
    """A step's loss or gradient norm was not finite (and train.skip_nonfinite was used up)."""


class CapacityLost(RuntimeError):
    """The run could not go on with the workers it has: fewer than elastic.min_dp replicas within
    elastic.capacity_wait_s, more losses than elastic.max_failures, or a stage lost with no checkpoint."""


class Coordinator:
    """Owns one run. Contract: construct (it starts the workers at once), then ``run(store)`` once;
    the driver calls ``poll`` meanwhile, ``request_stop`` on a signal and ``shutdown`` at the end.
    ``worker_cls``: the workers' actor class (the driver's: control/ imports no worker code);
    ``group`` replaces the Ray worker group (tests/helpers.FakeWorkerGroup)."""

    def __init__(self, config: Config, data_path: str, num_samples: int, stage_layers: list[list[int]],
                 placement, first_bundle: int, resume_from: Optional[str], worker_cls=None,
                 extra_placements: tuple = (), corpus: Optional[list] = None, group=None):
        self.cfg, self.num_samples, self.stage_layers = config, num_samples, stage_layers
        self.placement, self.first_bundle, self.resume_from = placement, first_bundle, resume_from
        assert group is not None or worker_cls is not None, "the Ray worker group needs the worker class"
        self.group = group or RayWorkerGroup(worker_cls, _worker_options(self.cfg), lambda s, f: (
            config, data_path, num_samples, s, stage_layers[s], corpus, f))
        e = self.cfg.elastic
        self.policy = ElasticPolicy(min_dp=e.min_dp or self.cfg.parallel.dp, target_dp=e.max_dp or self.cfg.parallel.dp,
                                    max_failures=e.max_failures, wait_s=e.capacity_wait_s,
                                    skip_nonfinite=self.cfg.train.skip_nonfinite)
        self.team = Membership(self.cfg.parallel.pp, fsdp=self.cfg.parallel.fsdp)
        # One placement group per replica beyond parallel.dp (the driver requested and removes them).
        self.unused_placements = [(pg, pg.ready()) for pg in extra_placements]
        self.store: Optional[StoreAddress] = None  # given to run(): hosted by the driver, which outlives us all
        self.state, self.progress, self.generation = RunState.STARTING, Progress(), -1
        self.faults = list(e.faults)
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._stop_reason: Optional[str] = None
        self._label: Optional[str] = None  # the live grid's label, set by form_generation
        self.last_checkpoint: Optional[str] = resume_from
        self.first_step, self.failures, self.committed_steps = 0, 0, []
        self.recovery_s, self.skipped_steps, self.original_pids = [], [], []
        self.repairs = Repairs(self)  # the states that change membership: repairing, growing
        self.evaluation = Evaluation(self)  # the held-out loss between two steps (eval.every)
        self.team.pending = self._spawn_first_workers()  # they start while the driver finishes its own set-up

    # --- driver-facing ----------------------------------------------------------------------------

    @ray.method(enable_task_events=False)  # the driver calls it every second
    def poll(self) -> list[dict]:
        """Metric rows produced since the last poll."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    @ray.method(enable_task_events=False)
    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary, after a checkpoint (a signal reached the driver)."""
        self._stop_reason = reason

    @property
    def stopping(self) -> bool:
        """A stop was requested: the run ends at the next step boundary, after a checkpoint."""
        return self._stop_reason is not None

    def run(self, store: StoreAddress) -> dict:
        """Train to ``train.steps`` (or, after ``request_stop``, to the next step boundary), forming
        groups at ``store``; returns the summary. Raises on an unrecoverable failure."""
        self.store = store
        handlers = {RunState.STARTING: self._starting, RunState.RUNNING: self._running,
                    RunState.CHECKPOINTING: self._checkpointing, RunState.REPAIRING: self.repairs.repairing,
                    RunState.GROWING: self.repairs.growing, RunState.STOPPING: self._stopping,
                    RunState.EVALUATING: self.evaluation.evaluating}
        try:
            while self.state is not RunState.FINISHED:
                self.state = handlers[self.state]()
        except BaseException:
            self.state = RunState.FAILED
            raise
        return {"steps": self.progress.step, "checkpoint": self.last_checkpoint, "stopped": self._stop_reason,
                "digests": state_digests(self.group, self.team) if self.cfg.run.record_samples else {},
                "worker_pids": self.original_pids, "final_pids": self.team.pids(),
                "committed_steps": self.committed_steps, "failures": self.failures, "recovery_s": self.recovery_s,
                "skipped_steps": self.skipped_steps}

    def layout(self) -> str:
        """The live grid's label (dp changes with repairs and growth), kept from the last re-forming."""
        return self._label or self.team.mesh().grid_label

    def shutdown(self) -> None:
        for m in self.team.everyone():
            self.group.kill(m)
        self.team = Membership(self.team.pp, fsdp=self.team.fsdp)

    def emit(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    # --- starting ---------------------------------------------------------------------------------

    def _spawn_first_workers(self) -> list[Member]:
        slots = self.team.slots
        members = [self.group.spawn(s, self.placement, self.first_bundle + r * len(slots) + i, shard=f)
                   for r in range(self.cfg.parallel.dp) for i, (f, s) in enumerate(slots)]
        # Replicas beyond parallel.dp that the cluster can hold now start with the rest.
        return members + spawn_in_granted(self.group, self.unused_placements, slots, timeout=GRANT_AT_START_S)

    def _starting(self) -> RunState:
        members, size = self.team.pending, len(self.team.slots)
        for m in members:
            m.pid = self.group.pid(m, SETUP_TIMEOUT_S)
            if m.pid is None:
                raise WorkersLost([m])  # lost while starting: the driver restarts the coordinator
        self.team.pending, self.original_pids = [], [m.pid for m in members]
        self.team.replicas = [members[r * size:(r + 1) * size] for r in range(len(members) // size)]
        step = 0
        if self.resume_from is not None:
            self.group.call([(m, "load", (self.resume_from,)) for m in members], SETUP_TIMEOUT_S)
            step = checkpoint.read_manifest(self.resume_from)["step"]
            self.team.set_committed(step)
            self.emit({"event": "resumed", "from": self.resume_from, "step": step})
        self.progress.step = self.first_step = step
        self.form_generation(step)
        self.emit({"event": "started", "layout": self.cfg.layout().label, "replicas": self.team.dp,
                   "generation": self.generation, "pids": self.original_pids, "coordinator_pid": os.getpid()})
        return RunState.RUNNING

    def form_generation(self, step: int) -> None:
        """Re-form the process groups over the replicas and bring every member to ``step``."""
        self.generation += 1
        mesh = self.team.mesh()
        self._label = mesh.grid_label
        shares = even_shares(self.cfg.train.global_batch, mesh.dp)
        ranked = self.team.ranked()
        self.group.call([(m, "join", (rank, mesh, shares, self.store, self.generation, self.faults))
                         for rank, m in ranked], SETUP_TIMEOUT_S)
        if any(m.committed != step for _, m in ranked):
            sources = self.team.sources(step)
            assert len(sources) == len(self.team.slots), "a slot without an up-to-date member must reload a checkpoint first"
            self.group.call([(m, "sync_state", (sources[m.slot],)) for _, m in ranked], SETUP_TIMEOUT_S)
            self.team.set_committed(step)

    # --- running ----------------------------------------------------------------------------------

    def _running(self) -> RunState:
        p = self.progress
        if p.step >= self.cfg.train.steps:
            return RunState.FINISHED
        if p.call is None:
            if self._stop_reason is not None:
                return RunState.STOPPING
            if self.repairs.growth_ready():
                return RunState.GROWING
            p.call = self._send(p.step, time.perf_counter())
        ahead = self._send(p.step + 1, None) if self._may_send_ahead(p.step + 1) else None
        try:
            reports = steps.collect(self.group, p.call, self.cfg.resources.step_timeout_s, self.layout(),
                                    settle_s=self.cfg.elastic.detect_timeout_s + SETTLE_MARGIN_S)
        except StepLost as lost:
            p.lost = lost.dead + [m for m in self._drain(ahead) if m not in lost.dead]
            p.reports, p.during, p.call = lost.reports, "step", None
            return RunState.REPAIRING
        except NonFiniteStep as bad:
            self._drain(ahead)
            p.call = None
            return self._skip_nonfinite(bad)
        p.row = steps.aggregate_step(p.step, reports, time.perf_counter() - p.call.started, self.cfg,
                                     self.team.mesh(), self.layout())
        self.committed_steps.append(p.step)
        p.step += 1
        if ahead is not None:
            ahead.started = time.perf_counter()
        p.call = ahead
        return self.after_commit()

    def after_commit(self, evaluated: bool = False) -> RunState:
        """A step was committed (run, rolled forward or skipped): evaluate it, then checkpoint it, if due."""
        if not evaluated and self.evaluation.due(self.progress.step):
            return RunState.EVALUATING
        if steps.checkpoint_due(self.progress.step, self.cfg.train.steps, self.cfg.checkpoint.every):
            return RunState.CHECKPOINTING
        self.flush_row(None)
        return RunState.RUNNING

    def flush_row(self, checkpoint_path: Optional[str]) -> None:
        if self.progress.row is not None:
            self.progress.row["checkpoint"] = checkpoint_path
            self.emit(self.progress.row)
            self.progress.row = None

    def _send(self, step: int, started: Optional[float]) -> steps.StepCall:
        trace = step - self.first_step < self.cfg.run.trace_steps  # a resumed run traces its own first steps
        return steps.send(self.group, self.team.members(), step, trace, started)

    def _may_send_ahead(self, step: int) -> bool:
        changing = bool(self.unused_placements or self.team.pending or self.team.spares)
        stopping = self._stop_reason is not None
        return may_send_ahead(step, self.cfg.train.steps, self.cfg.checkpoint.every, changing or stopping,
                              self.cfg.eval.every)

    def _drain(self, call: Optional[steps.StepCall]) -> list[Member]:
        return steps.drain(self.group, call, self.cfg.elastic.detect_timeout_s + 5)

    def _skip_nonfinite(self, bad: NonFiniteStep) -> RunState:
        """Skip a step whose vote found a non-finite value (nothing of it was applied anywhere), or
        stop when train.skip_nonfinite steps were skipped already."""
        step, norm = bad.step, bad.results[0].get("grad_norm")
        loss = steps.loss_of(bad.results, self.cfg, self.team.mesh().columns)
        decision = self.policy.nonfinite(len(self.skipped_steps))
        if decision.action is Action.GIVE_UP:
            self.give_up(decision, lambda last: nonfinite_loss(step, loss, norm, decision, last))
        members = self.team.members()
        for m, committed in zip(members, self.group.call([(m, "skip_step", (step,)) for m in members], SETUP_TIMEOUT_S)):
            m.committed = committed
        self.skipped_steps.append(step)
        self.committed_steps.append(step)
        self.progress.row = steps.skipped_row(step, loss, norm, self.cfg, self.num_samples, self.layout(),
                                              dp=self.team.dp)
        self.progress.step = step + 1
        self.emit({"event": "skipped_step", "step": step + 1, "loss": loss, "grad_norm": norm,
                   "skipped_so_far": len(self.skipped_steps), **decision.record()})
        return self.after_commit()

    # --- checkpointing and stopping -------------------------------------------------------------

    def _checkpointing(self) -> RunState:
        """Save every stage's shard (each fsdp shard's rows by its own worker) into a new directory and
        publish the manifest; a worker lost while saving is repaired, the save retried (REPAIRING comes back here)."""
        step, t0 = self.progress.step, time.perf_counter()
        try:
            ckpt_dir = save_checkpoint(self.group, self.team.replicas[0], step, self.cfg, self.team.mesh(),
                                       self.stage_layers)
        except WorkersLost as lost:
            self.progress.lost, self.progress.reports, self.progress.during = lost.dead, [], "checkpoint"
            return RunState.REPAIRING
        self.last_checkpoint = ckpt_dir
        self.emit({"event": "checkpoint", "step": step, "path": ckpt_dir, "seconds": round(time.perf_counter() - t0, 3)})
        self.flush_row(ckpt_dir)
        return RunState.RUNNING

    def checkpointed(self, step: int) -> bool:
        return self.last_checkpoint is not None and checkpoint.read_manifest(self.last_checkpoint)["step"] == step

    def _stopping(self) -> RunState:
        """At a step boundary after a stop request: checkpoint this step (if not yet), then finish."""
        if not self.checkpointed(self.progress.step):
            return RunState.CHECKPOINTING
        self.emit({"event": "stopped", "step": self.progress.step, "reason": self._stop_reason,
                   "checkpoint": self.last_checkpoint})
        return RunState.FINISHED

    def give_up(self, decision: Decision, error: Optional[Callable[[Optional[str]], Exception]] = None) -> None:
        """End the run with CapacityLost (or ``error(last checkpoint)``), after saving the survivors'
        state when no checkpoint has it."""
        self.flush_row(None)  # a committed step's held row is kept however the run ends
        saved, event = save_survivors(self.group, self.team, self.progress, self.last_checkpoint, self.cfg,
                                      self.stage_layers)
        if event is not None:
            self.emit(event)
        self.last_checkpoint = saved or self.last_checkpoint
        raise error(self.last_checkpoint) if error else capacity_lost(decision, self.last_checkpoint, saved is not None)


def capacity_lost(decision: Decision, last_checkpoint: Optional[str], saved: bool = False) -> CapacityLost:
    """The error that ends a run the policy gave up on: its reason, its key, and what is kept."""
    if saved:
        kept = f"the survivors saved every committed step to {last_checkpoint}: resume from it"
    elif last_checkpoint:
        kept = f"the last checkpoint ({last_checkpoint}) is intact"
    else:
        kept = "no checkpoint was written yet (checkpoint.every keeps some)"
    return CapacityLost(f"{decision.reason} (config: {decision.config_key}); {kept}")


def save_survivors(group, team: Membership, progress: Progress, last_checkpoint: Optional[str], cfg: Config,
                   stage_layers: list[list[int]]) -> tuple[Optional[str], Optional[dict]]:
    """Save the committed step from live workers (not in ``progress.lost``) that hold every slot's state
    at it, as a run that gives up does, so that its steps since ``last_checkpoint`` are not lost (saving
    needs no collective). Returns the published directory (None when not saved) and the event to record
    (None when the last checkpoint already has the step)."""
    step = progress.step
    try:
        saved_step = checkpoint.read_manifest(last_checkpoint)["step"] if last_checkpoint else 0
    except checkpoint.CheckpointError:
        saved_step = -1  # unreadable now: save anew
    if step <= saved_step:
        return None, None
    holders = team.holders(step, excluding=progress.lost)
    try:
        if holders is None:
            raise WorkersLost([])
        saved = save_checkpoint(group, holders, step, cfg, team.mesh().with_dp(1), stage_layers)
    except WorkersLost:
        return None, {"event": "not_saved", "step": step,
                      "reason": "no live worker holds some slot's state at this step (or one was lost saving)"}
    return saved, {"event": "checkpoint", "step": step, "path": saved,
                   "reason": "saved from the survivors before giving up"}


def nonfinite_loss(step: int, loss, norm, decision: Decision, last_checkpoint: Optional[str]) -> NonFiniteLoss:
    """The error that ends a run at a non-finite step: what was not finite, and where to resume."""
    last = (f"the last good checkpoint is {last_checkpoint}: resume from it"
            if last_checkpoint else "there is no checkpoint yet (checkpoint.every keeps some): start again")
    return NonFiniteLoss(f"step {step + 1}: the loss ({loss}) or the gradient norm ({norm}) is not finite, so the "
                         f"step was applied on no worker; {decision.reason}; {last} with a lower train.lr or "
                         "train.grad_clip, or set train.skip_nonfinite to skip such steps")


def save_checkpoint(group, savers: list[Member], step: int, cfg: Config, mesh: Mesh,
                    stage_layers: list[list[int]]) -> str:
    """Have ``savers`` (one member per slot, in slot order) write their shards into a new directory under
    checkpoint.dir, publish its manifest and prune; returns the directory. WorkersLost if a saver died."""
    ckpt_dir = checkpoint.new_step_dir(cfg.checkpoint.dir, step)
    shards = group.call([(m, "save", (ckpt_dir,)) for m in savers], SETUP_TIMEOUT_S)
    checkpoint.publish(ckpt_dir, manifest(step, shards, cfg, mesh, stage_layers))
    checkpoint.prune(cfg.checkpoint.dir, cfg.checkpoint.keep)
    return ckpt_dir


def manifest(step: int, shards: list[dict], cfg: Config, mesh: Mesh, stage_layers: list[list[int]]) -> dict:
    """A checkpoint's manifest: its step, the layout it was saved from, its shards and the run's config."""
    return {
        "step": step, "samples_seen": step * cfg.train.global_batch,
        "finite": all(s["finite"] for s in shards),
        "layout": {"dp": mesh.dp, "fsdp": mesh.fsdp, "pp": mesh.pp, "stage_layers": stage_layers},
        "shards": shards, "config": cfg.to_dict(),
    }


SHARDED_CPU_MALLOC = "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"
"""glibc settings of a sharded worker on CPU. FSDP allocates and frees a layer's unsharded parameters
and gradients (tens of MB each) per layer and micro-batch; glibc would serve them from its heap and
keep the freed memory, so the worker's resident set would grow back to a replica's size. Above 1 MiB
they are mapped and returned on free instead, on huge pages where the kernel allows (fewer faults)."""


def _worker_options(cfg: Config) -> dict:
    options = {"num_cpus": cfg.resources.cpus_per_worker, "num_gpus": 1 if cfg.resources.use_gpu else 0}
    if cfg.parallel.fsdp > 1 and not cfg.resources.use_gpu:
        options["runtime_env"] = {"env_vars": {"GLIBC_TUNABLES": SHARDED_CPU_MALLOC}}
    return options


def state_digests(group, team: Membership) -> dict[str, str]:
    """``"replica:stage"`` (``"replica:shard:stage"`` when sharded) ``-> digest`` of every member's
    parameters and optimizer state (audits: the replicas of a slot must be identical, however many
    workers were lost on the way)."""
    ranked = team.ranked()
    digests = group.call([(m, "state_digest", ()) for _, m in ranked], SETUP_TIMEOUT_S)
    mesh = team.mesh()
    return {mesh.label(rank): d for (rank, _), d in zip(ranked, digests)}
