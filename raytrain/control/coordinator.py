"""The actor that owns a run, as a small state machine: starting, running, evaluating,
checkpointing, repairing, draining, growing, stopping, finished (a failure raises out of ``run``).

It sends one small message per worker per step (``run_step(step)``) and gets metrics back; no tensor
passes through it. The next step's message is sent before the current step's replies arrive (when
no evaluation, checkpoint or membership change falls between them), so a worker goes from one step
to the next without waiting a round trip. The driver polls ``poll()`` for new metric rows while ``run()`` runs.

The states are values (raytrain.control.runstate: ``Repairing(lost, interrupted, reports)``, ...);
each handler takes its state and returns the next. Who is in the run, and every change to it, is
the ``Crew``; what the run committed is the ``Ledger``; what to do after a loss, while short of
workers, when a stage has no up-to-date copy or a step is not finite is an ``ElasticPolicy``
decision, recorded in the event it causes. Every membership change (a loss during a step, a save or a re-forming, a
replica that joins, a worker told to leave) goes through REPAIRING, GROWING or DRAINING, so each is
counted and reported one way.

Repair (ARCHITECTURE.md, invariants: resizes do not change the math; every step exactly once):
survivors are not restarted. They agree on the last committed step (rolling forward a step that
every worker voted for), broken replicas are dropped (their live workers wait as spares), the groups
re-form among the remaining replicas under a new generation, and the global batch is divided among
them. A replacement starts on the lost worker's bundle and joins at a step boundary, taking its
stage's state by broadcast from a live peer. Only when some stage has no up-to-date worker left does
the run reload its last checkpoint, and it says so."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import ray

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.layout import Layout
from raytrain.config.mesh import StoreAddress
from raytrain.config.prepared import PreparedRun, WorkerSpec
from raytrain.control import steps
from raytrain.control.crew import Crew, Reservation
from raytrain.control.drain import Drains
from raytrain.control.evaluation import evaluating
from raytrain.control.ledger import Ledger
from raytrain.control.liveness import Heartbeats
from raytrain.control.membership import Member, Membership
from raytrain.control.policy import Action, Decision, ElasticPolicy
from raytrain.control.protocol import StepFailed, WorkerGroup, WorkersLost
from raytrain.control.repair import GiveUp, Repairs
from raytrain.control.runstate import (Checkpointing, Draining, Evaluating, Failed, Finished, Growing,
                                       Interrupted, Repairing, Running, Starting, State, Stopping)
from raytrain.control.saving import Checkpoints
from raytrain.control.steps import DrainBoundary, NonFiniteStep, StepCall, StepLost, may_send_ahead
from raytrain.control.workergroup import Hung, RayWorkerGroup, replacement_prefix
from raytrain.reports import RunSummary
from raytrain.reports.oom import FIT_ADVICE

__all__ = ["CapacityLost", "Coordinator", "NonFiniteLoss", "OutOfMemoryLost", "StepFailed", "may_send_ahead"]

SETTLE_MARGIN_S = 5.0
"""Beyond elastic.detect_timeout_s, how long after a failed reply the rest of a step's replies may take:
every live peer's collective has failed by then, so a worker still silent is hung and is killed."""


class NonFiniteLoss(StepFailed):
    """A step's loss or gradient norm was not finite (and train.skip_nonfinite was used up)."""


class CapacityLost(RuntimeError):
    """The run could not go on with the workers it has: fewer than elastic.min_dp replicas within
    elastic.capacity_wait_s, more losses than elastic.max_failures, or a stage lost with no checkpoint."""


class OutOfMemoryLost(CapacityLost):
    """The run could not go on after a worker ran out of memory: its one line says which worker, doing
    what, and what to change (the CLI prints ``out of memory: ...`` and exits 4, as for CapacityLost)."""


