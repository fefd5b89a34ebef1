"""Layout-independent, atomic checkpoints through ``pyarrow.fs`` (a local path or an object-store URI).

A checkpoint is a directory ``<dir>/step_<NNNNNNNN>/`` holding one shard per pipeline stage
(``stage-<s>.pt``: model parameters and AdamW state keyed by *global* parameter name) and
``manifest.json``, written last through a temporary name. A sharded stage (parallel.fsdp > 1) is
written by each of its shards, each file holding its rows of every tensor
(``stage-<s>-shard-<f>.pt``, whose ``rows`` say ``[start, stop, total]`` of dim 0 per name): no
worker gathers the whole model to save it, and readers reassemble or re-cut the rows, so any
layout (or a plain process) loads any checkpoint. A directory without a manifest is not a
checkpoint: a save killed half-way is invisible, and the previous checkpoint stays the latest.
Shards are loaded with ``torch.load(weights_only=True)``: a checkpoint is data, not code.

The manifest records each file's size and sha256, computed as ``torch.save`` streams the file out
(it is never held whole in memory), and every load checks them in one streaming pass before it
trusts the file; ``verify`` checks a whole checkpoint without loading its tensors, which ``prepare``
does before any actor starts on a resume. Local files are then memory-mapped, so a loader holds no
second copy of a shard; an object-store file is copied to a local temporary file as it is hashed,
then memory-mapped the same way.

Why not torch.distributed.checkpoint (DCP, evaluated against torch 2.13): its save plans collectively
over one process group, but raytrain saves from whichever live workers hold each slot's state, with
no collective, exactly when groups are broken (a run that gives up saves its survivors'; a background
save outlives the generation it started in, whose groups a repair destroys); and its reader
unpickles ``.metadata`` with plain ``pickle.load``, so a forged checkpoint could run code, where every
raytrain file loads with ``weights_only``. What DCP would bring is here: streaming writes, background
saves, and resharding on load, rows and column boxes alike (raytrain.checkpoint.assemble).

A published checkpoint is immutable: every save writes into a directory that did not exist before,
so a second save of the same step (a resumed run, a save retried after a repair) goes to
``step_<NNNNNNNN>.<n>``. Each manifest carries a sequence number one above every manifest already
in the directory, so "latest" is the checkpoint published last, whatever its step.

Each manifest also names its *lineage*: the chain of runs that wrote it (a fresh run starts one, a run
resumed from the newest checkpoint of one continues it: ``continued_lineage``), and each save's directory
names it from the start (``LINEAGE_FILE``). Pruning deletes only its own lineage's checkpoints and
unfinished saves, so a run never deletes what another run wrote. Manifests written before lineages (none
recorded) stay readable; they belong to no run's lineage.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import tempfile
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import pyarrow.fs as pafs

from raytrain.checkpoint.assemble import Assembler, Boxes, Destination, Wanted, new_tensors, slice_boxes, slices_entry
from raytrain.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the driver and the coordinator read
# manifests and publish checkpoints without paying for a torch import.

MANIFEST = "manifest.json"
FORMAT_VERSION = 4
"""4: shards may hold boxes of tensors (``slices``: a tensor-parallel worker's column and row slices);
3 (still read): each shard's ``sha256`` is recorded; 2 (still read): shards may hold row slices (``rows``); 1 (still
read): whole tensors only. Formats 1 and 2 record sizes alone, and only sizes are checked for them."""
READABLE_FORMATS = (1, 2, 3, 4)
CHECKSUM = "sha256"
"""The manifest's checksum per file: hashlib's sha256 (SHA-NI: 0.92 GB/s here, blake2b 0.47 GB/s)."""
_CHUNK = 8 << 20
"""Bytes read at a time when hashing a file: memory stays bounded whatever the shard's size."""
_ZIP_MAGIC = b"PK\x03\x04"
"""What every file torch.save writes starts with; anything else is not a shard raytrain wrote."""
LINEAGE_FILE = "lineage.txt"
"""Written first into each save's directory: the lineage of the run saving, so that pruning can tell its
own unfinished saves (no manifest yet) from another run's."""
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_STEP_DIR = re.compile(r"^step_(\d{8})(?:\.(\d+))?$")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI, and the path within it."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def check_writable(base: str) -> None:
    """Create ``base`` and write and delete a probe file in it, or raise CheckpointError saying why.

    Run before any actor starts, so a bad checkpoint.dir fails in seconds, not at the first save.
    """
    try:
        fs, path = filesystem(base)
        fs.create_dir(path, recursive=True)
        probe = join_uri(path, f".probe-{os.getpid()}-{os.urandom(4).hex()}")
        with fs.open_output_stream(probe) as f:
            f.write(b"raytrain")
        fs.delete_file(probe)
    except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid (a ValueError) for an unknown scheme
        raise CheckpointError(f"cannot write checkpoints to {base} ({type(e).__name__}: {e})") from e


