"""Workers told to leave (a SIGTERM: raytrain.worker.drain), from the step reply that says so to the
step boundary where they go, and the ``drain`` event that reports it. The boundary is the end of
the step whose world-wide vote counted them (or, should the notice come after the vote, of the
next); a step sent ahead of it comes back skipped by every worker (steps.DrainBoundary).

While the run holds notices (elastic.replace_at_notice), a worker told to leave does not vote to go:
it trains on while a replacement starts in a placement group of its own, and the coordinator makes
the boundary itself (sending no step ahead) once every replacement is up, or when a deadline comes
nearer than the boundary and a re-form could take (``Drains.leaving_at_next_boundary``).

At that boundary there are three moves: every worker is leaving, so the run saves and stops (exit
143, as a SIGTERM'd run: resume from the checkpoint); some slot would have no live copy without
them, so they save a checkpoint first, which the re-formed run then reloads (no step lost); else
the run re-forms without them at once (raytrain.control.repair.Repairs.draining).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

from raytrain.config import Config
from raytrain.config.mesh import place_of
from raytrain.control.crew import Crew, ReplacementState
from raytrain.control.ledger import Ledger
from raytrain.control.membership import Member, Membership
from raytrain.control.policy import Decision
from raytrain.control.runstate import Draining
from raytrain.reports import DrainNotice, StepReport


SOFT_STRATEGIES = ("PACK", "SPREAD")
"""Placement strategies a replacement in a placement group of its own keeps to (STRICT_PACK's one node
and STRICT_SPREAD's one worker per node it could break: their workers go at the next boundary)."""
DEADLINE_MARGIN_STEPS = 3
DEADLINE_MARGIN_S = 2.0
"""A worker whose replacement is not up yet goes at the boundary after which its deadline is still
this many steps and seconds away: the step in flight, the one to the boundary, the re-form."""


class DrainMove(str, Enum):
    """What a step boundary does with the workers told to leave (``next_move``)."""

    STOP = "stop"
    """Every worker is leaving: the run saves and stops (exit 143)."""
    SAVE_FIRST = "save_first"
    """Some slot would have no live copy without them: they save a checkpoint first."""
    REFORM = "reform"
    """The run re-forms without them at once."""


class Drains:
    """The members whose replies said they were told to leave, until the boundary where they go (and
    the replacements started for them at the notice); then the ``drain`` event, until the first step
    without them commits."""

    def __init__(self, crew: Crew, ledger: Ledger, cfg: Config, stopping: Callable[[], bool]):
        self.crew, self.ledger, self.stopping = crew, ledger, stopping
        self.replace_at_notice = (cfg.elastic.replace_at_notice and cfg.parallel.tp == 1
                                  and cfg.resources.placement_strategy in SOFT_STRATEGIES)
        self._noted: dict[int, tuple[Member, DrainNotice]] = {}
        self._replacements: dict[int, Member] = {}
        """By id of a noted member: the replacement started for it at its notice."""
        self._voted = False
        """A step's vote said someone leaves (a step not held): its end is the boundary on every worker."""
        self._event: Optional[DrainEvent] = None

    def holds_notices(self) -> bool:
        """Whether a step sent now is held: a worker told to leave during it trains on while its replacement
        starts (elastic.replace_at_notice); not with a standby replica waiting, nor while the run stops."""
        return self.replace_at_notice and self.crew.membership.formable() == 0 and not self.stopping()

    def note_notices(self, reports: list[StepReport], held: bool) -> None:
        """Note the members whose reply to a step (sent with ``held``) carries a notice for the first
        time; if it held, and some member stays, start a replacement for each notice with a deadline (a
        node drained without one goes at once) and say so (a ``notice`` event)."""
        self._voted = self._voted or any(r.drain_after for r in reports)
        if not any(r.draining is not None for r in reports):
            return
        membership = self.crew.membership
        by_rank, mesh = dict(membership.ranked()), membership.mesh()
        new = [(r, by_rank[r.rank]) for r in reports
               if r.draining is not None and r.rank in by_rank and id(by_rank[r.rank]) not in self._noted]
        for r, m in new:
            self._noted[id(m)] = (m, r.draining)
        if not held or self.stopping() or len(self._noted) >= len(membership.members()):
            return  # the run stops, or every worker goes (it saves and stops): none is replaced
        for r, m in new:
            if r.draining.deadline is None:
                continue
            self._replacements[id(m)] = self.crew.start_replacement(m)
            self.ledger.emit({"event": "notice", "step": r.step + 1, "worker": place_of(mesh.label(r.rank)),
                              "why": r.draining.why, "reason": "told to leave: it trains on while a replacement "
                              "starts, and goes once that is up (elastic.replace_at_notice)"})

    def let_standbys_go(self, told: dict[int, str]) -> None:
        """The standbys among the workers whose beats said they were told to leave (``told``: why, by beat id)
        go now, each replaced (Crew.replace_leaving_standbys), with a ``standby_left`` event: a standby runs no
        steps to report its notice in, and let go now it never takes a slot only to leave it."""
        left = self.crew.replace_leaving_standbys(told)
        if left:
            self.ledger.emit({"event": "standby_left", "step": self.ledger.step, "pids": left,
                              "reason": "a standby was told to leave (SIGTERM, or its node draining): it goes now, "
                                        "and another starts in its place"})

    def leaving_at_next_boundary(self, step_s: float) -> bool:
        """Whether the noted members go at the next boundary: a vote made it theirs, one has no replacement
        starting (its start failed: cancelled), every member of the run is leaving, every replacement is
        up, or a deadline is nearer than DEADLINE_MARGIN_STEPS steps of ``step_s`` and DEADLINE_MARGIN_S
        (deadlines are the workers' clocks: the margin also covers their skew from this one). Noted members
        out of the run since, and replacements that failed, are let go first."""
        if not self._noted:  # the common case, twice a step: nothing more to look at
            return False
        self._forget_those_out_of_the_run()
        if not self._noted:
            return False
        for key, replacement in list(self._replacements.items()):
            if self.crew.replacement_state(replacement) is ReplacementState.FAILED:
                self.crew.cancel_replacement(self._replacements.pop(key))
        unreplaced = any(key not in self._replacements for key in self._noted)
        if self._voted or unreplaced or len(self._noted) >= len(self.crew.membership.members()):
            return True
        if all(self.crew.replacement_state(r) is ReplacementState.UP for r in self._replacements.values()):
            return True
        now, margin = time.time(), DEADLINE_MARGIN_STEPS * step_s + DEADLINE_MARGIN_S
        return any(notice.deadline - now < margin for _, notice in self._noted.values())

    def _forget_those_out_of_the_run(self) -> None:
        """A noted member out of the generation (its replica broke under another loss: it waits as a
        spare) is let go now, before a re-form could take it back; its replacement stays as a spare."""
        members, membership = {id(m) for m in self.crew.membership.members()}, self.crew.membership
        for key, (m, _) in list(self._noted.items()):
            if key not in members:
                del self._noted[key]
                self._replacements.pop(key, None)
                if any(s is m for s in membership.spares):
                    self.crew.worker_group.kill(m)
                    membership.drop_dead([m])
        self._voted = self._voted and bool(self._noted)

    def needing_replacement(self, leaving: list[Member]) -> list[Member]:
        """The members of ``leaving`` (or lost) whose replacement started at their notice is not up: it
        is cancelled, and they need one on their own bundle (which the cluster keeps for them, unlike
        capacity elsewhere). They are no longer awaited."""
        needing = []
        for m in leaving:
            self._noted.pop(id(m), None)
            self._voted = self._voted and bool(self._noted)
            replacement = self._replacements.pop(id(m), None)
            if replacement is None or self.crew.replacement_state(replacement) is not ReplacementState.UP:
                if replacement is not None:
                    self.crew.cancel_replacement(replacement)
                needing.append(m)
        return needing

    def state(self) -> Draining:
        """The noted members still in the run (one lost since was repaired as a loss) and their notices."""
        live = {id(m) for m in self.crew.membership.members()}
        members, notices = zip(*(entry for key, entry in self._noted.items() if key in live))
        return Draining(tuple(members), tuple(notices))

    def drained(self, event: Optional[DrainEvent]) -> None:
        """The noted members left at this boundary: the replacements not taken are cancelled, and ``event``
        goes out with the first step without them (None: the run stops)."""
        for replacement in self._replacements.values():
            self.crew.cancel_replacement(replacement)
        self._noted.clear()
        self._replacements.clear()
        self._voted = False
        self._event = event

    def event_after_commit(self) -> Optional[DrainEvent]:
        """After a commit: the held ``drain`` event (if this is the first step without them), with the
        seconds from the notice to this commit; None otherwise."""
        event, self._event = self._event, None
        if event is None:
            return None
        return dataclasses.replace(event, notice_to_step_s=round(time.time() - event.noticed_at, 3))


def next_move(state: Draining, membership: Membership, checkpointed: bool) -> DrainMove:
    """What the boundary does with the leaving (``checkpointed``: the current step has a checkpoint)."""
    leaving = {id(m) for m in state.leaving}
    staying = [m for m in membership.members() if id(m) not in leaving]
    if not staying:
        return DrainMove.STOP
    if {m.slot for m in staying} != set(membership.slots) and not checkpointed:
        return DrainMove.SAVE_FIRST
    return DrainMove.REFORM


def drain_event(state: Draining, membership: Membership, step: int, reason: str) -> DrainEvent:
    """The ``drain`` event at the boundary: who leaves, why, how long the notice gave them, at which step."""
    mesh, leaving = membership.mesh(), {id(m) for m in state.leaving}
    first = min(n.noticed_at for n in state.notices)
    deadlines = [n.deadline for n in state.notices if n.deadline is not None]
    return DrainEvent(step=step, reason=reason,
                      workers=tuple(place_of(mesh.label(rank)) for rank, m in membership.ranked() if id(m) in leaving),
                      why=tuple(sorted({n.why for n in state.notices})), noticed_at=first,
                      notice_to_boundary_s=round(time.time() - first, 3),
                      deadline_s=round(min(deadlines) - first, 3) if deadlines else None)


@dataclass(frozen=True)
class Reformed:
    """How the run re-formed without the workers that left: the ``drain`` event's fields after the boundary."""

    new_layout: str
    generation: int
    replaced_at_notice: int
    """Leaving workers whose replacement, started at their notice, was up at the boundary."""
    reform_s: float
    decisions: tuple[Decision, ...] = ()

    def record(self) -> dict:
        return {"new_layout": self.new_layout, "generation": self.generation,
                "replaced_at_notice": self.replaced_at_notice, "reform_s": self.reform_s,
                "decisions": [d.record() for d in self.decisions]}


@dataclass(frozen=True)
class DrainEvent:
    """The ``drain`` event: who left at which step and why, the notice's times (``noticed_at`` on the workers'
    clocks), how the run re-formed without them (None: it stopped), and the seconds from the notice to the
    first step committed without them (None until then)."""

    step: int
    reason: str
    workers: tuple[str, ...]
    why: tuple[str, ...]
    noticed_at: float
    notice_to_boundary_s: float
    deadline_s: Optional[float]
    reformed: Optional[Reformed] = None
    notice_to_step_s: Optional[float] = None

    def record(self) -> dict:
        """The event's row in metrics.jsonl."""
        row = {"event": "drain", "step": self.step, "reason": self.reason, "workers": list(self.workers),
               "why": list(self.why), "noticed_at": self.noticed_at, "notice_to_boundary_s": self.notice_to_boundary_s,
               "deadline_s": self.deadline_s, **(self.reformed.record() if self.reformed is not None else {})}
        if self.notice_to_step_s is not None:
            row["notice_to_step_s"] = self.notice_to_step_s
        return row