class Coordinator:
    """Owns one run. Contract: construct (it starts the workers at once), then ``run(store)`` once;
    the driver calls ``poll`` meanwhile, ``request_stop`` on a signal and ``shutdown`` at the end.
    ``prepared``: the run (raytrain.config.prepared); ``reservation``: where its workers start;
    ``worker_cls``: the workers' actor class (the driver's: control/ imports no worker code);
    ``worker_group`` replaces the Ray worker group (tests/helpers.FakeWorkerGroup)."""

    def __init__(self, prepared: PreparedRun, reservation: Reservation, worker_cls=None,
                 worker_group: Optional[WorkerGroup] = None):
        config, e = prepared.cfg, prepared.cfg.elastic
        self.cfg = config
        self.num_samples = prepared.num_samples
        self.resume_from = prepared.resume
        assert worker_group is not None or worker_cls is not None, "the Ray worker group needs the worker class"
        self.heartbeats = Heartbeats()  # every worker's, through ``beat``
        worker_group = worker_group or RayWorkerGroup(worker_cls, _worker_options(config), _worker_spec(prepared),
                                                      replacement_prefix(config),
                                                      Hung(self.heartbeats, e.detect_timeout_s))
        self.policy = ElasticPolicy(min_dp=e.min_dp or config.parallel.dp, target_dp=e.max_dp or config.parallel.dp,
                                    max_failures=e.max_failures, capacity_wait_s=e.capacity_wait_s,
                                    skip_nonfinite=config.train.skip_nonfinite)
        self.crew = Crew(worker_group, Layout.of(config.parallel), config.train.global_batch, e.faults, reservation.growth)
        self.ledger = Ledger(last_checkpoint=prepared.resume)
        self.drains = Drains(self.crew, self.ledger, config, lambda: self.stopping)
        """Workers told to leave (a SIGTERM): they go at a step boundary, once their replacements are up."""
        self.step_s = 0.0  # how long the last committed step took
        self.repairs = Repairs(self.crew, self.ledger, self.policy, config, prepared.num_samples,
                               lambda: self.stopping, self.drains, self.request_stop)
        self.state: State = Starting()
        self.in_flight: Optional[StepCall] = None  # the step sent to the workers and not yet collected
        self.checkpoints = Checkpoints(worker_group, self.ledger, config, prepared.stage_layers, prepared.data_identity)
        self.original_pids: list[int] = []
        self._stop_reason: Optional[str] = None
        self.crew.spawn_first(reservation)  # they start while the driver finishes

    # --- driver-facing ----------------------------------------------------------------------------

    @ray.method(enable_task_events=False)  # the driver calls it every second
    def poll(self) -> list[dict]:
        """Metric rows produced since the last poll."""
        return self.ledger.take_rows()

    @ray.method(enable_task_events=False)  # every worker calls it every second
    def beat(self, beat_id: int, leaving: Optional[str] = None) -> Optional[int]:
        """A worker's proof that it is alive (raytrain.control.liveness), from a thread of its own, and why it was
        told to leave if it was; the answer is the newest generation whose groups its survivors must abort."""
        return self.heartbeats.beat(beat_id, leaving)

    @ray.method(enable_task_events=False)
    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary, after a checkpoint (a signal reached the driver)."""
        self._stop_reason = reason

    @property
    def stopping(self) -> bool:
        """A stop was requested: the run ends at the next step boundary, after a checkpoint."""
        return self._stop_reason is not None

    @property
    def membership(self) -> Membership:
        """Who is in the run: the current generation's replicas, the spares and the workers starting."""
        return self.crew.membership

    def run(self, store: StoreAddress) -> RunSummary:
        """Train to ``train.steps`` (or, after ``request_stop``, to the next step boundary), forming
        groups at ``store``; returns the summary. Raises on an unrecoverable failure."""
        self.crew.store = store
        self.ledger.time.start()
        try:
            while not isinstance(self.state, Finished):
                state, t0 = self.state, time.perf_counter()
                try:
                    self.state = self._handle(state)
                except GiveUp as given_up:
                    self.give_up(given_up.decision, given_up.lost)
                finally:
                    self.ledger.time.handled(state.kind.value, time.perf_counter() - t0)
        except BaseException:
            self.state = Failed()
            raise
        ledger = self.ledger
        return RunSummary(steps=ledger.step, checkpoint=ledger.last_checkpoint, stopped=self._stop_reason,
                          digests=self.crew.digests() if self.cfg.run.record_samples else {},
                          worker_pids=self.original_pids, final_pids=self.membership.pids(),
                          committed_steps=ledger.committed_steps, failures=ledger.failures,
                          recovery_s=ledger.recovery_s, skipped_steps=ledger.skipped_steps,
                          time_book=ledger.time.record())

    def _handle(self, state: State) -> State:
        if isinstance(state, Starting):
            return self._starting()
        if isinstance(state, Running):
            return self._running()
        if isinstance(state, Evaluating):
            return evaluating(self.crew, self.ledger, self.cfg)
        if isinstance(state, Checkpointing):
            return self._checkpointing()
        if isinstance(state, Repairing):
            self.checkpoints.settle(state.lost)
            return self.repairs.repairing(state)
        if isinstance(state, Draining):
            return self.repairs.draining(state)
        if isinstance(state, Growing):
            return self.repairs.growing(state)
        assert isinstance(state, Stopping), state
        return self._stopping()

    def layout(self) -> str:
        """The live grid's label (dp changes with repairs and growth)."""
        return self.crew.label()

    def shutdown(self) -> None:
        self.crew.shutdown()

    # --- starting ---------------------------------------------------------------------------------

    def _starting(self) -> State:
        self.original_pids = self.crew.start(self.policy.target_dp)
        step = 0
        if self.resume_from is not None:
            step = checkpoint.read_manifest(self.resume_from)["step"]
            self.crew.load(self.resume_from, step)
            self.ledger.emit({"event": "resumed", "from": self.resume_from, "step": step})
        self.ledger.step = self.ledger.first_step = step
        self.crew.form_generation(step)
        self.ledger.emit(started_event(self.cfg, self.crew, self.original_pids))
        if self.crew.standby_started() < self.cfg.elastic.standby:
            self.ledger.emit(standby_waiting(self.cfg.elastic.standby, self.crew.standby_started()))
        return Running()

    # --- running ----------------------------------------------------------------------------------

    def _running(self) -> State:
        ledger = self.ledger
        if ledger.step >= self.cfg.train.steps:
            return Finished()
        if self.heartbeats.leaving:
            self.drains.let_standbys_go(self.heartbeats.told_to_leave())
        if self.in_flight is None:
            if self.stopping:
                return Stopping()
            if self.drains.leaving_at_next_boundary(self.step_s):
                return self.drains.state()
            growth = self.repairs.growth()
            if growth.action is Action.GROW:
                return Growing(growth)
            self.in_flight = self._send(ledger.step, time.perf_counter())
        call = self.in_flight
        ahead = self._send(ledger.step + 1, None) if self._may_send_ahead(ledger.step + 1) else None
        try:
            reports = steps.collect(self.crew.worker_group, call, self.cfg.resources.step_timeout_s, self.layout(),
                                    settle_s=self.cfg.elastic.detect_timeout_s + SETTLE_MARGIN_S)
        except StepLost as lost:
            self.in_flight = None
            ledger.time.lost_step(time.perf_counter() - call.started)
            dead = lost.dead + [m for m in self._wait_out(ahead) if m not in lost.dead]
            return Repairing(tuple(dead), Interrupted.STEP, tuple(lost.reports))
        except DrainBoundary:  # sent ahead of the step whose vote found a worker told to leave: none ran it
            self.in_flight = None
            ledger.time.charge("re_forming", time.perf_counter() - call.started)
            return self.drains.state()
        except NonFiniteStep as bad:
            self.in_flight = None
            ledger.time.charge("work_redone", time.perf_counter() - call.started)  # computed, not applied
            self._wait_out(ahead)
            return self._skip_nonfinite(bad)
        self.step_s = time.perf_counter() - call.started
        row = steps.aggregate_step(ledger.step, reports, self.step_s, self.cfg, self.membership.mesh(), self.layout())
        ledger.commit(ledger.step, row)
        drained = self.drains.event_after_commit()
        if drained is not None:
            ledger.emit(drained.record())
        self.drains.note_notices(reports, call.hold)
        self.checkpoints.publish_if_written()
        if ahead is not None:
            ahead.started = time.perf_counter()
        self.in_flight = ahead
        return steps.after_commit(ledger, self.cfg)

    def _send(self, step: int, started: Optional[float]) -> StepCall:
        trace = step - self.ledger.first_step < self.cfg.run.trace_steps  # a resumed run traces its own first steps
        return steps.send(self.crew.worker_group, self.membership.members(), step, trace, started,
                          self.drains.holds_notices())

    def _may_send_ahead(self, step: int) -> bool:
        return may_send_ahead(step, self.cfg.train.steps, self.cfg.checkpoint.every,
                              self.crew.changing(self.policy.target_dp) or self.stopping
                              or self.drains.leaving_at_next_boundary(self.step_s),
                              self.cfg.eval.every)

    def _wait_out(self, call: Optional[StepCall]) -> list[Member]:
        return steps.wait_out(self.crew.worker_group, call, self.cfg.elastic.detect_timeout_s + SETTLE_MARGIN_S)

    def _skip_nonfinite(self, bad: NonFiniteStep) -> State:
        """Skip a step whose vote found a non-finite value (nothing of it was applied anywhere), or
        stop when train.skip_nonfinite steps were skipped already."""
        step, norm = bad.step, bad.results[0].grad_norm
        loss = steps.loss_of(bad.results, self.cfg, self.membership.mesh().columns)
        decision = self.policy.nonfinite(len(self.ledger.skipped_steps))
        if decision.action is Action.GIVE_UP:
            self.give_up(decision, error=lambda last: nonfinite_loss(step, loss, norm, decision, last))
        self.crew.skip(step)
        row = steps.skipped_row(step, loss, norm, self.cfg, self.num_samples, self.layout(), dp=self.membership.dp)
        self.ledger.commit(step, row, skipped=True)
        self.ledger.emit({"event": "skipped_step", "step": step + 1, "loss": loss, "grad_norm": norm,
                          "skipped_so_far": len(self.ledger.skipped_steps), **decision.record()})
        return steps.after_commit(self.ledger, self.cfg)

    # --- evaluating, checkpointing and stopping -----------------------------------------------------

    def _checkpointing(self) -> State:
        """Save every stage's shard (each fsdp shard's rows by its own worker) into a new directory and
        publish the manifest; a worker lost while saving is repaired, the save retried (REPAIRING comes back here).
        With checkpoint.async_save the savers snapshot their shards and training goes on while they write
        (the run's last save, and one before a stop, are written before the run goes on)."""
        step = self.ledger.step
        background = self.cfg.checkpoint.async_save and step < self.cfg.train.steps and not self.stopping
        savers = self.membership.replicas[0]
        try:
            if background:
                self.checkpoints.start(savers, step, self.membership.mesh())
                self.ledger.flush_row(None)  # the checkpoint event says when it is published
                return Running()
            ckpt_dir = self.checkpoints.save(savers, step, self.membership.mesh())
        except WorkersLost as lost:
            return Repairing(tuple(lost.dead), Interrupted.CHECKPOINT)
        self.ledger.flush_row(ckpt_dir)
        return Running()

    def _stopping(self) -> State:
        """At a step boundary after a stop request: checkpoint this step (if not yet), then finish."""
        try:
            self.checkpoints.wait()
        except WorkersLost as lost:
            return Repairing(tuple(lost.dead), Interrupted.CHECKPOINT)
        if not self.ledger.checkpointed(self.ledger.step):
            return Checkpointing()
        self.ledger.emit({"event": "stopped", "step": self.ledger.step, "reason": self._stop_reason,
                          "checkpoint": self.ledger.last_checkpoint})
        return Finished()

    def give_up(self, decision: Decision, lost: tuple[Member, ...] = (),
                error: Optional[Callable[[Optional[str]], Exception]] = None) -> None:
        """End the run with CapacityLost (or ``error(last checkpoint)``), after saving the survivors'
        state (not ``lost`` workers') when no checkpoint has it."""
        saved = self.checkpoints.save_before_giving_up(self.membership, lost)
        last = self.ledger.last_checkpoint
        raise error(last) if error else capacity_lost(decision, last, saved is not None,
                                                      self.repairs.out_of_memory(lost))


