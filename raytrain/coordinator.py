"""The actor that owns a run: starts the workers in a placement group, forms their process groups,
drives the steps, aggregates metrics, publishes checkpoints, and repairs the run in place.

It sends one small message per worker per step (``run_step(step)``) and gets metrics back; no tensor
passes through it. The next step's message is sent before the current step's replies arrive
(when no checkpoint or membership change falls between them), so a worker goes from one step to
the next without waiting a round trip for the coordinator. A worker that dies early in the step
sent ahead may take the previous step's reply with it: that step is then repaired as if the worker
died in it, and the survivors' votes roll it forward. The driver polls ``poll()`` for new metric
rows while ``run()`` executes.

Repair (DESIGN invariants 3 and 4): when a worker is lost, survivors are not restarted. They agree
on the last committed step (rolling forward a step that every worker voted for), broken replicas
are dropped (their surviving workers wait as spares), the process groups are re-formed among the
remaining replicas under a new generation, and the global batch is divided among them. A
replacement worker is started on the lost worker's bundle; when it is up (immediately if the node
lives, once capacity returns otherwise) it joins at a step boundary and receives its stage's state
by broadcast from a live peer. Only when some stage has no up-to-date worker left does the run
reload its last checkpoint, and it says so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain import checkpoint, data
from raytrain.config import Config, config_from_dict
from raytrain.data import even_shares
from raytrain.faults import FaultPlan
from raytrain.mesh import Mesh
from raytrain.rendezvous import StoreAddress
from raytrain.worker import StageWorker

SETUP_TIMEOUT_S = 300.0
"""Bound on worker start-up and process-group formation."""
GRANT_AT_START_S = 1.0
"""How long the start waits for replicas beyond parallel.dp before starting without them."""
CAPACITY_POLL_S = 1.0
"""How often a run below elastic.min_dp checks whether replacements have started."""


class StepFailed(RuntimeError):
    """A step failed for a reason other than a lost worker (a bug, bad data): not repairable."""


class NonFiniteLoss(StepFailed):
    """A step's loss or gradient norm was not finite (and train.skip_nonfinite was used up)."""


class CapacityLost(RuntimeError):
    """Fewer than elastic.min_dp replicas could be formed within elastic.wait_s."""


class NonFiniteStep(Exception):
    """Internal: every worker voted against applying ``step`` (a loss or gradient was not finite)."""

    def __init__(self, step: int, results: list[dict]):
        super().__init__(f"step {step} was not finite")
        self.step, self.results = step, results


class WorkersLost(Exception):
    """Internal: these members died during an operation."""

    def __init__(self, dead: list["Member"]):
        super().__init__(f"{len(dead)} worker(s) lost")
        self.dead = dead


@dataclass
class StepCall:
    """``run_step`` sent to every member; ``started`` is when its time starts to count."""

    step: int
    members: list
    refs: list
    started: Optional[float]  # None while it waits behind the step before it


@dataclass(eq=False)
class Member:
    """A worker actor, the stage it hosts for life, the bundle it occupies and its progress."""

    handle: Any
    stage: int
    placement: PlacementGroup
    bundle: int
    ready: Any = None  # ObjectRef of pid(): resolves once the actor is up
    pid: Optional[int] = None
    committed: int = 0


