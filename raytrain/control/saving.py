"""Checkpoints as the coordinator writes them: one member per slot saves its shard into a new
directory, then the manifest is published (atomic: a checkpoint without its manifest does not exist),
then old ones are pruned. Also the last save of a run that gives up, from whichever live workers
hold every slot's state at the committed step.
"""

from __future__ import annotations

from typing import Optional

from raytrain import checkpoint
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.control.membership import Member, Membership
from raytrain.control.protocol import WorkerGroup, WorkersLost
from raytrain.reports import ShardReport


def save_checkpoint(group: WorkerGroup, savers: list[Member], step: int, cfg: Config, mesh: Mesh,
                    stage_layers: list[list[int]]) -> str:
    """Have ``savers`` (one member per slot, in slot order) write their shards into a new directory under
    checkpoint.dir, publish its manifest and prune; returns the directory. WorkersLost if a saver died."""
    ckpt_dir = checkpoint.new_step_dir(cfg.checkpoint.dir, step)
    shards = group.save(savers, ckpt_dir)
    checkpoint.publish(ckpt_dir, manifest(step, shards, cfg, mesh, stage_layers))
    checkpoint.prune(cfg.checkpoint.dir, cfg.checkpoint.keep)
    return ckpt_dir


def manifest(step: int, shards: list[ShardReport], cfg: Config, mesh: Mesh, stage_layers: list[list[int]]) -> dict:
    """A checkpoint's manifest: its step, the layout it was saved from, its shards and the run's config."""
    return {
        "step": step, "samples_seen": step * cfg.train.global_batch,
        "finite": all(s.finite for s in shards),
        "layout": {"dp": mesh.dp, "fsdp": mesh.fsdp, "pp": mesh.pp, "stage_layers": stage_layers},
        "shards": [s.entry for s in shards], "config": cfg.to_dict(),
    }


def save_survivors(group: WorkerGroup, team: Membership, step: int, lost: tuple[Member, ...],
                   last_checkpoint: Optional[str], cfg: Config,
                   stage_layers: list[list[int]]) -> tuple[Optional[str], Optional[dict]]:
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
    holders = team.holders(step, excluding=list(lost))
    try:
        if holders is None:
            raise WorkersLost([])
        saved = save_checkpoint(group, holders, step, cfg, team.mesh().with_dp(1), stage_layers)
    except WorkersLost:
        return None, {"event": "not_saved", "step": step,
                      "reason": "no live worker holds some slot's state at this step (or one was lost saving)"}
    return saved, {"event": "checkpoint", "step": step, "path": saved,
                   "reason": "saved from the survivors before giving up"}
