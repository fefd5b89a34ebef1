"""Saving a checkpoint: its directory, its shard files streamed out with their checksums, the manifest
that publishes it, and pruning.

A save writes into a directory no earlier save used (``new_step_dir``), marked with its run's lineage
before anything else; each worker streams its shard (``save_shard``), and the checkpoint exists once
``publish`` moved its manifest in place. Only the run that holds the directory prunes, after a publish.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from typing import Any, Optional

import raytrain.checkpoint.storage as storage
from raytrain.checkpoint.errors import CheckpointError, CheckpointWriteError
from raytrain.checkpoint.format import (CHECKSUM, FORMAT_VERSION, LINEAGE_FILE, MANIFEST, SELF_CHECKSUM, STEP_DIR,
                                       manifest_digest, shard_name)
from raytrain.checkpoint.listing import list_published


def new_step_dir(base: str, step: int, lineage: Optional[str] = None) -> str:
    """A directory for a new save of ``step`` that no earlier save (published or not) has used; with a
    ``lineage``, marked as that lineage's (LINEAGE_FILE) before anything else is written into it."""
    fs, path = storage.filesystem(base)
    taken = {info.base_name for info in storage.entries(fs, path)}
    name, attempt = f"step_{step:08d}", 0
    while (f"{name}.{attempt}" if attempt else name) in taken:
        attempt += 1
    ckpt_dir = storage.join_uri(base, f"{name}.{attempt}" if attempt else name)
    if lineage is not None:
        storage.write_bytes(storage.join_uri(ckpt_dir, LINEAGE_FILE), lineage.encode())
    return ckpt_dir


def new_lineage() -> str:
    """A lineage of its own, for a run that continues none."""
    return uuid.uuid4().hex[:16]


class _HashingWriter:
    """The file-like torch.save writes to: each piece is counted and hashed on its way to the output
    stream, so a shard is written and checksummed in one pass without an in-memory copy of the file."""

    def __init__(self, out):
        self.out, self.hash, self.size = out, hashlib.sha256(), 0
        self.error: Optional[OSError] = None
        """The output stream's first error (torch.save reports it as its own, without the errno)."""

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.hash.update(data)
        try:
            self.out.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.size += n
        return n

    def flush(self) -> None:
        self.out.flush()


def save_shard(ckpt_dir: str, stage: int, shard: dict[str, Any], part: Optional[int] = None) -> dict[str, Any]:
    """Stream one stage's shard (or shard ``part`` of its rows) into its file; returns what the manifest
    records of it: ``file``, ``bytes`` and ``sha256``."""
    import torch

    name = shard_name(stage, part)
    uri = storage.join_uri(ckpt_dir, name)
    fs, path = storage.filesystem(uri)
    out = None
    try:
        fs.create_dir(os.path.dirname(path), recursive=True)
        with fs.open_output_stream(path) as f:
            out = _HashingWriter(f)
            torch.save(shard, out)
    except (OSError, RuntimeError) as e:
        cause = out.error if out is not None and out.error is not None else e
        raise CheckpointWriteError(f"cannot write checkpoint file {uri}: {_reason(cause)}") from cause
    return {"file": name, "bytes": out.size, CHECKSUM: out.hash.hexdigest()}


def _reason(error: BaseException) -> str:
    """Why a write failed, in a person's words: the errno's name and text where the system gave one."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return "no space left on device (ENOSPC): free space there, or point checkpoint.dir at another filesystem"
    if isinstance(error, OSError) and error.errno is not None:
        return f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror}"
    return str(error).splitlines()[0][:300] if str(error) else type(error).__name__


def publish(ckpt_dir: str, manifest: dict[str, Any]) -> None:
    """Make the checkpoint visible: write the manifest to a temporary name, then move it in place.

    The manifest's ``seq`` orders it after every checkpoint already published beside it.
    """
    fs, path = storage.filesystem(ckpt_dir)
    base = ckpt_dir.rstrip("/").rsplit("/", 1)[0]
    seq = max((c.seq for c in list_published(base)), default=0) + 1
    tmp = storage.join_uri(path, MANIFEST + ".tmp")
    body = {"format": FORMAT_VERSION, "seq": seq, **manifest}
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps({**body, SELF_CHECKSUM: manifest_digest(body)}, indent=1).encode())
    fs.move(tmp, storage.join_uri(path, MANIFEST))


def prune(base: str, keep: int, lineage: Optional[str]) -> None:
    """Delete all but the newest ``keep`` published checkpoints of ``lineage``, and its unfinished saves.

    Only checkpoints whose manifest records ``lineage``, and saves without a manifest whose LINEAGE_FILE
    names it, are deleted (None: those that record none, as raytrain wrote before lineages): another
    lineage's are never touched, even by a run that shares ``base`` against the lease. The newest
    checkpoint of ``lineage`` whose values are all finite is never deleted, however old. Only the run that
    holds ``base`` (raytrain.driver.lease) prunes, after a publish, so none of its saves is in flight.
    """
    fs, path = storage.filesystem(base)
    every = list_published(base)
    published = {p.uri for p in every}
    own = [p for p in every if p.lineage == lineage]
    kept = {p.uri for p in own[-keep:]}
    finite = [p for p in own if p.finite]
    if finite:
        kept.add(finite[-1].uri)
    doomed = {p.uri for p in own} - kept
    for info in storage.entries(fs, path):
        uri = storage.join_uri(base, info.base_name)
        leftover = STEP_DIR.match(info.base_name) and uri not in published
        if uri in doomed or (leftover and _marked_lineage(uri) == lineage):
            fs.delete_dir(info.path)


def _marked_lineage(ckpt_dir: str) -> Optional[str]:
    """The lineage a save's directory was marked with when it began (None: unmarked)."""
    try:
        return storage.read_bytes(storage.join_uri(ckpt_dir, LINEAGE_FILE)).decode(errors="replace")
    except CheckpointError:
        return None
