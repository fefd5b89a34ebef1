"""The coordinator's states that change who is in the run: REPAIRING (workers were lost during a
step, a save, an evaluation or a re-forming), DRAINING (workers told to leave go at a step boundary:
raytrain.control.drain) and GROWING (started workers form more replicas).

All end by re-forming the process groups under a new generation. Every loss counts once against
elastic.max_failures, however it happened, and is reported as a ``repair`` event carrying the
policy's decisions (``repair_failed`` for a loss while re-forming, ``reload`` when a stage had to
come back from the checkpoint). When the policy gives up, ``GiveUp`` carries its decision to the
coordinator, which saves what the survivors hold and ends the run.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.faults import remaining_faults
from raytrain.config.mesh import place_of
from raytrain.control import steps
from raytrain.control.crew import Crew
from raytrain.control.drain import DrainMove, Drains, Reformed, drain_event, next_move
from raytrain.control.ledger import Ledger
from raytrain.control.membership import Member
from raytrain.control.policy import NO_DECISION, Action, Decision, ElasticPolicy
from raytrain.control.protocol import WorkersLost
from raytrain.control.runstate import (Checkpointing, Draining, Evaluating, Growing, Interrupted, Repairing,
                                       Running, State)
from raytrain.reports.oom import OutOfMemory

CAPACITY_POLL_S = 1.0
"""How often a run below elastic.min_dp checks whether replacements have started."""


@dataclass(frozen=True)
class OomEvent:
    """The ``oom`` event of a worker lost to memory: which worker (its place, replica, shard and stage; no
    replica when it was not in the generation), what the run was doing (``during``: an Interrupted value
    or ``join``) at the ledger's ``step``, and how it ran out (who ended it, its node's memory)."""

    step: int
    during: str
    worker: str
    replica: Optional[int]
    shard: int
    stage: int
    pid: Optional[int]
    oom: OutOfMemory

    def record(self) -> dict:
        """The event's row in metrics.jsonl."""
        return {"event": "oom", "step": self.step, "during": self.during, "worker": self.worker,
                "replica": self.replica, "shard": self.shard, "stage": self.stage, "pid": self.pid,
                **self.oom.record(),
                "reason": "out of memory: the worker leaves the run like a lost worker (repaired, or reloaded)"}

    def text(self) -> str:
        """Which worker ran out of memory, how, and what the run was doing (a step, a save, an evaluation)."""
        step = self.step
        running = {"step": f"a step (step {step + 1})", "checkpoint": f"a save (the checkpoint of step {step})",
                   "eval": f"an evaluation (after step {step})"}.get(self.during, f"re-forming the groups (step {step + 1})")
        return f"{self.worker} {self.oom.text()} during {running}"


class GiveUp(Exception):
    """The policy ends the run; ``lost`` are workers not to save from (they died or hung)."""

    def __init__(self, decision: Decision, lost: tuple[Member, ...] = ()):
        super().__init__(decision.reason)
        self.decision, self.lost = decision, tuple(lost)


