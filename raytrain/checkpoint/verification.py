"""No checkpoint file is trusted before it is checked: against its manifest entry, then by a weights-only load.

The manifest records each file's size and sha256, computed as ``torch.save`` streams the file out
(raytrain.checkpoint.writing). Every load checks them in one streaming pass before it trusts the file
(``iter_shards``); ``verify`` checks a whole checkpoint without loading its tensors, which ``prepare``
does before any actor starts on a resume. Local files are then memory-mapped, so a loader holds no
second copy of a shard; an object-store file is copied to a local temporary file as it is hashed,
then memory-mapped the same way. Shards are loaded with ``torch.load(weights_only=True)``: a
checkpoint is data, not code, and a file that asks for more is refused without advice to load it
unsafely.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import tempfile
from typing import Any, Iterator, Optional

import pyarrow.fs as pafs

import raytrain.checkpoint.storage as storage
from raytrain.checkpoint.assemble import Assembler, new_tensors
from raytrain.checkpoint.errors import CheckpointError
from raytrain.checkpoint.format import CHECKSUM, MANIFEST, STEP_DIR, read_manifest, shard_entries

_CHUNK = 8 << 20
"""Bytes read at a time when hashing a file: memory stays bounded whatever the shard's size."""
_ZIP_MAGIC = b"PK\x03\x04"
"""What every file torch.save writes starts with; anything else is not a shard raytrain wrote."""


def iter_shards(ckpt_dir: str) -> Iterator[dict[str, Any]]:
    """Every shard of a published checkpoint, one at a time, each checked against its manifest entry (size,
    sha256) in a streaming pass before it is loaded, memory-mapped. A shard on an object store is copied
    into a local temporary file during that pass (one read of it, not two), so it is memory-mapped too:
    a reader never holds a whole shard in memory. The copy is deleted before the next shard's."""
    manifest = read_manifest(ckpt_dir)
    for entry in shard_entries(ckpt_dir, manifest):
        uri = storage.join_uri(ckpt_dir, entry["file"])
        fs, path = storage.filesystem(uri)
        if _local_path(fs, path) is not None:
            _check_file(fs, path, uri, entry)
            yield _load_shard(fs, path, uri)
            continue
        with tempfile.NamedTemporaryFile(prefix="raytrain-shard-", suffix=".pt") as staged:
            _check_file(fs, path, uri, entry, copy_to=staged)
            staged.flush()
            yield _load_shard(pafs.LocalFileSystem(), staged.name, uri)


def verify(ckpt_dir: str) -> dict[str, Any]:
    """Check a checkpoint before anything loads it, without loading its tensors: its manifest, every file it
    lists (size and sha256, streamed), each a weights-only torch file (its pickle read, its tensors put on
    "meta"), and their pieces tiling every tensor. Returns the manifest; a CheckpointError names the file."""
    manifest = read_manifest(ckpt_dir)
    check_consistent(ckpt_dir, manifest)
    pieces = Assembler(None, new_tensors("meta"))
    for entry in shard_entries(ckpt_dir, manifest):
        uri = storage.join_uri(ckpt_dir, entry["file"])
        fs, path = storage.filesystem(uri)
        _check_file(fs, path, uri, entry)
        pieces.add(_load_shard(fs, path, uri, device="meta"))
    pieces.check(ckpt_dir)
    return manifest


def _check_file(fs: pafs.FileSystem, path: str, uri: str, entry: dict[str, Any], copy_to=None) -> None:
    """One streaming pass over a shard file: its size and sha256 must be the manifest's, and it must be a
    torch zip archive. Memory stays at one chunk; ``copy_to`` (a binary file) gets the bytes as they pass."""
    digest, size, head = hashlib.sha256(), 0, b""
    try:
        with fs.open_input_stream(path) as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                head = head or chunk[:len(_ZIP_MAGIC)]
                if copy_to is not None:
                    copy_to.write(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"{uri} is missing (its manifest lists it): the checkpoint is incomplete") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {uri}: {e}") from e
    if size != entry["bytes"]:
        raise CheckpointError(f"{uri} has {size} bytes, the manifest says {entry['bytes']}: truncated or replaced")
    if CHECKSUM in entry and digest.hexdigest() != entry[CHECKSUM]:
        raise CheckpointError(f"{uri} does not match the sha256 its manifest records: corrupt or replaced")
    if head != _ZIP_MAGIC:
        raise CheckpointError(_refused(uri, "it is not a torch zip archive"))


def _refused(uri: str, reason: str) -> str:
    """The one message for a file that a weights-only load will not take: never advice to load it unsafely."""
    return (f"{uri} is refused as unsafe: it is not a raytrain checkpoint shard ({reason}); a checkpoint is "
            "data and is never loaded as code")


def _unsafe_reason(e: Exception) -> str:
    """torch's refusal cut to what the file asked for (torch's text suggests loading it unsafely)."""
    asked = re.search(r"GLOBAL ([\w.]{1,80})", str(e))
    return f"its pickle asks for {asked.group(1)}" if asked else "its pickle holds more than tensors"