def step_dir(base: str, step: int) -> str:
    """The first name a checkpoint of ``step`` gets (later saves of the same step: ``new_step_dir``)."""
    return join_uri(base, f"step_{step:08d}")


def new_step_dir(base: str, step: int, lineage: Optional[str] = None) -> str:
    """A directory for a new save of ``step`` that no earlier save (published or not) has used; with a
    ``lineage``, marked as that lineage's (LINEAGE_FILE) before anything else is written into it."""
    fs, path = filesystem(base)
    taken = {info.base_name for info in _entries(fs, path)}
    name, attempt = f"step_{step:08d}", 0
    while (f"{name}.{attempt}" if attempt else name) in taken:
        attempt += 1
    ckpt_dir = join_uri(base, f"{name}.{attempt}" if attempt else name)
    if lineage is not None:
        write_bytes(join_uri(ckpt_dir, LINEAGE_FILE), lineage.encode())
    return ckpt_dir


def new_lineage() -> str:
    """A lineage of its own, for a run that continues none."""
    return uuid.uuid4().hex[:16]


def _entries(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []


def shard_name(stage: int, part: Optional[int] = None) -> str:
    """A stage's file, or the file of shard ``part`` of a sharded stage."""
    return f"stage-{stage}.pt" if part is None else f"stage-{stage}-shard-{part}.pt"


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = filesystem(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint file {uri}: {e}") from e


class _HashingWriter:
    """The file-like torch.save writes to: each piece is counted and hashed on its way to the output
    stream, so a shard is written and checksummed in one pass without an in-memory copy of the file."""

    def __init__(self, out):
        self.out, self.hash, self.size = out, hashlib.sha256(), 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.hash.update(data)
        self.out.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self.out.flush()


def save_shard(ckpt_dir: str, stage: int, shard: dict[str, Any], part: Optional[int] = None) -> dict[str, Any]:
    """Stream one stage's shard (or shard ``part`` of its rows) into its file; returns what the manifest
    records of it: ``file``, ``bytes`` and ``sha256``."""
    import torch

    name = shard_name(stage, part)
    fs, path = filesystem(join_uri(ckpt_dir, name))
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        out = _HashingWriter(f)
        torch.save(shard, out)
    return {"file": name, "bytes": out.size, CHECKSUM: out.hash.hexdigest()}


def publish(ckpt_dir: str, manifest: dict[str, Any]) -> None:
    """Make the checkpoint visible: write the manifest to a temporary name, then move it in place.

    The manifest's ``seq`` orders it after every checkpoint already published beside it.
    """
    fs, path = filesystem(ckpt_dir)
    base = ckpt_dir.rstrip("/").rsplit("/", 1)[0]
    seq = max((c.seq for c in list_published(base)), default=0) + 1
    tmp = join_uri(path, MANIFEST + ".tmp")
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps({"format": FORMAT_VERSION, "seq": seq, **manifest}, indent=1).encode())
    fs.move(tmp, join_uri(path, MANIFEST))


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    """A checkpoint's manifest, checked to be one: a JSON object of a readable format with its step and shards."""
    where = join_uri(ckpt_dir, MANIFEST)
    raw = read_bytes(where)
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
    return manifest


def shard_entries(ckpt_dir: str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's shard entries, each checked to name a file of its own directory with the size (and,
    from format 3, the sha256) that the loaders compare the file with."""
    where = join_uri(ckpt_dir, MANIFEST)
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


def iter_shards(ckpt_dir: str) -> Iterator[dict[str, Any]]:
    """Every shard of a published checkpoint, one at a time, each checked against its manifest entry (size,
    sha256) in a streaming pass before it is loaded, memory-mapped. A shard on an object store is copied
    into a local temporary file during that pass (one read of it, not two), so it is memory-mapped too:
    a reader never holds a whole shard in memory. The copy is deleted before the next shard's."""
    manifest = read_manifest(ckpt_dir)
    for entry in shard_entries(ckpt_dir, manifest):
        uri = join_uri(ckpt_dir, entry["file"])
        fs, path = filesystem(uri)
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
    pieces = Assembler(None, new_tensors("meta"))
    for entry in shard_entries(ckpt_dir, manifest):
        uri = join_uri(ckpt_dir, entry["file"])
        fs, path = filesystem(uri)
        _check_file(fs, path, uri, entry)
        pieces.add(_load_shard(fs, path, uri, device="meta"))
    pieces.check(ckpt_dir)
    return manifest


def load_shards(ckpt_dir: str) -> list[dict[str, Any]]:
    """Every shard of a published checkpoint, each checked against its manifest entry."""
    return list(iter_shards(ckpt_dir))


def load_into(ckpt_dir: str, wanted: Optional[dict[str, Wanted]], destination: Destination) -> Assembler:
    """Copy the parameters in ``wanted`` (all when None), each its rows [start, stop) of dim 0 or its
    ``Boxes`` (whole when None), and their optimizer state, from a checkpoint of any layout into the tensors ``destination``
    gives, one memory-mapped file at a time: a worker loads into its own parameters and holds no second
    copy. Returns the assembler (its ``tensors()``, ``rng``); pieces that do not tile what is wanted are a
    CheckpointError. A parameter missing from the checkpoint has no destination."""
    pieces = Assembler(wanted, destination)
    for shard in iter_shards(ckpt_dir):
        pieces.add(shard)
        del shard  # unmap the file before the next one is mapped
    pieces.check(ckpt_dir)
    return pieces


def merged_state(ckpt_dir: str) -> dict[str, Any]:
    """Model, optimizer state and RNG of the whole model, keyed by global parameter name (sharded tensors
    reassembled into new ones)."""
    pieces = load_into(ckpt_dir, None, new_tensors())
    return {**pieces.tensors(), "rng": pieces.rng}


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Full model parameters by global name, whatever layout wrote them.

    ``path`` is a step directory or a checkpoint directory (its latest checkpoint is used). The keys
    match ``raytrain.models.layers.full_model(cfg, seed).state_dict()``.
    """
    return merged_state(resolve(path))["model"]


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
    fs, path = filesystem(base)
    found = []
    for info in _entries(fs, path):
        match = _STEP_DIR.match(info.base_name)
        if not match or info.type != pafs.FileType.Directory:
            continue
        uri = join_uri(base, info.base_name)
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
    fs, local = filesystem(path)
    if fs.get_file_info(join_uri(local, MANIFEST)).type == pafs.FileType.File:
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"no published checkpoint at {path} (a checkpoint is a step_NNNNNNNN directory with a {MANIFEST})"
        )
    return found


def prune(base: str, keep: int, lineage: Optional[str]) -> None:
    """Delete all but the newest ``keep`` published checkpoints of ``lineage``, and its unfinished saves.

    Only checkpoints whose manifest records ``lineage``, and saves without a manifest whose LINEAGE_FILE
    names it, are deleted (None: those that record none, as raytrain wrote before lineages): another
    lineage's are never touched, even by a run that shares ``base`` against the lease. The newest
    checkpoint of ``lineage`` whose values are all finite is never deleted, however old. Only the run that
    holds ``base`` (raytrain.driver.lease) prunes, after a publish, so none of its saves is in flight.
    """
    fs, path = filesystem(base)
    every = list_published(base)
    published = {p.uri for p in every}
    own = [p for p in every if p.lineage == lineage]
    kept = {p.uri for p in own[-keep:]}
    finite = [p for p in own if p.finite]
    if finite:
        kept.add(finite[-1].uri)
    doomed = {p.uri for p in own} - kept
    for info in _entries(fs, path):
        uri = join_uri(base, info.base_name)
        leftover = _STEP_DIR.match(info.base_name) and uri not in published
        if uri in doomed or (leftover and _marked_lineage(uri) == lineage):
            fs.delete_dir(info.path)


def _marked_lineage(ckpt_dir: str) -> Optional[str]:
    """The lineage a save's directory was marked with when it began (None: unmarked)."""
    try:
        return read_bytes(join_uri(ckpt_dir, LINEAGE_FILE)).decode(errors="replace")
    except CheckpointError:
        return None


# --- optimizer state by global name --------------------------------------------------------------


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], by_name: dict[str, dict[str, torch.Tensor]]
) -> None:
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) != len(names):
        raise CheckpointError(f"the checkpoint has optimizer state for some parameters but not for {missing[:3]}: it "
                              "was written by another model or is damaged; resume from another checkpoint")
    current = optimizer.state_dict()
    current["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    optimizer.load_state_dict(current)