class Coordinator:
    def __init__(self, config: dict, data_path: str, num_samples: int, stage_layers: list[list[int]],
                 placement: PlacementGroup, first_bundle: int, resume_from: Optional[str], worker_cls=StageWorker,
                 extra_placements: tuple[PlacementGroup, ...] = (), corpus: Optional[list] = None):
        self.cfg: Config = config_from_dict(config)
        self.config_dict = config
        self.data_path, self.num_samples = data_path, num_samples
        self.corpus = corpus  # [ref to the built-in corpus's bytes] for workers on machines without it
        self.stage_layers = stage_layers
        self.placement, self.first_bundle = placement, first_bundle
        # Requested by the driver (which removes them), one per replica beyond parallel.dp up to
        # elastic.max_dp; each is used once Ray grants it.
        self.unused_placements = [(pg, pg.ready()) for pg in extra_placements]
        self._next_grow_poll = 0.0
        self.resume_from = resume_from
        self.store: Optional[StoreAddress] = None  # given to run(): hosted by the driver, which outlives us all
        self.worker_cls = ray.remote(worker_cls) if not hasattr(worker_cls, "remote") else worker_cls
        self.pp = self.cfg.parallel.pp
        self.target_dp = self.cfg.elastic.max_dp or self.cfg.parallel.dp
        self.min_dp = self.cfg.elastic.min_dp or self.cfg.parallel.dp
        self.replicas: list[list[Member]] = []  # the current generation: replicas[r][stage]
        self.spares: list[Member] = []  # live workers outside the generation
        self.pending: list[Member] = []  # replacements still starting
        self.generation = -1
        self.mesh = Mesh(self.cfg.parallel.dp, self.pp)
        self.faults = list(self.cfg.elastic.faults)
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self.last_checkpoint: Optional[str] = resume_from
        self.committed_steps: list[int] = []
        self.failures = 0
        self.recovery_s: list[float] = []
        self.original_pids: list[int] = []
        self._failed_results: list = []  # survivors' reports of the step that just lost a worker
        self.skipped_steps: list[int] = []  # steps not applied because a value was not finite
        self._stop_reason: Optional[str] = None
        self.first_step = 0  # where this coordinator's run started (a resume's step)
        self._starting = self._spawn_first_workers()  # they start while the driver finishes its own set-up

    # --- driver-facing ----------------------------------------------------------------------------

    @ray.method(enable_task_events=False)  # the driver calls it every second
    def poll(self) -> list[dict]:
        """Metric rows produced since the last poll."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def run(self, store: StoreAddress) -> dict:
        """Train to ``train.steps`` (or, after ``request_stop``, to the next step boundary), forming
        groups at ``store``; returns the summary. Raises on an unrecoverable failure."""
        self.store = store
        step = self.first_step = self._start()
        call = None
        while step < self.cfg.train.steps:
            if call is None:
                if self._stop_reason is not None:
                    break
                self._maybe_grow(step)
                call = self._send_step(step, time.perf_counter())
            ahead = self._send_step(step + 1, None) if self._may_send_ahead(step + 1) else None
            try:
                row = self._collect_step(call)
            except WorkersLost as lost:
                dead = lost.dead + [m for m in self._drain(ahead) if m not in lost.dead]
                next_step = self._repair(step, dead)
                if next_step > step:  # rolled forward: the step is committed, its checkpoint may be due
                    next_step = self._maybe_checkpoint(next_step)[1]
                step, call = next_step, None
                continue
            except NonFiniteStep as bad:
                self._drain(ahead)
                step, call = self._maybe_checkpoint(self._skip_nonfinite(bad))[1], None
                continue
            step += 1
            if ahead is not None:
                ahead.started = time.perf_counter()
            call = ahead
            row["checkpoint"], resumed = self._maybe_checkpoint(step)
            self._emit(row)
            if resumed != step:  # the checkpoint's repair had to reload an older checkpoint
                step, call = resumed, None
        if self._stop_reason is not None and step < self.cfg.train.steps:
            self._stop_with_checkpoint(step)
        return {"steps": step, "checkpoint": self.last_checkpoint, "stopped": self._stop_reason,
                "worker_pids": self.original_pids, "final_pids": self.pids(), "committed_steps": self.committed_steps,
                "failures": self.failures, "recovery_s": self.recovery_s, "skipped_steps": self.skipped_steps}

    @ray.method(enable_task_events=False)
    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary, after a checkpoint (a signal reached the driver)."""
        self._stop_reason = reason

    def _stop_with_checkpoint(self, step: int) -> None:
        if self.last_checkpoint is None or checkpoint.read_manifest(self.last_checkpoint)["step"] != step:
            self._checkpoint_with_repair(step)
        self._emit({"event": "stopped", "step": step, "reason": self._stop_reason, "checkpoint": self.last_checkpoint})

    def pids(self) -> list[int]:
        return [m.pid for rep in self.replicas for m in rep]

    def layout(self) -> str:
        return f"dp={len(self.replicas)} pp={self.pp}"

    def shutdown(self) -> None:
        for m in self._members() + self.spares + self.pending:
            ray.kill(m.handle, no_restart=True)
        self.replicas, self.spares, self.pending = [], [], []

    # --- start ------------------------------------------------------------------------------------

    def _emit(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def _members(self) -> list[Member]:
        return [m for rep in self.replicas for m in rep]

    def _spawn(self, stage: int, placement: PlacementGroup, bundle: int) -> Member:
        handle = self.worker_cls.options(
            num_cpus=self.cfg.resources.cpus_per_worker, num_gpus=1 if self.cfg.resources.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle),
        ).remote(self.config_dict, self.data_path, self.num_samples, stage, self.stage_layers[stage], self.corpus)
        return Member(handle, stage, placement, bundle, ready=handle.pid.remote())

    def _spawn_first_workers(self) -> list[Member]:
        dp = self.cfg.parallel.dp
        members = [self._spawn(s, self.placement, self.first_bundle + r * self.pp + s)
                   for r in range(dp) for s in range(self.pp)]
        # Replicas beyond parallel.dp that the cluster can hold now start with the rest.
        return members + self._workers_for_granted_placements(timeout=GRANT_AT_START_S)

    def _start(self) -> int:
        members, self._starting = self._starting, []
        pids = [self._started_pid(m) for m in members]
        for m, pid in zip(members, pids):
            m.pid = pid
        self.original_pids = pids
        self.replicas = [members[r * self.pp:(r + 1) * self.pp] for r in range(len(members) // self.pp)]
        start = 0
        if self.resume_from is not None:
            ray.get([m.handle.load.remote(self.resume_from) for m in members], timeout=SETUP_TIMEOUT_S)
            start = checkpoint.read_manifest(self.resume_from)["step"]
            for m in members:
                m.committed = start
            self._emit({"event": "resumed", "from": self.resume_from, "step": start})
        self._form_generation(start)
        self._emit({"event": "started", "layout": self.cfg.layout(), "replicas": len(self.replicas),
                    "generation": self.generation,
                    "pids": self.original_pids, "coordinator_pid": os.getpid()})
        return start

    def _started_pid(self, member: Member) -> int:
        """The pid of a started worker; a worker whose constructor raised is a StepFailed with its message."""
        try:
            return ray.get(member.ready, timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:
                raise StepFailed(f"a worker of stage {member.stage} failed to start: {worker_error(e)}") from None
            raise

    # --- generations ------------------------------------------------------------------------------

    def _form_generation(self, step: int) -> None:
        """Re-form the process groups over ``self.replicas`` and bring every member to ``step``."""
        self.generation += 1
        self.mesh = Mesh(len(self.replicas), self.pp)
        shares = even_shares(self.cfg.train.global_batch, self.mesh.dp)
        members = [(self.mesh.rank(r, m.stage), m) for r, rep in enumerate(self.replicas) for m in rep]
        self._call_all([(m, m.handle.join.remote(rank, self.mesh, shares, self.store, self.generation,
                                                 self.faults)) for rank, m in members])
        behind = [m for _, m in members if m.committed != step]
        if behind:
            sources = {}
            for rank, m in members:
                if m.committed == step:
                    sources.setdefault(m.stage, rank)
            assert len(sources) == self.pp, "a stage without an up-to-date member must reload a checkpoint first"
            self._call_all([(m, m.handle.sync_state.remote(sources[m.stage])) for _, m in members])
            for _, m in members:
                m.committed = step

    def _call_all(self, calls: list[tuple[Member, Any]], timeout: float = SETUP_TIMEOUT_S) -> list:
        """ray.get every call; raise WorkersLost naming the members whose actor died.

        A live member whose call failed because a peer died (a collective that lost its peer) is
        not an error of its own: with any member dead, the caller repairs and retries.
        """
        results, dead, errors = [], [], []
        for m, ref in calls:
            try:
                results.append(ray.get(ref, timeout=timeout))
            except ray.exceptions.RayActorError:
                dead.append(m)
                results.append(None)
            except ray.exceptions.RayTaskError as e:
                errors.append(e)
                results.append(None)
        if dead:
            raise WorkersLost(dead)
        if errors:
            raise StepFailed(f"a worker failed (layout {self.layout()}): {worker_error(errors[0])}") from None
        return results

    # --- one step ---------------------------------------------------------------------------------

    def _send_step(self, step: int, started: Optional[float]) -> StepCall:
        members = self._members()
        trace = step - self.first_step < self.cfg.run.trace_steps  # a resumed run traces its own first steps
        return StepCall(step, members, [m.handle.run_step.remote(step, trace) for m in members], started)

    def _may_send_ahead(self, step: int) -> bool:
        changing = bool(self.unused_placements or self.pending or self.spares) or self._stop_reason is not None
        return may_send_ahead(step, self.cfg.train.steps, self.cfg.checkpoint.every, changing)

    def _collect_step(self, call: StepCall) -> dict:
        """Wait for every member's report of ``call.step``; the step's metrics row."""
        step = call.step
        ready, _ = ray.wait(call.refs, num_returns=len(call.refs), timeout=self.cfg.resources.step_timeout_s)
        results, dead = [], []
        for m, ref in zip(call.members, call.refs):
            if ref not in ready:  # silent for longer than a step may take: treat as lost
                ray.kill(m.handle, no_restart=True)
                dead.append(m)
                continue
            try:
                results.append((m, ray.get(ref)))
            except ray.exceptions.RayActorError:
                dead.append(m)
            except ray.exceptions.RayTaskError as e:
                raise StepFailed(f"step {step + 1} raised on a worker of stage {m.stage} (layout {self.layout()}): "
                                 f"{worker_error(e)}") from None
        for m, r in results:
            m.committed = r["committed"]
        if dead:
            self._failed_results = results
            raise WorkersLost(dead)
        if any(r.get("nonfinite") for _, r in results):
            raise NonFiniteStep(step, [r for _, r in results])
        failed = [r for _, r in results if not r["ok"]]
        if failed:
            raise StepFailed(f"step {step} failed with every worker alive (layout {self.layout()}): {failed[0]['error']}")
        self.committed_steps.append(step)
        return aggregate_step(step, [r for _, r in results], time.perf_counter() - call.started, self.cfg, self.mesh,
                              self.layout())

    def _drain(self, call: Optional[StepCall]) -> list[Member]:
        """Wait out a step sent ahead of one that failed; returns the members that died meanwhile.

        Workers whose own step failed skip it; the others fail it against their lost peers, so it
        ends within elastic.detect_timeout_s. Their progress (a committed step) is recorded.
        """
        if call is None:
            return []
        ray.wait(call.refs, num_returns=len(call.refs), timeout=self.cfg.elastic.detect_timeout_s + 5)
        dead = []
        for m, ref in zip(call.members, call.refs):
            try:
                m.committed = ray.get(ref, timeout=0)["committed"]
            except ray.exceptions.RayActorError:
                dead.append(m)
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
                pass
        return dead

    # --- repair -----------------------------------------------------------------------------------

    def _repair(self, step: int, dead: list[Member], during: str = "step") -> int:
        """Bring the run back after losing ``dead`` during ``step`` (or its checkpoint); returns the next step."""
        t_detect, detected_at = time.perf_counter(), time.time()
        self.failures += 1
        if self.failures > self.cfg.elastic.max_failures:
            raise CapacityLost(f"gave up after {self.failures - 1} repairs in one run (elastic.max_failures="
                               f"{self.cfg.elastic.max_failures}); find why workers keep dying (their logs), or "
                               f"raise elastic.max_failures; the last checkpoint ({self.last_checkpoint}) is intact")
        results, self._failed_results = self._failed_results, []
        dead_slots = [(r, m.stage) for r, rep in enumerate(self.replicas) for m in rep if m in dead]
        # Commit agreement: a survivor that stepped proves every worker voted; roll the rest forward.
        next_step = step
        if any(r["committed"] == step + 1 for _, r in results):
            prepared = [(m, m.handle.commit_prepared.remote(step)) for m, r in results if r["committed"] == step]
            try:
                for (m, _), committed in zip(prepared, self._call_all(prepared)):
                    m.committed = committed
            except WorkersLost as more:
                dead = dead + more.dead
            next_step = step + 1
            self.committed_steps.append(step)
            self._emit(rolled_forward_row(step, [r for _, r in results], self.cfg, self.mesh, self.num_samples,
                                          self.layout()))
        retried = None if next_step > step else step
        self.faults = FaultPlan.remaining(self.faults, step)  # fired, or moot: slots are renumbered now
        next_step = self._rebuild(dead, next_step)
        seconds = time.perf_counter() - t_detect
        self.recovery_s.append(round(seconds, 3))
        self._emit({"event": "repair", "during": during, "step": step, "detected_at": detected_at,
                    "lost": [f"replica {r} stage {s}" for r, s in dead_slots],
                    "rolled_forward": next_step > step and retried is None, "retrying_step": retried,
                    "new_layout": self.layout(), "generation": self.generation, "repair_s": round(seconds, 3),
                    "pending_replacements": len(self.pending),
                    "reason": "lost worker(s); survivors kept, groups re-formed, batch re-divided"})
        return next_step

    def _rebuild(self, dead: list[Member], step: int) -> int:
        """Drop broken replicas, start replacements, wait for min_dp, re-form; retried if more die."""
        for _ in range(self.cfg.elastic.max_failures):
            for m in dead:
                self.pending.append(self._spawn(m.stage, m.placement, m.bundle))
            dead_set = set(map(id, dead))
            kept, broken = [], []
            for rep in self.replicas:
                (broken if any(id(m) in dead_set for m in rep) else kept).append(rep)
            self.spares = [m for m in self.spares if id(m) not in dead_set]
            self.spares += [m for rep in broken for m in rep if id(m) not in dead_set]
            for m in self.spares:
                m.handle.leave.remote()
            self.replicas = kept
            self._collect_ready(wait_s=0)
            deadline = time.monotonic() + self.cfg.elastic.wait_s
            while len(self.replicas) < self.min_dp and time.monotonic() < deadline:
                self._collect_ready(wait_s=CAPACITY_POLL_S)
            if len(self.replicas) < self.min_dp:
                raise CapacityLost(
                    f"only {len(self.replicas)} replica(s) could be formed after losing workers, fewer than "
                    f"elastic.min_dp={self.min_dp}, and no capacity returned within elastic.wait_s="
                    f"{self.cfg.elastic.wait_s:g}s; the last checkpoint ({self.last_checkpoint}) is intact")
            try:
                step = self._maybe_reload(step)
                self._form_generation(step)
                return step
            except WorkersLost as more:  # a failure during repair: repair again
                self.failures += 1
                self.faults = FaultPlan.remaining(self.faults, step, keep_join=False)
                self._emit({"event": "repair_failed", "step": step, "lost": len(more.dead),
                            "reason": "lost worker(s) while re-forming groups; repairing again"})
                dead = more.dead
        raise CapacityLost(f"workers kept dying while the groups re-formed ({self.cfg.elastic.max_failures} tries, "
                           "elastic.max_failures); check the workers' logs and the cluster's health; the last "
                           f"checkpoint ({self.last_checkpoint}) is intact")

    def _collect_ready(self, wait_s: float) -> None:
        """Move started replacements to the spares, and form replicas from spares up to target_dp."""
        if self.pending:
            ready, _ = ray.wait([m.ready for m in self.pending], num_returns=len(self.pending), timeout=wait_s)
            for m in [m for m in self.pending if m.ready in ready]:
                self.pending.remove(m)
                try:
                    m.pid = ray.get(m.ready)
                except ray.exceptions.RayActorError as e:
                    if e.actor_init_failed:
                        raise StepFailed(f"a replacement worker of stage {m.stage} failed to start: "
                                         f"{worker_error(e)}") from None
                    self.pending.append(self._spawn(m.stage, m.placement, m.bundle))
                    continue
                self.spares.append(m)
        while len(self.replicas) < self.target_dp:
            by_stage = [[m for m in self.spares if m.stage == s] for s in range(self.pp)]
            if not all(by_stage):
                break
            # Prefer spares that are up to date: they can be a stage's sync source.
            replica = [max(cands, key=lambda m: m.committed) for cands in by_stage]
            for m in replica:
                self.spares.remove(m)
            self.replicas.append(replica)

    def _maybe_reload(self, step: int) -> int:
        """If some stage has no member at ``step``, every member reloads the last checkpoint."""
        up_to_date = {m.stage for m in self._members() if m.committed == step}
        if len(up_to_date) == self.pp:
            return step
        if self.last_checkpoint is None:
            raise CapacityLost(f"stage(s) {sorted(set(range(self.pp)) - up_to_date)} lost every replica and "
                               "there is no checkpoint to reload; set checkpoint.every")
        members = self._members()
        self._call_all([(m, m.handle.load.remote(self.last_checkpoint)) for m in members])
        reloaded = checkpoint.read_manifest(self.last_checkpoint)["step"]
        for m in members:
            m.committed = reloaded
        self.committed_steps = [s for s in self.committed_steps if s < reloaded]
        self._emit({"event": "reload", "from": self.last_checkpoint, "step": reloaded, "steps_lost": step - reloaded,
                    "reason": "a pipeline stage lost every replica: its state survives only in the checkpoint"})
        return reloaded

    def _workers_for_granted_placements(self, timeout: float) -> list[Member]:
        """Start one replica's workers in every extra placement group Ray has granted (waiting up to ``timeout``)."""
        if not self.unused_placements:
            return []
        granted, _ = ray.wait([ready for _, ready in self.unused_placements],
                              num_returns=len(self.unused_placements), timeout=timeout)
        members = []
        for pg, ready in [(pg, ready) for pg, ready in self.unused_placements if ready in granted]:
            self.unused_placements.remove((pg, ready))
            members += [self._spawn(s, pg, s) for s in range(self.pp)]
        return members

    def _maybe_grow(self, step: int) -> None:
        """At a step boundary: bring started replacements in, up to the target replica count."""
        if self.unused_placements and time.monotonic() >= self._next_grow_poll:
            self._next_grow_poll = time.monotonic() + self.cfg.elastic.grow_poll_s
            granted = self._workers_for_granted_placements(timeout=0)
            if granted:
                self.pending += granted
                self._emit({"event": "capacity", "new_workers": len(granted),
                            "reason": "the cluster granted another replica's resources (up to elastic.max_dp)"})
        if len(self.replicas) >= self.target_dp or not (self.pending or self.spares):
            return
        before = len(self.replicas)
        self._collect_ready(wait_s=0)
        if len(self.replicas) == before:
            return
        t0 = time.perf_counter()
        try:
            self._form_generation(step)
        except WorkersLost as lost:
            self._rebuild(lost.dead, step)
        self._emit({"event": "grow", "step": step, "new_layout": self.layout(), "generation": self.generation,
                    "grow_s": round(time.perf_counter() - t0, 3)})

    # --- checkpoints ------------------------------------------------------------------------------

    def _maybe_checkpoint(self, step: int) -> tuple[Optional[str], int]:
        """Checkpoint after ``step`` committed steps when checkpoint.every (or the end) says so.

        Returns the checkpoint written (or None) and the step to continue from: ``step``, or an
        older one when a worker lost during the save took a stage's last copy (it was reloaded).
        """
        if checkpoint_due(step, self.cfg.train.steps, self.cfg.checkpoint.every):
            return self._checkpoint_with_repair(step)
        return None, step

    def _checkpoint_with_repair(self, step: int) -> tuple[Optional[str], int]:
        """Save, repairing and retrying while workers die; every repair counts against
        elastic.max_failures (``_repair`` raises when they are used up)."""
        while True:
            try:
                return self._checkpoint(step), step
            except WorkersLost as lost:
                resumed = self._repair(step, lost.dead, during="checkpoint")
                if resumed != step:
                    return None, resumed

    def _checkpoint(self, step: int) -> str:
        """Save every stage's shard into a new directory, publish the manifest; returns its path."""
        base = self.cfg.checkpoint.dir
        ckpt_dir = checkpoint.new_step_dir(base, step)
        t0 = time.perf_counter()
        savers = self.replicas[0]
        shards = self._call_all([(m, m.handle.save.remote(ckpt_dir)) for m in savers])
        checkpoint.publish(ckpt_dir, {
            "step": step,
            "samples_seen": step * self.cfg.train.global_batch,
            "finite": all(s["finite"] for s in shards),
            "layout": {"dp": self.mesh.dp, "pp": self.mesh.pp, "stage_layers": self.stage_layers},
            "shards": shards,
            "config": self.config_dict,
        })
        checkpoint.prune(base, self.cfg.checkpoint.keep)
        self.last_checkpoint = ckpt_dir
        self._emit({"event": "checkpoint", "step": step, "path": ckpt_dir, "seconds": round(time.perf_counter() - t0, 3)})
        return ckpt_dir

    # --- non-finite steps -------------------------------------------------------------------------

    def _skip_nonfinite(self, bad: NonFiniteStep) -> int:
        """Skip a step whose vote found a non-finite value (nothing of it was applied anywhere), or
        stop when train.skip_nonfinite steps were skipped already. Returns the next step."""
        step, loss, norm = bad.step, self._loss_of(bad.results), bad.results[0].get("grad_norm")
        if len(self.skipped_steps) >= self.cfg.train.skip_nonfinite:
            last = (f"the last good checkpoint is {self.last_checkpoint}: resume from it"
                    if self.last_checkpoint else "there is no checkpoint yet (checkpoint.every keeps some): start again")
            raise NonFiniteLoss(
                f"step {step + 1}: the loss ({loss}) or the gradient norm ({norm}) is not finite, so the step was "
                f"applied on no worker ({len(self.skipped_steps)} such step(s) skipped before, "
                f"train.skip_nonfinite={self.cfg.train.skip_nonfinite}); {last} with a lower train.lr or "
                f"train.grad_clip, or set train.skip_nonfinite to skip such steps")
        members = self._members()
        for m, committed in zip(members, self._call_all([(m, m.handle.skip_step.remote(step)) for m in members])):
            m.committed = committed
        self.skipped_steps.append(step)
        self.committed_steps.append(step)
        row = {"step": step + 1, "loss": loss, "grad_norm": norm, "skipped": True, "time": time.time(),
               "layout": self.layout()}
        if self.cfg.run.record_samples:
            row["sample_ids"] = data.sample_ids(self.cfg.train.seed, self.num_samples,
                                                step * self.cfg.train.global_batch, (step + 1) * self.cfg.train.global_batch)
        self._emit(row)
        self._emit({"event": "skipped_step", "step": step + 1, "loss": loss, "grad_norm": norm,
                    "skipped_so_far": len(self.skipped_steps),
                    "reason": "non-finite loss or gradient norm: not applied (train.skip_nonfinite)"})
        return step + 1

    def _loss_of(self, results: list[dict]) -> Optional[float]:
        last = [r["loss_sum"] for r in results if "loss_sum" in r]
        return sum(last) / self.cfg.train.global_batch if len(last) == self.mesh.dp else None


def worker_error(error: Exception) -> str:
    """The worker's own exception line (``ValueError: ...``) out of Ray's wrapped traceback."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if ":" in line and not line.startswith("File ")), lines[-1] if lines else "")


def may_send_ahead(step: int, steps: int, checkpoint_every: int, membership_changing: bool) -> bool:
    """Whether ``step`` may be queued on the workers before the step before it has finished.

    Only when nothing happens between the two: no checkpoint after the previous step (nor the end of
    the run), and no replica that may join (a granted placement or a replacement starting).
    """
    return step < steps and not checkpoint_due(step, steps, checkpoint_every) and not membership_changing


def checkpoint_due(committed: int, steps: int, checkpoint_every: int) -> bool:
    """Whether a checkpoint is written once ``committed`` steps are done: every checkpoint.every, and at the end."""
    return committed == steps or bool(checkpoint_every and committed % checkpoint_every == 0)


def aggregate_step(step: int, results: list[dict], wall_s: float, cfg: Config, mesh: Mesh, layout: str) -> dict:
    """One metrics.jsonl row from every worker's report of a step."""
    B = cfg.train.global_batch
    last_stage = [r for r in results if mesh.coords(r["rank"])[1] == mesh.pp - 1]
    loss = sum(r["loss_sum"] for r in last_stage) / B
    # Bubble: idle share of each replica's pipeline span (its stages x its slowest stage's span).
    bubbles = []
    for replica in range(mesh.dp):
        stages = [r for r in results if mesh.coords(r["rank"])[0] == replica]
        span = max(r["pipeline_s"] for r in stages)
        bubbles.append(1.0 - sum(r["busy_s"] for r in stages) / (len(stages) * span) if span > 0 else 0.0)
    row = {
        "step": step + 1,
        "loss": loss,
        "grad_norm": results[0]["grad_norm"],
        "step_s": wall_s,
        "time": time.time(),
        "samples_per_s": B / wall_s,
        "worker_step_s": max(r["wall_s"] for r in results),
        "bubble": sum(bubbles) / len(bubbles),
        "peak_live_activations": {str(r["rank"]): r["peak_live"] for r in results},
        "peak_mem_mb": {str(r["rank"]): round(r["peak_mem_mb"], 1) for r in results},
        "layout": layout,
    }
    if any("events" in r for r in results):
        row["events"] = {str(r["rank"]): r["events"] for r in results if "events" in r}
    if cfg.run.record_samples:
        row["sample_ids"] = [i for r in sorted(results, key=lambda r: r["rank"]) for i in r.get("sample_ids", [])]
    return row


def rolled_forward_row(step: int, results: list[dict], cfg: Config, mesh: Mesh, num_samples: int, layout: str) -> dict:
    """The row of a step committed by roll-forward: every worker voted for it, some died before replying.

    Its loss is known only if the last stage of every replica survived; its samples are the whole
    global batch of the step (every replica had finished its slice before the vote).
    """
    B = cfg.train.global_batch
    last = [r for r in results if mesh.coords(r["rank"])[1] == mesh.pp - 1 and "loss_sum" in r]
    row = {"step": step + 1, "loss": sum(r["loss_sum"] for r in last) / B if len(last) == mesh.dp else None,
           "rolled_forward": True, "time": time.time(), "layout": layout}
    if cfg.run.record_samples:
        row["sample_ids"] = data.sample_ids(cfg.train.seed, num_samples, step * B, (step + 1) * B)
    return row