class Repairs:
    """REPAIRING and GROWING over one run's crew and ledger, by its policy. ``stopping`` says whether a
    stop was requested (a signal reached the driver): a repair then does not wait for replacements."""

    def __init__(self, crew: Crew, ledger: Ledger, policy: ElasticPolicy, cfg: Config, num_samples: int,
                 stopping: Callable[[], bool], drains: Drains, request_stop: Callable[[str], None]):
        self.crew = crew
        self.ledger = ledger
        self.policy = policy
        self.cfg = cfg
        self.num_samples = num_samples
        self.stopping = stopping
        self.drains = drains
        self.request_stop = request_stop
        self._next_grow_poll = 0.0
        self.oom_events: dict[int, OomEvent] = {}
        """The ``oom`` event of each worker lost to memory, by id of its member."""
        self._last_oom_step: Optional[int] = None
        """The ledger's step when a worker was last lost to memory (a second loss there gives up)."""

    # --- REPAIRING ------------------------------------------------------------------------------

    def repairing(self, state: Repairing) -> State:
        """Settle the failed step, drop the dead, re-form; then retry what was interrupted."""
        crew, ledger = self.crew, self.ledger
        t0, detected_at = time.perf_counter(), time.time()
        failed_step, lost = ledger.step, list(state.lost)
        mesh = crew.membership.mesh()
        places = {id(m): place_of(mesh.label(rank)) for rank, m in crew.membership.ranked() if m in lost}
        settle = NO_DECISION
        if state.interrupted is Interrupted.STEP:
            settle = self.policy.settle_step(failed_step, [r.committed for r in state.reports])
        if settle.action is Action.ROLL_FORWARD:
            lost += self._roll_forward(failed_step, list(state.reports), lost)
        self._report_oom(lost, state.interrupted.value)
        self._give_up_on_repeated_oom(lost)
        self._count_failure(lost)  # after the step is settled: a run that gives up saves its survivors' state
        crew.faults = remaining_faults(crew.faults, failed_step)  # fired, or moot: slots are renumbered now
        capacity = self._reform(lost, self.drains.needing_replacement(lost))
        seconds = time.perf_counter() - t0
        ledger.recovery_s.append(round(seconds, 3))
        ledger.emit({"event": "repair", "during": state.interrupted.value, "step": failed_step,
                     "detected_at": detected_at, "lost": list(places.values()),
                     "rolled_forward": settle.action is Action.ROLL_FORWARD,
                     "retrying_step": failed_step if settle.action is Action.RETRY else None,
                     "new_layout": crew.label(), "generation": crew.generation, "repair_s": round(seconds, 3),
                     "pending_replacements": len(crew.membership.pending),
                     "decisions": [d.record() for d in (settle, capacity) if d is not NO_DECISION],
                     **_hung(lost, places, self.cfg.elastic.detect_timeout_s),
                     "reason": "lost worker(s); survivors kept, groups re-formed, batch re-divided"})
        if ledger.step == failed_step and state.interrupted is Interrupted.CHECKPOINT:
            return Checkpointing()  # save again, into a new directory
        if ledger.step == failed_step and state.interrupted is Interrupted.EVAL:
            return Evaluating()
        if ledger.step == failed_step + 1:  # rolled forward: its evaluation or checkpoint may be due
            return steps.after_commit(ledger, self.cfg)
        ledger.flush_row(None)
        return Running()

    def _report_oom(self, lost: list[Member], during: str) -> None:
        """An ``oom`` event for each member of ``lost`` that was lost to memory (once each): which worker
        (its replica, shard and stage), what the run was doing, who ended it and its node's memory.
        Its repair follows as for any lost worker (a replica remains) or a reload (none does)."""
        mesh = self.crew.membership.mesh()
        ranks = {id(m): rank for rank, m in self.crew.membership.ranked()}
        for m in lost:
            if m.oom is None or id(m) in self.oom_events:
                continue
            rank = ranks.get(id(m))
            event = OomEvent(step=self.ledger.step, during=during,
                             worker=place_of(mesh.label(rank)) if rank is not None else f"shard {m.shard} stage {m.stage}",
                             replica=mesh.coords(rank)[0] if rank is not None else None, shard=m.shard, stage=m.stage,
                             pid=m.pid, oom=m.oom)
            self.oom_events[id(m)] = event
            self.ledger.emit(event.record())

    def out_of_memory(self, lost: tuple[Member, ...]) -> Optional[str]:
        """For a run that gives up after losing ``lost``: which worker ran out of memory, how, and what the
        run was doing (a step, a save, an evaluation), or None when no worker of them was lost to memory."""
        found = next((self.oom_events[id(m)] for m in lost if id(m) in self.oom_events), None)
        return found.text() if found is not None else None

    def _give_up_on_repeated_oom(self, lost: list[Member]) -> None:
        if not any(m.oom is not None for m in lost):
            return
        decision = self.policy.after_out_of_memory(self.ledger.step, self._last_oom_step)
        self._last_oom_step = self.ledger.step
        if decision.action is Action.GIVE_UP:
            raise GiveUp(decision, tuple(lost))

    def _count_failure(self, lost: list[Member]) -> None:
        decision = self.policy.after_failure(self.ledger.count_failure())
        if decision.action is Action.GIVE_UP:
            raise GiveUp(decision, tuple(lost))

    def _roll_forward(self, step: int, reports: list, lost: list[Member]) -> list[Member]:
        """Commit ``step`` on the survivors that prepared it; returns any that died meanwhile."""
        died = self.crew.roll_forward(step, reports, lost)
        self.ledger.time.rolled_forward(step)
        # It waits like any committed step's row: its held-out loss and checkpoint path may follow.
        row = steps.rolled_forward_row(step, reports, self.cfg, self.crew.membership.mesh(), self.num_samples,
                                       self.crew.label())
        self.ledger.commit(step, row)
        return died

    def _reform(self, lost: list[Member], respawn: list[Member]) -> Decision:
        """Replace the lost (on the bundles of ``respawn``: the others' replacements started at their
        notice), wait for elastic.min_dp replicas, reload if a slot has no up-to-date copy, re-form;
        repeated while workers die meanwhile. Returns the capacity decision."""
        crew, ledger = self.crew, self.ledger
        dead = list(lost)
        while True:
            crew.replace(dead, respawn)
            capacity = self._await_capacity(lost)
            try:
                self._maybe_reload(lost)
                crew.form_generation(ledger.step)
                return capacity
            except WorkersLost as more:  # a failure during repair: repair again
                lost += more.dead  # not to be saved from if the run gives up
                self._report_oom(more.dead, "join")
                self._count_failure(lost)
                crew.faults = remaining_faults(crew.faults, ledger.step, keep_join=False)
                ledger.emit({"event": "repair_failed", "step": ledger.step, "lost": len(more.dead),
                             "reason": "lost worker(s) while re-forming groups; repairing again"})
                dead, respawn = more.dead, self.drains.needing_replacement(more.dead)

    def _await_capacity(self, lost: list[Member]) -> Decision:
        t0 = time.perf_counter()
        try:
            return self._wait_for_replicas(lost)
        finally:
            self.ledger.time.charge("waiting_for_capacity", time.perf_counter() - t0)

    def _wait_for_replicas(self, lost: list[Member]) -> Decision:
        crew, t0 = self.crew, time.monotonic()
        crew.admit_started(0, self.policy.target_dp)
        while True:
            decision = self.policy.capacity(crew.membership.dp, time.monotonic() - t0)
            if decision.action is Action.WAIT and self.stopping() and crew.membership.dp > 0:
                # A stop was asked for: save from the replicas there are now rather than wait for more.
                return Decision(Action.CONTINUE, f"stopping: {crew.membership.dp} live replica(s) save the checkpoint "
                                "without waiting for replacements", "elastic.min_dp")
            if decision.action is Action.CONTINUE:
                return decision
            if decision.action is Action.GIVE_UP:
                raise GiveUp(decision, tuple(lost))
            crew.admit_started(CAPACITY_POLL_S, self.policy.target_dp)

    def _maybe_reload(self, lost: list[Member]) -> None:
        """If some slot has no member at the ledger's step, every member reloads the last checkpoint
        (a sharded run at dp=1 has no live copy of a lost shard)."""
        crew, ledger = self.crew, self.ledger
        decision = self.policy.stale_stages(crew.membership.stale_stages(ledger.step), ledger.last_checkpoint)
        if decision.action is Action.NONE:
            return
        if decision.action is Action.GIVE_UP:
            raise GiveUp(decision, tuple(lost))
        reloaded = checkpoint.read_manifest(ledger.last_checkpoint)["step"]
        t0 = time.perf_counter()
        crew.load(ledger.last_checkpoint, reloaded)
        ledger.time.charge("state_transfer", time.perf_counter() - t0)
        ledger.emit({"event": "reload", "from": ledger.last_checkpoint, "step": reloaded,
                     "steps_lost": ledger.step - reloaded, **decision.record()})
        ledger.rewind(reloaded)

    # --- DRAINING -------------------------------------------------------------------------------

    def draining(self, state: Draining) -> State:
        """Workers told to leave go at this boundary. When they are every worker, the run stops as a
        SIGTERM'd one does (a checkpoint, exit 143). If some slot has no other live copy, they save one
        first (CHECKPOINTING, then back here). Their step is committed and the survivors (or that
        checkpoint) hold their state, so no step is retried and nothing is counted against
        elastic.max_failures. They are stopped, replacements start on their bundles (save where one
        started at the notice is up; one that is not is cancelled: raytrain.control.drain), and the run
        re-forms as after a loss (shrinking if elastic.min_dp allows, taking a standby, else waiting for
        replacements); the ``drain`` event goes out with the first step without them."""
        move = next_move(state, self.crew.membership, self.ledger.checkpointed(self.ledger.step))
        if move is DrainMove.STOP:
            self.ledger.emit(drain_event(state, self.crew.membership, self.ledger.step, "every worker was told to "
                                         "leave: checkpoint and stop (exit 143); resume from the checkpoint").record())
            self.drains.drained(None)
            self.request_stop("SIGTERM")
            return Running()  # which stops at once: STOPPING saves, then FINISHED
        if move is DrainMove.SAVE_FIRST:
            return Checkpointing()  # then back here, through RUNNING
        t0 = time.perf_counter()
        why = ", ".join(sorted({n.why for n in state.notices}))
        event = drain_event(state, self.crew.membership, self.ledger.step,
                            f"told to leave ({why}); left at a step boundary, no step redone")
        for m in state.leaving:
            self.crew.worker_group.kill(m)
        respawn = self.drains.needing_replacement(list(state.leaving))
        capacity = self._reform(list(state.leaving), respawn)
        reformed = Reformed(new_layout=self.crew.label(), generation=self.crew.generation,
                            replaced_at_notice=len(state.leaving) - len(respawn),
                            reform_s=round(time.perf_counter() - t0, 3),
                            decisions=(capacity,) if capacity is not NO_DECISION else ())
        self.drains.drained(dataclasses.replace(event, reformed=reformed))
        self.ledger.flush_row(None)
        return Running()

    # --- GROWING --------------------------------------------------------------------------------

    def growth(self) -> Decision:
        """At a step boundary: GROW when started workers (replacements, or replicas the cluster
        granted beyond parallel.dp) can form more replicas, up to the target; else no decision."""
        crew = self.crew
        if crew.unused_placements and time.monotonic() >= self._next_grow_poll:
            self._next_grow_poll = time.monotonic() + self.cfg.elastic.grow_poll_s
            granted = crew.spawn_in_granted_placements()
            if granted:
                self.ledger.emit({"event": "capacity", "new_workers": granted,
                                  "reason": "the cluster granted another replica's resources (up to elastic.max_dp)"})
        if crew.membership.dp >= self.policy.target_dp or not (crew.membership.pending or crew.membership.spares):
            return NO_DECISION
        before = crew.membership.dp
        crew.admit_started(0, self.policy.target_dp)
        return self.policy.grow(before, crew.membership.dp - before)

    def growing(self, state: Growing) -> State:
        """Re-form with the replicas ``growth`` formed; they take their state from live peers."""
        t0 = time.perf_counter()
        try:
            self.crew.form_generation(self.ledger.step)
        except WorkersLost as lost:
            return Repairing(tuple(lost.dead), Interrupted.GROW)
        self.ledger.emit({"event": "grow", "step": self.ledger.step, "new_layout": self.crew.label(),
                          "generation": self.crew.generation, "grow_s": round(time.perf_counter() - t0, 3),
                          **state.decision.record()})
        return Running()


def _hung(lost: list[Member], places: dict[int, str], detect_timeout_s: float) -> dict:
    """The repair event's word on the lost workers killed for their silence (``places``: a lost member's place
    by its id): each one's place, pid and seconds without a heartbeat, as the cause of the loss."""
    silent = [{"worker": places.get(id(m), f"stage {m.stage}"), "pid": m.pid, "silent_s": m.hung}
              for m in lost if m.hung is not None]
    return {"hung": silent, "cause": f"no heartbeat for over elastic.detect_timeout_s={detect_timeout_s:g} s"} if silent else {}
