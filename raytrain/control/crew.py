"""The run's workers as the coordinator's states use them: who is in the run (``Membership``), how to
reach them (a ``WorkerGroup``), the placements the run may still grow into, and the generation their
process groups form.

Every operation that changes who trains goes through here: starting the first workers, re-forming
the groups under a new generation, replacing the lost, admitting the started, reloading a checkpoint.
It knows nothing of steps, policies or metrics: the states decide, the crew carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from raytrain.config.layout import Layout
from raytrain.config.mesh import StoreAddress, place_of
from raytrain.control.membership import Member, Membership
from raytrain.control.protocol import SETUP_TIMEOUT_S, WorkerGroup, WorkersLost, lost_members, spawn_in_granted
from raytrain.data.order import even_shares
from raytrain.reports import StepReport

GRANT_AT_START_S = 1.0
"""How long the start waits for replicas beyond parallel.dp before starting without them."""


class ReplacementState(str, Enum):
    """Where a replacement started at a notice (``Crew.start_replacement``) is."""

    STARTING = "starting"
    """Its actor is not up yet."""
    UP = "up"
    """Its actor is up (or it was admitted among the spares): it can take its slot at the boundary."""
    FAILED = "failed"
    """It died while starting (or was restarted since, as another member): it will not take its slot."""


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one replica's workers go: its placement groups (one for the whole replica, or one per tp group,
    each of which Ray keeps on one node) and, for each of its slots in ``Membership.slots`` order, which group
    and bundle hosts it."""

    groups: tuple
    bundles: tuple[tuple[int, int], ...]
    """(index into ``groups``, bundle index) of each slot."""

    @classmethod
    def of(cls, placement: Any, slots: int, first_bundle: int = 0) -> "ReplicaPlacement":
        """``placement`` as it is (a ReplicaPlacement), or a replica's ``slots`` bundles from ``first_bundle``
        on in one placement group (a Tune trial's, a test's)."""
        if isinstance(placement, ReplicaPlacement):
            return placement
        return cls((placement,), tuple((0, first_bundle + i) for i in range(slots)))

    def where(self, slot: int) -> tuple[Any, int]:
        """(placement group, bundle) of slot ``slot``."""
        group, bundle = self.bundles[slot]
        return self.groups[group], bundle

    def ready(self) -> Any:
        """One token that resolves once every group of the replica is granted."""
        if len(self.groups) == 1:
            return self.groups[0].ready()
        import ray

        return ray.remote(num_cpus=0)(_granted).remote(*[g.ready() for g in self.groups])


def _granted(*ready) -> bool:
    return True


@dataclass(frozen=True)
class Reservation:
    """Where a run's workers start: ``replicas``, the starting replicas' placements (the driver reserved
    them, each placed by axis: raytrain.driver.placement), or else bundles ``first_bundle``.. of one
    ``placement`` (a Tune trial's); and ``growth``, one replica's placement (or placement group) each beyond
    parallel.dp that the cluster may grant later (the driver requested them)."""

    placement: Any = None
    first_bundle: int = 0
    growth: tuple = ()
    replicas: tuple = ()

    def starting(self, dp: int, slots: int) -> list[ReplicaPlacement]:
        """The placement of each of the ``dp`` starting replicas of ``slots`` workers."""
        if self.replicas:
            return [ReplicaPlacement.of(r, slots) for r in self.replicas]
        return [ReplicaPlacement.of(self.placement, slots, self.first_bundle + r * slots) for r in range(dp)]