def capacity_lost(decision: Decision, last_checkpoint: Optional[str], saved: bool = False,
                  out_of_memory: Optional[str] = None) -> CapacityLost:
    """The error that ends a run the policy gave up on: its reason, its key, and what is kept; with
    ``out_of_memory`` (a lost worker ran out of memory: which, doing what) an OutOfMemoryLost, which
    also says what to change."""
    if out_of_memory:
        line = capacity_lost(decision, last_checkpoint, saved)
        return OutOfMemoryLost(f"{out_of_memory}; {line}; {FIT_ADVICE}")
    if saved:
        kept = f"the survivors saved every committed step to {last_checkpoint}: resume from it"
    elif last_checkpoint:
        kept = f"the last checkpoint ({last_checkpoint}) is intact"
    else:
        kept = "no checkpoint was written yet (checkpoint.every keeps some)"
    return CapacityLost(f"{decision.reason} (config: {decision.config_key}); {kept}")


def nonfinite_loss(step: int, loss, norm, decision: Decision, last_checkpoint: Optional[str]) -> NonFiniteLoss:
    """The error that ends a run at a non-finite step: what was not finite, and where to resume."""
    last = (f"the last good checkpoint is {last_checkpoint}: resume from it"
            if last_checkpoint else "there is no checkpoint yet (checkpoint.every keeps some): start again")
    return NonFiniteLoss(f"step {step + 1}: the loss ({loss}) or the gradient norm ({norm}) is not finite, so the "
                         f"step was applied on no worker; {decision.reason}; {last} with a lower train.lr or "
                         "train.grad_clip, or set train.skip_nonfinite to skip such steps")


