"""Checkpoints as the coordinator writes them: one member per slot saves its shard into a new
directory, then the manifest is published (atomic: a checkpoint without its manifest does not exist),
then old ones are pruned. With checkpoint.async_save the savers write in the background while training
goes on, and ``Checkpoints`` publishes the save once every file is durable (or drops it, torn, when a
saver is lost first). Also the last save of a run that gives up, from whichever live workers hold every
slot's state at the committed step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.control.ledger import Ledger
from raytrain.control.membership import Member, Membership
from raytrain.control.protocol import StepFailed, WorkerGroup, WorkersLost
from raytrain.reports import ShardReport


def save_checkpoint(worker_group: WorkerGroup, savers: list[Member], step: int, cfg: Config, mesh: Mesh,
                    stage_layers: list[list[list[int]]], data: Optional[dict] = None) -> str:
    """Have ``savers`` (one member per slot, in slot order) write their shards into a new directory under
    checkpoint.dir, publish its manifest (recording ``data``: the run's training data) and prune; returns the
    directory. WorkersLost if a saver died."""
    ckpt_dir = checkpoint.new_step_dir(cfg.checkpoint.dir, step, cfg.checkpoint.lineage)
    shards = worker_group.save(savers, ckpt_dir)
    checkpoint.publish(ckpt_dir, manifest(step, shards, cfg, mesh, stage_layers, data))
    checkpoint.prune(cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.checkpoint.lineage)
    return ckpt_dir


@dataclass
class SaveInFlight:
    """A checkpoint whose shards ``savers`` write in the background (checkpoint.async_save) while training
    goes on. It is published only once every saver's file is durable: until then, and for ever if a saver
    is lost first, the previous checkpoint stays the latest."""

    ckpt_dir: str
    step: int
    savers: list[Member]
    mesh: Mesh
    started: float
    stall_s: float
    """The longest a saver's snapshot held up its training."""

    def written(self) -> Optional[list[ShardReport]]:
        """Every saver's shard once all are durable, as their step reports said (None while one writes);
        StepFailed for a write that failed, as a synchronous save's error fails the run."""
        done = [m.saved for m in self.savers]
        if any(d is None or d.ckpt_dir != self.ckpt_dir for d in done):
            return None
        failed = [d.error for d in done if d.error]
        if failed:  # the run's Checkpoints add where to resume from
            raise StepFailed(f"writing the checkpoint {self.ckpt_dir} in the background failed: {failed[0]}")
        return [d.shard for d in done]


def start_background_save(worker_group: WorkerGroup, savers: list[Member], step: int, cfg: Config, mesh: Mesh) -> SaveInFlight:
    """Have ``savers`` (one member per slot) snapshot their shards and write them into a new directory in the
    background; returns once every snapshot is taken. WorkersLost if a saver died."""
    ckpt_dir, t0 = checkpoint.new_step_dir(cfg.checkpoint.dir, step, cfg.checkpoint.lineage), time.perf_counter()
    stalls = worker_group.start_save(savers, ckpt_dir)
    return SaveInFlight(ckpt_dir, step, list(savers), mesh, t0, max(stalls))


def finish_background_save(worker_group: WorkerGroup, in_flight: SaveInFlight) -> None:
    """Wait for every saver's background write (``in_flight.written()`` then has their shards, or raises
    for one that failed). WorkersLost if a saver died."""
    for member, result in zip(in_flight.savers, worker_group.finish_save(in_flight.savers)):
        member.saved = result


def publish_background_save(in_flight: SaveInFlight, shards: list[ShardReport], cfg: Config,
                            stage_layers: list[list[list[int]]], data: Optional[dict] = None) -> str:
    """Publish a background save whose files are all durable (the manifest last, recording ``data``), then prune."""
    checkpoint.publish(in_flight.ckpt_dir, manifest(in_flight.step, shards, cfg, in_flight.mesh, stage_layers, data))
    checkpoint.prune(cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.checkpoint.lineage)
    return in_flight.ckpt_dir


class Checkpoints:
    """The run's saves, synchronous or in the background (at most one in flight), and their publication:
    each published checkpoint records ``data`` (the run's training data: raytrain.data.identity.record) and
    becomes the ledger's ``last_checkpoint`` and a ``checkpoint`` event."""

    def __init__(self, worker_group: WorkerGroup, ledger: Ledger, cfg: Config, stage_layers: list[list[list[int]]],
                 data: Optional[dict] = None):
        self.worker_group, self.ledger, self.cfg, self.stage_layers, self.data = worker_group, ledger, cfg, stage_layers, data
        self.in_flight: Optional[SaveInFlight] = None

    def save(self, savers: list[Member], step: int, mesh: Mesh) -> str:
        """Save and publish now (after the background save in flight); the directory. WorkersLost if a saver died;
        StepFailed naming the last good checkpoint if a file could not be written (a full disk)."""
        self.wait()
        t0 = time.perf_counter()
        try:
            ckpt_dir = save_checkpoint(self.worker_group, savers, step, self.cfg, mesh, self.stage_layers, self.data)
        except StepFailed as failed:
            raise StepFailed(f"{failed}; {self.last_good()}") from None
        seconds = time.perf_counter() - t0
        self._published(ckpt_dir, step, seconds, stall_s=seconds, background=False)
        return ckpt_dir

    def _written(self, in_flight: SaveInFlight) -> Optional[list[ShardReport]]:
        """``in_flight.written()``, its StepFailed naming where to resume from."""
        try:
            return in_flight.written()
        except StepFailed as failed:
            raise StepFailed(f"{failed}; {self.last_good()}") from None

    def last_good(self) -> str:
        """Where a run whose save failed can resume from, in words."""
        last = self.ledger.last_checkpoint
        return (f"the last good checkpoint is {last}: resume from it (checkpoint.resume=latest)" if last
                else "no checkpoint was published yet")

    def start(self, savers: list[Member], step: int, mesh: Mesh) -> None:
        """Start a background save (after the one in flight). WorkersLost if a saver died."""
        self.wait()
        self.in_flight = start_background_save(self.worker_group, savers, step, self.cfg, mesh)

    def save_before_giving_up(self, membership: Membership, lost: tuple[Member, ...]) -> Optional[str]:
        """For a run that gives up: keep the waiting step row, finish (or settle) the background save, and
        save what the survivors (not ``lost``) committed when no checkpoint has it; the directory saved,
        else None. The ledger's ``last_checkpoint`` is the latest either way."""
        ledger = self.ledger
        ledger.flush_row(None)  # a committed step's waiting row is kept however the run ends
        try:
            self.wait()
        except WorkersLost as also_lost:
            self.settle(tuple(also_lost.dead))
        saved, event = save_survivors(self.worker_group, membership, ledger.step, lost, ledger.last_checkpoint, self.cfg,
                                      self.stage_layers, self.data)
        if event is not None:
            ledger.emit(event)
        ledger.last_checkpoint = saved or ledger.last_checkpoint
        return saved

    def publish_if_written(self) -> None:
        """Publish the background save once every saver's step report says its file is durable."""
        in_flight = self.in_flight
        shards = self._written(in_flight) if in_flight is not None else None
        if shards is not None:
            self.in_flight = None
            publish_background_save(in_flight, shards, self.cfg, self.stage_layers, self.data)
            self._published(in_flight.ckpt_dir, in_flight.step, time.perf_counter() - in_flight.started,
                            stall_s=in_flight.stall_s, background=True)

    def wait(self) -> None:
        """Block until the background save in flight is written, and publish it. WorkersLost if a saver died."""
        in_flight = self.in_flight
        if in_flight is not None:
            t0 = time.perf_counter()
            if self._written(in_flight) is None:
                finish_background_save(self.worker_group, in_flight)
            in_flight.stall_s += time.perf_counter() - t0  # training waited for it
            self.publish_if_written()

    def settle(self, lost: tuple[Member, ...]) -> None:
        """Workers were lost while a background save was in flight: publish it if every file was already
        durable, else drop it when a saver is among the lost (the previous checkpoint stays the latest; a
        torn checkpoint is never published). Savers that live on finish their write."""
        in_flight = self.in_flight
        if in_flight is None or not any(m in lost for m in in_flight.savers):
            return
        if self._written(in_flight) is not None:
            self.publish_if_written()
            return
        self.in_flight = None
        self.ledger.emit({"event": "checkpoint_abandoned", "step": in_flight.step, "path": in_flight.ckpt_dir,
                          "reason": "a worker writing its shard in the background was lost",
                          "latest": self.ledger.last_checkpoint})

    def _published(self, ckpt_dir: str, step: int, seconds: float, stall_s: float, background: bool) -> None:
        self.ledger.last_checkpoint = ckpt_dir
        self.ledger.emit({"event": "checkpoint", "step": step, "path": ckpt_dir, "seconds": round(seconds, 3),
                          "stall_s": round(stall_s, 3), "async": background})


def manifest(step: int, shards: list[ShardReport], cfg: Config, mesh: Mesh, stage_layers: list[list[list[int]]],
             data: Optional[dict] = None) -> dict:
    """A checkpoint's manifest: its step, the run's lineage (checkpoint.lineage), the layout it was saved
    from, its shards, the run's config (whose model and data sections say which experiment it is) and its
    training data (``data``: files, sizes, samples and content fingerprints, which a resume compares with its
    own; left out when None)."""
    return {
        "step": step, "lineage": cfg.checkpoint.lineage, "samples_seen": step * cfg.train.global_batch,
        "finite": all(s.finite for s in shards),
        "layout": {"dp": mesh.dp, "fsdp": mesh.fsdp, "tp": mesh.tp, "pp": mesh.pp, "stage_layers": stage_layers},
        "shards": [s.entry for s in shards], "config": cfg.to_dict(), **({"data": data} if data is not None else {}),
    }


def save_survivors(worker_group: WorkerGroup, membership: Membership, step: int, lost: tuple[Member, ...],
                   last_checkpoint: Optional[str], cfg: Config, stage_layers: list[list[list[int]]],
                   data: Optional[dict] = None) -> tuple[Optional[str], Optional[dict]]:
    """Save committed ``step`` from live workers (not in ``lost``) that hold every slot's state at it,
    as a run that gives up does, so that its steps since ``last_checkpoint`` are not lost (saving
    needs no collective). Returns the published directory (None when not saved) and the event to record
    (None when the last checkpoint already has the step)."""
    try:
        saved_step = checkpoint.read_manifest(last_checkpoint)["step"] if last_checkpoint else 0
    except checkpoint.CheckpointError:
        saved_step = -1  # unreadable now: save anew
    if step <= saved_step:
        return None, None
    holders = membership.holders(step, excluding=list(lost))
    try:
        if holders is None:
            raise WorkersLost([])
        saved = save_checkpoint(worker_group, holders, step, cfg, membership.mesh().with_dp(1), stage_layers, data)
    except WorkersLost:
        return None, {"event": "not_saved", "step": step,
                      "reason": "no live worker holds some slot's state at this step (or one was lost saving)"}
    return saved, {"event": "checkpoint", "step": step, "path": saved,
                   "reason": "saved from the survivors before giving up"}