def _local_path(fs: pafs.FileSystem, path: str) -> Optional[str]:
    """The path to memory-map when the file is on this machine's disk; None for an object store."""
    return path if isinstance(fs, pafs.LocalFileSystem) else None


def _load_shard(fs: pafs.FileSystem, path: str, uri: str, device: str = "cpu") -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a checked file: memory-mapped when local (no second copy: the
    tensors are the page cache), else from a random-access stream. On "meta" only its pickle is read."""
    import torch

    local = _local_path(fs, path)
    try:
        if local is not None:
            shard = torch.load(local, weights_only=True, mmap=device != "meta", map_location=device)
        else:
            with fs.open_input_file(path) as f:
                shard = torch.load(f, weights_only=True, map_location=device)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_refused(uri, _unsafe_reason(e))) from None
    except Exception as e:  # torch raises several types for a corrupt zip
        if "TorchScript" in str(e):
            raise CheckpointError(_refused(uri, "it is a TorchScript archive")) from None
        line = (str(e).strip().splitlines() or [""])[0]
        said = "" if "weights_only" in line or not line else f": {line[:200]}"
        raise CheckpointError(f"{uri} is corrupt ({type(e).__name__}{said})") from None
    _check_layout(uri, shard)
    return shard


def _check_layout(uri: str, shard: Any) -> None:
    """A shard is a dict whose ``model`` maps names to tensors and whose ``optim`` maps names to dicts of them."""
    import torch

    model, optim = (shard.get("model"), shard.get("optim", {})) if isinstance(shard, dict) else (None, None)
    ok = isinstance(model, dict) and all(isinstance(t, torch.Tensor) for t in model.values())
    ok = ok and isinstance(optim, dict) and all(
        isinstance(st, dict) and all(isinstance(t, torch.Tensor) for t in st.values()) for st in optim.values())
    if not ok:
        raise CheckpointError(f"{uri} is not a raytrain checkpoint shard (it holds no model tensors by name)")


_SHARD_FILE = re.compile(r"^stage-(\d+)(?:-shard-(\d+))?\.pt$")


def check_consistent(ckpt_dir: str, manifest: dict[str, Any]) -> None:
    """The manifest's fields must agree with each other and with its directory: its step with the
    directory's name, the samples it says were seen with step x train.global_batch, its layout's stage
    layers with one cover of the model's layers, and its files with its stages and parts. Fields it lacks
    (older formats) are not checked. A CheckpointError names the manifest and the contradiction."""
    where = storage.join_uri(ckpt_dir, MANIFEST)
    problems = _step_problems(ckpt_dir, manifest) + _layout_problems(manifest)
    if problems:
        raise CheckpointError(f"{where} contradicts itself: {problems[0]}; it was edited or damaged: resume from "
                              "another checkpoint")


def _step_problems(ckpt_dir: str, manifest: dict[str, Any]) -> list[str]:
    found, step = [], manifest["step"]
    named = STEP_DIR.match(ckpt_dir.rstrip("/").rsplit("/", 1)[-1])
    if named and int(named.group(1)) != step:
        found.append(f"its step {step} is not its directory's {int(named.group(1))}")
    batch = (manifest.get("config") or {}).get("train", {}).get("global_batch")
    seen = manifest.get("samples_seen")
    if isinstance(batch, int) and isinstance(seen, int) and seen != step * batch:
        found.append(f"samples_seen={seen} is not step {step} x train.global_batch={batch}")
    return found


def _layout_problems(manifest: dict[str, Any]) -> list[str]:
    layout = manifest.get("layout")
    if not isinstance(layout, dict) or not isinstance(layout.get("stage_layers"), list):
        return []
    stages, pp = layout["stage_layers"], layout.get("pp")
    found = [] if len(stages) == pp else [f"its layout has pp={pp} but {len(stages)} stages of layers"]
    layers = sorted(i for worker in stages for i in _layer_ids(worker))
    if layers != list(range(len(layers))):
        found.append("its stages' layers are not each of the model's layers once")
    parallel = (manifest.get("config") or {}).get("parallel", {})
    found += [f"its layout has {k}={layout.get(k)}, its config parallel.{k}={parallel.get(k)}"
              for k in ("pp", "fsdp", "tp") if k in parallel and parallel.get(k) != layout.get(k)]
    parts = (layout.get("fsdp") or 1) * (layout.get("tp") or 1)
    for entry in manifest["shards"]:
        named = _SHARD_FILE.match(entry["file"])
        if named is None or int(named.group(1)) >= len(stages) or int(named.group(2) or 0) >= parts:
            found.append(f"it lists {entry['file']!r}, which no stage and part of its layout writes")
    return found


def _layer_ids(worker: list) -> list[int]:
    """A pipeline worker's layer ids: per model chunk since virtual stages, one flat list in older manifests."""
    return [i for chunk in worker for i in (chunk if isinstance(chunk, list) else [chunk])]
