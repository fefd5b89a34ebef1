"""Workers told to leave (a SIGTERM: raytrain.worker.drain), from the step reply that says so to the
step boundary where they go, and the ``drain`` event that reports it. The boundary is the end of
the step whose world-wide vote counted them (or, should the notice come after the vote, of the
next); a step sent ahead of it comes back skipped by every worker (steps.DrainBoundary).

At that boundary there are three moves: every worker is leaving, so the run saves and stops (exit
143, as a SIGTERM'd run: resume from the checkpoint); some slot would have no live copy without
them, so they save a checkpoint first, which the re-formed run then reloads (no step lost); else
the run re-forms without them at once (raytrain.control.repair.Repairs.draining).
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Optional

from raytrain.config.mesh import place_of
from raytrain.control.membership import Member, Membership
from raytrain.control.runstate import Draining
from raytrain.reports import DrainNotice, StepReport


class DrainMove(str, Enum):
    STOP = "stop"
    SAVE_FIRST = "save_first"
    REFORM = "reform"


class Drains:
    """The members whose replies said they were told to leave, until the boundary where they go; then
    the ``drain`` event, until the first step without them commits."""

    def __init__(self):
        self._noted: dict[int, tuple[Member, DrainNotice]] = {}
        self._event: Optional[dict] = None

    def __bool__(self) -> bool:
        return bool(self._noted)

    def note(self, reports: list[StepReport], team: Membership) -> None:
        """Remember the members whose step reply carries a notice (per step: nothing to do without one)."""
        if not any(r.draining is not None for r in reports):
            return
        by_rank = dict(team.ranked())
        for r in reports:
            if r.draining is not None and r.rank in by_rank:
                self._noted.setdefault(id(by_rank[r.rank]), (by_rank[r.rank], r.draining))

    def state(self) -> Draining:
        members, notices = zip(*self._noted.values())
        return Draining(tuple(members), tuple(notices))

    def gone(self, event: Optional[dict]) -> None:
        """They left; ``event`` goes out with the first step without them (None: the run stops)."""
        self._noted.clear()
        self._event = event

    def committed(self, reports: list[StepReport], team: Membership) -> Optional[dict]:
        """After a commit: note who its replies say was told to leave; returns the held ``drain`` event
        (if this is the first step without them), with the seconds from the notice to this commit."""
        self.note(reports, team)
        event, self._event = self._event, None
        if event is not None:
            event["notice_to_step_s"] = round(time.time() - event["noticed_at"], 3)
        return event


def next_move(state: Draining, team: Membership, checkpointed: bool) -> DrainMove:
    """What the boundary does with the leaving (``checkpointed``: the current step has a checkpoint)."""
    leaving = {id(m) for m in state.leaving}
    staying = [m for m in team.members() if id(m) not in leaving]
    if not staying:
        return DrainMove.STOP
    if {m.slot for m in staying} != set(team.slots) and not checkpointed:
        return DrainMove.SAVE_FIRST
    return DrainMove.REFORM


def drain_event(state: Draining, team: Membership, step: int, reason: str) -> dict:
    """The ``drain`` event: who leaves, why, how long the notice gave them, at which step."""
    mesh, leaving = team.mesh(), {id(m) for m in state.leaving}
    first = min(n.noticed_at for n in state.notices)
    deadlines = [n.deadline for n in state.notices if n.deadline is not None]
    return {"event": "drain", "step": step, "reason": reason,
            "workers": [place_of(mesh.label(rank)) for rank, m in team.ranked() if id(m) in leaving],
            "why": sorted({n.why for n in state.notices}), "noticed_at": first,
            "notice_to_boundary_s": round(time.time() - first, 3),
            "deadline_s": round(min(deadlines) - first, 3) if deadlines else None}
