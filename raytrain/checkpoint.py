"""Layout-independent, atomic checkpoints through ``pyarrow.fs`` (a local path or an object-store URI).

A checkpoint is a directory ``<dir>/step_<NNNNNNNN>/`` holding one shard per pipeline stage
(``stage-<s>.pt``: model parameters and AdamW state keyed by *global* parameter name) and
``manifest.json``, written last through a temporary name. A directory without a manifest is not a
checkpoint: a save killed half-way is invisible, and the previous checkpoint stays the latest.
Shards are loaded with ``torch.load(weights_only=True)``: a checkpoint is data, not code.
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Any, Optional

import pyarrow.fs as pafs

# torch is imported inside the functions that need it: the driver and the coordinator read
# manifests and publish checkpoints without paying for a torch import.

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


def _fs(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def _join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def step_dir(base: str, step: int) -> str:
    return _join(base, f"step_{step:08d}")


def shard_name(stage: int) -> str:
    return f"stage-{stage}.pt"


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = _fs(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(uri: str) -> bytes:
    fs, path = _fs(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint file {uri}: {e}") from e


def save_shard(ckpt_dir: str, stage: int, shard: dict[str, Any]) -> int:
    """Write one stage's shard; returns its size in bytes (recorded in the manifest)."""
    import torch

    buf = io.BytesIO()
    torch.save(shard, buf)
    data = buf.getvalue()
    write_bytes(_join(ckpt_dir, shard_name(stage)), data)
    return len(data)


def publish(ckpt_dir: str, manifest: dict[str, Any]) -> None:
    """Make the checkpoint visible: write the manifest to a temporary name, then move it in place."""
    fs, path = _fs(ckpt_dir)
    tmp = _join(path, MANIFEST + ".tmp")
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps({"format": FORMAT_VERSION, **manifest}, indent=1).encode())
    fs.move(tmp, _join(path, MANIFEST))


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    try:
        manifest = json.loads(read_bytes(_join(ckpt_dir, MANIFEST)))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{_join(ckpt_dir, MANIFEST)} is not valid JSON ({e})") from e
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt_dir}: unsupported checkpoint format {manifest.get('format')!r}")
    return manifest


def load_shards(ckpt_dir: str) -> list[dict[str, Any]]:
    """Every shard of a published checkpoint, each checked against the size in the manifest."""
    import torch

    manifest = read_manifest(ckpt_dir)
    shards = []
    for entry in manifest["shards"]:
        uri = _join(ckpt_dir, entry["file"])
        data = read_bytes(uri)
        if len(data) != entry["bytes"]:
            raise CheckpointError(f"{uri} has {len(data)} bytes, the manifest says {entry['bytes']}: truncated or replaced")
        try:
            shards.append(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))
        except Exception as e:  # torch raises several types for corrupt pickles/zips
            raise CheckpointError(f"{uri} is corrupt ({type(e).__name__}: {e})") from e
    return shards


def merged_state(ckpt_dir: str) -> dict[str, Any]:
    """Model, optimizer state and RNG of the whole model, keyed by global parameter name."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    rng = None
    for shard in load_shards(ckpt_dir):
        model.update(shard["model"])
        optim.update(shard["optim"])
        rng = shard.get("rng", rng) if rng is None else rng
    return {"model": model, "optim": optim, "rng": rng}


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Full model parameters by global name, whatever layout wrote them.

    ``path`` is a step directory or a checkpoint directory (its latest checkpoint is used). The keys
    match ``raytrain.model.full_model(cfg, seed).state_dict()``.
    """
    return merged_state(resolve(path))["model"]


def list_checkpoints(base: str) -> list[tuple[int, str]]:
    """Published checkpoints under ``base`` as (step, uri), oldest first."""
    fs, path = _fs(base)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    found = []
    for info in infos:
        match = _STEP_DIR.match(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            manifest = fs.get_file_info(_join(info.path, MANIFEST))
            if manifest.type == pafs.FileType.File:
                found.append((int(match.group(1)), _join(base, info.base_name)))
    return sorted(found)


def latest(base: str) -> Optional[str]:
    found = list_checkpoints(base)
    return found[-1][1] if found else None


def resolve(path: str) -> str:
    """A step directory as is; a checkpoint directory -> its latest published checkpoint."""
    fs, local = _fs(path)
    if fs.get_file_info(_join(local, MANIFEST)).type == pafs.FileType.File:
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"no published checkpoint at {path} (a checkpoint is a step_NNNNNNNN directory with a {MANIFEST})"
        )
    return found


def prune(base: str, keep: int) -> None:
    """Delete all but the newest ``keep`` published checkpoints, and unpublished leftovers older than them."""
    fs, path = _fs(base)
    published = list_checkpoints(base)
    if len(published) <= keep:
        return
    oldest_kept = published[-keep][0]
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        match = _STEP_DIR.match(info.base_name)
        if match and int(match.group(1)) < oldest_kept:
            fs.delete_dir(info.path)


# --- optimizer state by global name --------------------------------------------------------------


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW-style per-parameter state keyed by global parameter name (single param group)."""
    state = optimizer.state_dict()["state"]
    return {names[i]: {k: v.detach().cpu().clone() for k, v in st.items()} for i, st in state.items()}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], by_name: dict[str, dict[str, torch.Tensor]]
) -> None:
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) != len(names):
        raise CheckpointError(f"checkpoint has optimizer state for some parameters but not {missing[:3]}...")
    current = optimizer.state_dict()
    current["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    optimizer.load_state_dict(current)
