"""Which checkpoints a directory holds: those published (a manifest in place), in publication order.

"Latest" is the checkpoint published last (each manifest's ``seq``), whatever its step; a directory
without a manifest is a save that never finished, not a checkpoint. Readers ``resolve`` a path to one
checkpoint; writers number a new manifest after these and prune among them (raytrain.checkpoint.writing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs

import raytrain.checkpoint.storage as storage
from raytrain.checkpoint.errors import CheckpointError
from raytrain.checkpoint.format import MANIFEST, STEP_DIR, read_manifest


@dataclass(frozen=True)
class Published:
    """A published checkpoint as its directory listing and manifest describe it."""

    step: int
    uri: str
    seq: int
    """Publication order within its directory (0 for manifests written before raytrain recorded it)."""
    finite: bool
    """Every parameter and optimizer value was finite when it was saved."""
    lineage: Optional[str] = None
    """The chain of runs that wrote it (None for manifests written before raytrain recorded it)."""


def list_published(base: str) -> list[Published]:
    """Published checkpoints under ``base``, oldest publication first."""
    fs, path = storage.filesystem(base)
    found = []
    for info in storage.entries(fs, path):
        match = STEP_DIR.match(info.base_name)
        if not match or info.type != pafs.FileType.Directory:
            continue
        uri = storage.join_uri(base, info.base_name)
        try:
            manifest = read_manifest(uri)
        except CheckpointError:
            continue  # no manifest: a save that never finished, not a checkpoint
        attempt = int(match.group(2) or 0)
        found.append((manifest.get("seq", 0), int(match.group(1)), attempt,
                      Published(int(match.group(1)), uri, manifest.get("seq", 0), manifest.get("finite", True),
                                manifest.get("lineage"))))
    return [p for *_, p in sorted(found, key=lambda t: t[:3])]


def list_checkpoints(base: str) -> list[tuple[int, str]]:
    """Published checkpoints under ``base`` as (step, uri), oldest publication first."""
    return [(p.step, p.uri) for p in list_published(base)]


def latest(base: str) -> Optional[str]:
    """The checkpoint published last under ``base`` (None if there is none)."""
    found = list_published(base)
    return found[-1].uri if found else None


def latest_of(base: str, lineage: Optional[str]) -> Optional[str]:
    """The checkpoint of ``lineage`` published last under ``base`` (None if there is none)."""
    found = [p for p in list_published(base) if p.lineage == lineage]
    return found[-1].uri if found else None


def continued_lineage(ckpt_dir: str) -> Optional[str]:
    """The lineage that a run resumed from ``ckpt_dir`` (a published checkpoint) continues: the one it
    records when it is that lineage's newest checkpoint in its directory. None for an older one (the run
    forks from it: a lineage of its own, which never prunes the checkpoints after it) and for one that
    records no lineage."""
    lineage = read_manifest(ckpt_dir).get("lineage")
    if lineage is None:
        return None
    base, name = ckpt_dir.rstrip("/").rsplit("/", 1)
    newest = latest_of(base, lineage)
    return lineage if newest is not None and newest.rsplit("/", 1)[1] == name else None


def resolve(path: str) -> str:
    """A step directory as is; a checkpoint directory -> its latest published checkpoint."""
    fs, local = storage.filesystem(path)
    if fs.get_file_info(storage.join_uri(local, MANIFEST)).type == pafs.FileType.File:
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"no published checkpoint at {path} (a checkpoint is a step_NNNNNNNN directory with a {MANIFEST})"
        )
    return found
