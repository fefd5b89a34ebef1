"""The coordinator's states that change who is in the run: REPAIRING (workers were lost during a
step, a save or a re-forming) and GROWING (started workers form more replicas).

Both end by re-forming the process groups under a new generation. Every loss counts once against
elastic.max_failures, however it happened, and is reported as a ``repair`` event carrying the
policy's decisions (``repair_failed`` for a loss while re-forming, ``reload`` when a stage had to
come back from the checkpoint).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from raytrain import checkpoint
from raytrain.control import steps
from raytrain.control.membership import Member
from raytrain.control.policy import Action, Decision
from raytrain.control.runstate import RunState
from raytrain.control.workergroup import SETUP_TIMEOUT_S, WorkersLost, lost_members, spawn_in_granted
from raytrain.testing.faults import FaultPlan

if TYPE_CHECKING:
    from raytrain.control.coordinator import Coordinator

CAPACITY_POLL_S = 1.0
"""How often a run below elastic.min_dp checks whether replacements have started."""
RETRIED = {"checkpoint": RunState.CHECKPOINTING, "eval": RunState.EVALUATING}
"""What a repair at the same step goes back to, by what the lost workers were doing."""


class Repairs:
    """REPAIRING and GROWING for one coordinator (whose team, group, policy and progress they use)."""

    def __init__(self, coordinator: "Coordinator"):
        self.c = coordinator
        self._next_grow_poll = 0.0
        self._grow: Optional[Decision] = None

    # --- REPAIRING ------------------------------------------------------------------------------

    def repairing(self) -> RunState:
        """Settle the failed step, drop the dead, re-form; then retry what was interrupted."""
        c, p = self.c, self.c.progress
        t0, detected_at = time.perf_counter(), time.time()
        failed_step, during, lost = p.step, p.during, p.lost
        mesh = c.team.mesh()
        slots = [mesh.label(rank) for rank, m in c.team.ranked() if m in lost]
        settle = c.policy.settle_step(failed_step, [r["committed"] for r in p.reports]) if during == "step" else None
        if settle is not None and settle.action is Action.ROLL_FORWARD:
            lost = lost + self._roll_forward(failed_step, p.reports, lost)
        p.lost = lost
        self.count_failure()  # after the step is settled: a run that gives up saves its survivors' state
        c.faults = FaultPlan.remaining(c.faults, failed_step)  # fired, or moot: slots are renumbered now
        p.step, capacity = self.reform(lost, p.step)
        seconds = time.perf_counter() - t0
        c.recovery_s.append(round(seconds, 3))
        c.emit({"event": "repair", "during": during, "step": failed_step, "detected_at": detected_at,
                "lost": [_place(label) for label in slots],
                "rolled_forward": settle is not None and settle.action is Action.ROLL_FORWARD,
                "retrying_step": failed_step if settle is not None and settle.action is Action.RETRY else None,
                "new_layout": c.layout(), "generation": c.generation, "repair_s": round(seconds, 3),
                "pending_replacements": len(c.team.pending),
                "decisions": [d.record() for d in (settle, capacity) if d is not None],
                "reason": "lost worker(s); survivors kept, groups re-formed, batch re-divided"})
        p.lost, p.reports = [], []
        if during in RETRIED and p.step == failed_step:
            return RETRIED[during]  # save again (into a new directory), or evaluate again
        if p.step == failed_step + 1:  # rolled forward: its checkpoint may be due
            return c.after_commit()
        c.flush_row(None)
        return RunState.RUNNING

    def count_failure(self) -> None:
        self.c.failures += 1
        decision = self.c.policy.after_failure(self.c.failures)
        if decision is not None:
            self.c.give_up(decision)

    def _roll_forward(self, step: int, reports: list[dict], lost: list[Member]) -> list[Member]:
        """Apply ``step`` on the live survivors that prepared but did not apply it; returns any that
        died meanwhile (the others' progress is recorded either way)."""
        c = self.c
        by_rank = {r["rank"]: r for r in reports}
        behind = [m for rank, m in c.team.ranked()
                  if rank in by_rank and by_rank[rank]["committed"] == step and m not in lost]
        outcomes = c.group.collect(behind, c.group.submit(behind, "commit_prepared", step), SETUP_TIMEOUT_S)
        for o in outcomes:
            if o.value is not None:
                o.member.committed = o.value
        c.committed_steps.append(step)
        c.progress.step = step + 1
        # Held like any committed step's row: its held-out loss and checkpoint path may follow.
        c.progress.row = steps.rolled_forward_row(step, reports, c.cfg, c.team.mesh(), c.num_samples, c.layout())
        return lost_members(c.group, outcomes)

    def reform(self, dead: list[Member], step: int) -> tuple[int, Decision]:
        """Drop the dead, start their replacements, wait for elastic.min_dp replicas, reload if a
        stage has no up-to-date copy, re-form; repeated while workers die meanwhile. Returns the
        step the run resumes at and the capacity decision."""
        c = self.c
        while True:
            dead = list({id(m): m for m in dead}.values())  # a worker can be reported lost twice
            c.team.drop_dead(dead)
            c.team.pending += [c.group.spawn(m.stage, m.placement, m.bundle, shard=m.shard) for m in dead]
            c.group.submit(c.team.spares, "leave")  # close broken groups' connections now
            capacity = self._await_capacity()
            try:
                step = self._maybe_reload(step)
                c.form_generation(step)
                return step, capacity
            except WorkersLost as more:  # a failure during repair: repair again
                c.progress.lost = c.progress.lost + more.dead  # not to be saved from if the run gives up
                self.count_failure()
                c.faults = FaultPlan.remaining(c.faults, step, keep_join=False)
                c.emit({"event": "repair_failed", "step": step, "lost": len(more.dead),
                        "reason": "lost worker(s) while re-forming groups; repairing again"})
                dead = more.dead

    def _await_capacity(self) -> Decision:
        c, t0 = self.c, time.monotonic()
        self.admit_started(0)
        while True:
            decision = c.policy.capacity(c.team.dp, time.monotonic() - t0)
            if decision.action is Action.WAIT and c.stopping and c.team.dp > 0:
                # A stop was asked for: save from the replicas there are now rather than wait for more.
                return Decision(Action.CONTINUE, f"stopping: {c.team.dp} live replica(s) save the checkpoint "
                                "without waiting for replacements", "elastic.min_dp")
            if decision.action is Action.CONTINUE:
                return decision
            if decision.action is Action.GIVE_UP:
                c.give_up(decision)
            self.admit_started(CAPACITY_POLL_S)

    def admit_started(self, wait_s: float) -> None:
        """Move started replacements to the spares (restarting any that died while starting), and
        form replicas from spares up to the target."""
        c = self.c
        for m in c.group.started(c.team.pending, wait_s):
            m.pid = c.group.pid(m, timeout=SETUP_TIMEOUT_S)
            if m.pid is None:
                c.team.pending.remove(m)
                c.team.pending.append(c.group.spawn(m.stage, m.placement, m.bundle, shard=m.shard))
            else:
                c.team.admit([m])
        c.team.fill_to(c.policy.target_dp)

    def _maybe_reload(self, step: int) -> int:
        """If some slot has no member at ``step``, every member reloads the last checkpoint (a sharded
        run at dp=1 has no live copy of a lost shard)."""
        c = self.c
        decision = c.policy.stale_stages(c.team.stale_stages(step), c.last_checkpoint)
        if decision is None:
            return step
        if decision.action is Action.GIVE_UP:
            c.give_up(decision)
        c.group.call([(m, "load", (c.last_checkpoint,)) for m in c.team.members()], SETUP_TIMEOUT_S)
        reloaded = checkpoint.read_manifest(c.last_checkpoint)["step"]
        c.team.set_committed(reloaded)
        c.committed_steps = [s for s in c.committed_steps if s < reloaded]
        c.skipped_steps = [s for s in c.skipped_steps if s < reloaded]
        c.emit({"event": "reload", "from": c.last_checkpoint, "step": reloaded, "steps_lost": step - reloaded,
                **decision.record()})
        return reloaded

    # --- GROWING --------------------------------------------------------------------------------

    def growth_ready(self) -> bool:
        """At a step boundary: whether started workers (replacements, or replicas the cluster
        granted beyond parallel.dp) can form more replicas, up to the target."""
        c = self.c
        if c.unused_placements and time.monotonic() >= self._next_grow_poll:
            self._next_grow_poll = time.monotonic() + c.cfg.elastic.grow_poll_s
            granted = spawn_in_granted(c.group, c.unused_placements, c.team.slots, timeout=0)
            if granted:
                c.team.pending += granted
                c.emit({"event": "capacity", "new_workers": len(granted),
                        "reason": "the cluster granted another replica's resources (up to elastic.max_dp)"})
        if c.team.dp >= c.policy.target_dp or not (c.team.pending or c.team.spares):
            return False
        before = c.team.dp
        self.admit_started(0)
        self._grow = c.policy.grow(before, c.team.dp - before)
        return self._grow is not None

    def growing(self) -> RunState:
        """Re-form with the replicas ``growth_ready`` formed; they take their state from live peers."""
        c, p = self.c, self.c.progress
        t0 = time.perf_counter()
        try:
            c.form_generation(p.step)
        except WorkersLost as lost:
            p.lost, p.reports, p.during = lost.dead, [], "grow"
            return RunState.REPAIRING
        c.emit({"event": "grow", "step": p.step, "new_layout": c.layout(), "generation": c.generation,
                "grow_s": round(time.perf_counter() - t0, 3), **(self._grow.record() if self._grow else {})})
        return RunState.RUNNING


def _place(label: str) -> str:
    """``replica 1 stage 0`` (``replica 1 shard 1 stage 0``) from a worker's label (raytrain.config.mesh.Mesh.label)."""
    parts = label.split(":")
    names = ("replica", "stage") if len(parts) == 2 else ("replica", "shard", "stage")
    return " ".join(f"{n} {v}" for n, v in zip(names, parts))