class Crew:
    """The run's workers and every operation that changes who trains (the module's docstring): who is in
    the run (``membership``), how to reach them (``worker_group``), the generation they form."""

    def __init__(self, worker_group: WorkerGroup, layout: Layout, global_batch: int, faults: list[str],
                 extra_placements: tuple = ()):
        """``layout``: the configured one (its dp is the start's); ``extra_placements``: one placement
        group per replica beyond it, which the cluster may grant later (the driver requested them)."""
        self.worker_group = worker_group
        self.layout = layout
        self.global_batch = global_batch
        self.membership = Membership(layout.pp, fsdp=layout.fsdp, tp=layout.tp)
        self.faults = list(faults)
        """Fault-injection specs still to fire (elastic.faults), handed to every join."""
        slots = len(self.membership.slots)
        growth = [ReplicaPlacement.of(pg, slots) for pg in extra_placements]
        self.unused_placements = [(rp, rp.ready()) for rp in growth]
        self.store: Optional[StoreAddress] = None  # set by the coordinator's run: the driver hosts it
        self.generation = -1

    # --- starting -------------------------------------------------------------------------------

    def spawn_first(self, reservation: Reservation) -> None:
        """Start the configured replicas' workers where ``reservation`` places them, and those of the replicas
        beyond them that the cluster can hold now. They start in the background."""
        slots = self.membership.slots
        members = [self.worker_group.spawn(s, *replica.where(i), shard=f, tp=t)
                   for replica in reservation.starting(self.layout.dp, len(slots))
                   for i, (f, s, t) in enumerate(slots)]
        members += spawn_in_granted(self.worker_group, self.unused_placements, slots, timeout=GRANT_AT_START_S)
        self.membership.add_pending(members)

    def start(self, target_dp: int) -> list[int]:
        """Wait for the first workers and form the first replicas (up to ``target_dp``: the rest are
        standby spares); the replicas' pids. WorkersLost if one died while starting (the driver
        restarts the coordinator)."""
        members = list(self.membership.pending)
        for m in members:
            m.pid = self.worker_group.pid(m, SETUP_TIMEOUT_S)
            if m.pid is None:
                raise WorkersLost([m])
        self.membership.start(members, target_dp)
        return [m.pid for m in self.membership.members()]

    # --- generations ----------------------------------------------------------------------------

    def form_generation(self, step: int) -> None:
        """Re-form the process groups over the replicas and bring every member to ``step``
        (members behind take their slot's state from one that is at it)."""
        self.generation += 1
        mesh, ranked = self.membership.mesh(), self.membership.ranked()
        joined = self.worker_group.join(ranked, mesh, even_shares(self.global_batch, mesh.dp), self.store,
                                        self.generation, self.faults)
        for (_, m), report in zip(ranked, joined):
            m.node = report.node
        if any(m.committed != step for _, m in ranked):
            sources = self.membership.sources(step)
            assert len(sources) == len(self.membership.slots), "a slot without an up-to-date member must reload a checkpoint first"
            self.worker_group.sync_state([(m, sources[m.slot]) for _, m in ranked])
            self.membership.set_committed(step)

    def placement(self) -> dict[str, str]:
        """Which node each worker of the generation is on: its place (``replica 0 stage 1 tp 0``) -> the node."""
        mesh = self.membership.mesh()
        return {place_of(mesh.label(rank)): m.node for rank, m in self.membership.ranked()}

    def label(self) -> str:
        """The live grid's label: dp changes with repairs and growth."""
        return self.membership.mesh().grid_label

    # --- losses and replacements ------------------------------------------------------------------

    def replace(self, dead: list[Member], respawn: Optional[list[Member]] = None) -> None:
        """Drop the dead (their replicas leave the generation), start a replacement on the bundle of each
        of ``respawn`` (default: every one of them), and have the spares close their broken groups'
        connections now."""
        dead = list({id(m): m for m in dead}.values())  # a worker can be reported lost twice
        respawn = dead if respawn is None else respawn
        self.membership.drop_dead(dead)
        for m in dead:
            if m not in respawn:  # replaced elsewhere: a placement group of its own goes back (if it had one)
                self.worker_group.cancel_elsewhere(m)
        self.membership.add_pending([self.worker_group.spawn(m.stage, m.placement, m.bundle, shard=m.shard, tp=m.tp)
                                     for m in respawn])
        self.worker_group.send_leave(self.membership.spares)

    def replace_leaving_standbys(self, told: dict[int, str]) -> list[int]:
        """End the spares whose beats said they were told to leave (``told``: why, by beat id), each starting a
        worker in its place: on its bundle after a SIGTERM, in a placement group of its own when its node
        drains (its bundle is on that node); their pids (raytrain.control.drain.Drains.let_standbys_go)."""
        leaving = [m for m in self.membership.spares if m.beat_id in told]
        if not leaving:
            return []
        for m in leaving:
            self.worker_group.kill(m)
        same_bundle = [m for m in leaving if told[m.beat_id] != "node drain"]
        self.replace(leaving, respawn=same_bundle)
        self.membership.add_pending([self.worker_group.spawn_elsewhere(m.stage, shard=m.shard, tp=m.tp)
                                     for m in leaving if m not in same_bundle])
        return [m.pid for m in leaving]

    def standby_started(self) -> int:
        """Standby replicas the spares could form now."""
        return self.membership.formable() if self.membership.spares else 0

    def start_replacement(self, leaving: Member) -> Member:
        """Start a worker for ``leaving``'s slot in a placement group of its own while ``leaving`` still
        holds its bundle (it was told to leave); it waits in ``pending``."""
        replacement = self.worker_group.spawn_elsewhere(leaving.stage, shard=leaving.shard, tp=leaving.tp)
        self.membership.add_pending([replacement])
        return replacement

    def cancel_replacement(self, replacement: Member) -> None:
        """End a replacement started by ``start_replacement`` that is not needed (or not up in time), and
        any worker restarted in its place (its placement group goes)."""
        same_place = [m for m in self.membership.pending if m.placement is replacement.placement]
        for m in same_place:
            self.worker_group.kill(m)
        self.worker_group.cancel_elsewhere(replacement)
        self.membership.drop_dead([replacement, *same_place])

    def replacement_state(self, member: Member) -> ReplacementState:
        """Where a worker started by ``start_replacement`` is: starting, up or failed. It does not wait."""
        if member in self.membership.pending:
            if not self.worker_group.started([member], 0):
                return ReplacementState.STARTING
            member.pid = self.worker_group.pid(member, SETUP_TIMEOUT_S)  # it has started: no wait
            return ReplacementState.UP if member.pid is not None else ReplacementState.FAILED
        alive = any(m is member for m in self.membership.everyone())
        return ReplacementState.UP if alive else ReplacementState.FAILED

    def admit_started(self, wait_s: float, target_dp: int) -> None:
        """Move started replacements to the spares (restarting any that died while starting), and
        form replicas from spares up to ``target_dp``."""
        for m in self.worker_group.started(self.membership.pending, wait_s):
            m.pid = self.worker_group.pid(m, timeout=SETUP_TIMEOUT_S)
            if m.pid is None:
                self.membership.restart(m, self.worker_group.spawn(m.stage, m.placement, m.bundle, shard=m.shard, tp=m.tp))
            else:
                self.membership.admit([m])
        self.membership.fill_to(target_dp)

    def spawn_in_granted_placements(self) -> int:
        """Start a replica's workers in every extra placement the cluster granted since; how many workers."""
        granted = spawn_in_granted(self.worker_group, self.unused_placements, self.membership.slots, timeout=0)
        self.membership.add_pending(granted)
        return len(granted)

    def changing(self, target_dp: int) -> bool:
        """Whether a replica may join at the next step boundary: the run is below ``target_dp`` and a
        placement is not yet granted, a worker is starting or a spare waits (at the target, they are
        standby)."""
        membership = self.membership
        return membership.dp < target_dp and bool(self.unused_placements or membership.pending or membership.spares)

    # --- state ------------------------------------------------------------------------------------

    def roll_forward(self, step: int, reports: list[StepReport], lost: list[Member]) -> list[Member]:
        """Apply ``step`` on the live survivors that prepared but did not apply it; returns any that
        died meanwhile (the others' progress is recorded either way)."""
        by_rank = {r.rank: r for r in reports}
        behind = [m for rank, m in self.membership.ranked()
                  if rank in by_rank and by_rank[rank].committed == step and m not in lost]
        outcomes = self.worker_group.collect(behind, self.worker_group.send_commit_prepared(behind, step), SETUP_TIMEOUT_S)
        for o in outcomes:
            if o.value is not None:
                o.member.committed = o.value
        return lost_members(self.worker_group, outcomes)

    def skip(self, step: int) -> None:
        """Every member counts ``step`` as done without applying it."""
        members = self.membership.members()
        for m, committed in zip(members, self.worker_group.skip_step(members, step)):
            m.committed = committed

    def load(self, ckpt_dir: str, step: int) -> None:
        """Every member of the generation loads the checkpoint of ``step``."""
        self.worker_group.load(self.membership.members(), ckpt_dir)
        self.membership.set_committed(step)

    def digests(self) -> dict[str, str]:
        """``"replica:stage"`` (``"replica:shard:stage"`` when sharded, ``...:tp`` with tp) ``-> digest`` of every member's
        parameters and optimizer state (audits: the replicas of a slot must be identical, however many
        workers were lost on the way)."""
        ranked, mesh = self.membership.ranked(), self.membership.mesh()
        digests = self.worker_group.state_digest([m for _, m in ranked])
        return {mesh.label(rank): d for (rank, _), d in zip(ranked, digests)}

    def shutdown(self) -> None:
        for m in self.membership.everyone():
            self.worker_group.kill(m)
        self.membership.clear()
        self.worker_group.close()