def started_event(cfg: Config, crew: Crew, pids: list[int]) -> dict:
    """The run's first event: its layout, its replicas' workers and where they run, its standbys."""
    return {"event": "started", "layout": cfg.layout().label, "replicas": crew.membership.dp,
            "standby": [m.pid for m in crew.membership.spares], "generation": crew.generation, "pids": pids,
            "coordinator_pid": os.getpid(), "placement": crew.placement()}


def standby_waiting(asked: int, started: int) -> dict:
    """The event of a run that started with fewer standby replicas than elastic.standby asked for."""
    return {"event": "standby_waiting", "standby": asked, "started": started,
            "reason": "no free slot for a standby replica: the run trains without it, and starts it when the cluster "
                      "grants its resources (a capacity event)"}


SHARDED_CPU_MALLOC = "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"
"""glibc settings of a sharded worker on CPU. FSDP allocates and frees a layer's unsharded parameters
and gradients (tens of MB each) per layer and micro-batch; glibc would serve them from its heap and
keep the freed memory, so the worker's resident set would grow back to a replica's size. Above 1 MiB
they are mapped and returned on free instead, on huge pages where the kernel allows (fewer faults)."""


NCCL_SURVIVES_ERRORS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
"""A GPU worker's NCCL watchdog: on a failed or timed-out collective it aborts the communicators (2) instead
of ending the process (torch's default, 3), and no monitoring thread ends a process whose watchdog seems
stuck: a survivor of a lost peer lives on to re-form (raytrain.worker.groups.abort_groups)."""


def _worker_options(cfg: Config) -> dict:
    options = {"num_cpus": cfg.resources.cpus_per_worker, "num_gpus": 1 if cfg.resources.use_gpu else 0}
    env = dict(NCCL_SURVIVES_ERRORS) if cfg.resources.use_gpu else {}
    if cfg.parallel.fsdp > 1 and not cfg.resources.use_gpu:
        env["GLIBC_TUNABLES"] = SHARDED_CPU_MALLOC
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def _worker_spec(prepared: PreparedRun) -> WorkerSpec:
    """What every worker of the run is started with (raytrain.config.prepared.WorkerSpec). The built-in
    corpus the driver built on this node (the coordinator's) goes into the object store for workers on other
    machines, owned here rather than by the driver: an object the driver owns makes its process end (exit 1)
    the moment an embedded Ray's object store goes with a signal to the whole process group, before it can
    report the stop (tests/test_signals.py)."""
    corpus = None
    if prepared.builtin_corpus is not None:
        with open(prepared.builtin_corpus, "rb") as f:
            corpus = [ray.put(f.read())]
    return prepared.worker_spec(corpus, heartbeat_to=ray.get_runtime_context().current_actor)
