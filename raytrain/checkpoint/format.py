"""The checkpoint format: the names of its directories and files, its versions, and its manifest.

A checkpoint is a directory ``<dir>/step_<NNNNNNNN>/`` (``.<n>`` appended for a later save of the same
step) holding one file per stage (``stage-<s>.pt``) or per shard of a sharded stage
(``stage-<s>-shard-<f>.pt``), and ``manifest.json``. ``read_manifest`` and ``shard_entries`` check a
manifest before anything trusts what it lists.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

import raytrain.checkpoint.storage as storage
from raytrain.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 5
"""5: the manifest records the sha256 of its own content (``manifest_sha256``), checked on every read;
4 (still read): shards may hold boxes of tensors (``slices``: a tensor-parallel worker's column and row slices);
3 (still read): each shard's ``sha256`` is recorded; 2 (still read): shards may hold row slices (``rows``); 1 (still
read): whole tensors only. Formats 1 and 2 record sizes alone, and only sizes are checked for them."""
READABLE_FORMATS = (1, 2, 3, 4, 5)
CHECKSUM = "sha256"
"""The manifest's checksum per file: hashlib's sha256 (SHA-NI: 0.92 GB/s here, blake2b 0.47 GB/s)."""
SELF_CHECKSUM = "manifest_sha256"
"""The manifest's own checksum: sha256 of its other fields as canonical JSON (``manifest_digest``). Like the
files' checksums it catches damage and hand edits that forget it, not tampering (a forger recomputes it)."""
LINEAGE_FILE = "lineage.txt"
"""Written first into each save's directory: the lineage of the run saving, so that pruning can tell its
own unfinished saves (no manifest yet) from another run's."""
STEP_DIR = re.compile(r"^step_(\d{8})(?:\.(\d+))?$")
"""A save's directory name: its step, and the attempt (none for the first save of that step)."""
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def step_dir(base: str, step: int) -> str:
    """The first name a checkpoint of ``step`` gets (later saves of the same step: ``new_step_dir``)."""
    return storage.join_uri(base, f"step_{step:08d}")


def shard_name(stage: int, part: Optional[int] = None) -> str:
    """A stage's file, or the file of shard ``part`` of a sharded stage."""
    return f"stage-{stage}.pt" if part is None else f"stage-{stage}-shard-{part}.pt"


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    """A checkpoint's manifest, checked to be one: a JSON object of a readable format with its step and shards."""
    where = storage.join_uri(ckpt_dir, MANIFEST)
    raw = storage.read_bytes(where)
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # JSONDecodeError; UnicodeDecodeError for binary junk
        raise CheckpointError(f"{where} is not valid JSON ({e}): the checkpoint is damaged") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where} is not a JSON object: the checkpoint is damaged")
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{where}: unsupported checkpoint format {manifest.get('format')!r} (this raytrain "
                              f"reads formats {', '.join(map(str, READABLE_FORMATS))})")
    lacking = [key for key, kind in (("step", int), ("shards", list)) if not isinstance(manifest.get(key), kind)]
    if lacking:
        raise CheckpointError(f"{where} lacks its {' and '.join(lacking)}: the checkpoint is damaged")
    if manifest["format"] >= 5 and manifest.get(SELF_CHECKSUM) != manifest_digest(manifest):
        raise CheckpointError(f"{where} does not match its own {SELF_CHECKSUM}: it was edited or damaged after it was "
                              "published; resume from another checkpoint")
    return manifest


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of ``manifest``'s fields but SELF_CHECKSUM, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_entries(ckpt_dir: str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's shard entries, each checked to name a file of its own directory with the size (and,
    from format 3, the sha256) that the loaders compare the file with."""
    where = storage.join_uri(ckpt_dir, MANIFEST)
    need = {"file": str, "bytes": int, **({CHECKSUM: str} if manifest["format"] >= 3 else {})}
    if not manifest["shards"]:
        raise CheckpointError(f"{where} lists no shard files: the checkpoint is damaged")
    seen: set[str] = set()
    for entry in manifest["shards"]:
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), kind) for k, kind in need.items()):
            raise CheckpointError(f"{where}: the shard entry {str(entry)[:80]} lacks its {', '.join(need)}: "
                                  "the manifest is damaged")
        name = entry["file"]
        if not _PLAIN_NAME.match(name) or name == MANIFEST or name in seen:
            raise CheckpointError(f"{where} lists {name[:80]!r}, not a file of its own directory (or listed "
                                  "twice): the manifest is damaged or forged")
        seen.add(name)
    return manifest["shards"]
