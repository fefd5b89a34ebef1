"""Which data a run trains on, by content: a cheap fingerprint of each file (``fingerprint``), the record of
a run's training data that each checkpoint's manifest keeps (``record``), and what changed between a
checkpoint's record and the data of a run resuming it (``change``).

A resume continues the sample order where its checkpoint stopped (raytrain.data.order): the same step
takes the same positions, which name the same samples only if the files, their order and their sample
counts are the ones the checkpoint's run numbered. So prepare compares them before any actor starts, and a
change (a file added, removed, resized or rewritten) is refused by name unless data.new_epoch_on_change
restarts the order as a new epoch over the new data.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

from raytrain.data import shards
from raytrain.data.samples import DataSource, Objects
from raytrain.data.shards import Files, Fingerprint

SCHEME = "edges-v1"
"""Names how ``fingerprint`` reads a file; fingerprints of another scheme are not compared by content."""
EDGE_BYTES = 1 << 20
"""Bytes hashed at each end of a file (a file of up to twice this is hashed whole)."""
PARQUET_MAGIC = b"PAR1"


def fingerprint(path: str) -> Fingerprint:
    """A data file's fingerprint: its size, and the SHA-256 of its first and last EDGE_BYTES (all of it when
    smaller than twice that) and, for Parquet, of its whole footer however long.

    Catches an append, a truncation, any change of size, and a same-size rewrite that touches either end:
    for Parquet the footer alone holds every row group's offsets, sizes, row counts and min/max statistics,
    so new rows, reordered row groups or another encoding show there. Misses a same-size change confined to
    the middle of a file that leaves its footer as it was (two equal-sized rows swapped inside a row group of
    a larger, uncompressed file), and never looks at the modification time (``touch`` and ``cp -p`` change
    nothing). Reads about 2 MiB per file; opens only a regular file (shards.regular).
    """
    local = shards.local_path(shards.regular(path))
    if local is not None:
        with open(local, "rb") as f:
            return _fingerprint(f, os.fstat(f.fileno()).st_size)
    fs, where = shards.filesystem(path)
    with fs.open_input_file(where) as f:
        return _fingerprint(f, f.size())


def _fingerprint(f, size: int) -> Fingerprint:
    """``fingerprint`` of an open binary file (Python's or pyarrow's: seek and read) of ``size`` bytes."""
    digest = hashlib.sha256(f"{SCHEME}|{size}|".encode())
    if size <= 2 * EDGE_BYTES:
        digest.update(f.read(size))
        return Fingerprint(size, f"{SCHEME}:{digest.hexdigest()}")
    digest.update(f.read(EDGE_BYTES))
    tail = EDGE_BYTES
    f.seek(size - 8)
    end = f.read(8)
    if end[4:] == PARQUET_MAGIC:  # the footer's length, then the magic: hash the whole footer
        tail = max(tail, min(size - EDGE_BYTES, int.from_bytes(end[:4], "little") + 8))
    f.seek(size - tail)
    digest.update(f.read(tail))
    return Fingerprint(size, f"{SCHEME}:{digest.hexdigest()}")


def fingerprints(paths: list[str]) -> tuple[Fingerprint, ...]:
    return tuple(fingerprint(p) for p in paths)


def check_no_copies(train: Files, held: Files) -> None:
    """No held-out file (data.eval_path) has a training file's content (the same size and fingerprint): a
    copy of training rows held out makes the held-out loss a training loss. (The same file by name or link:
    shards.check_held_out_apart.)"""
    where = dict(zip(train.fingerprints, train.paths))
    for path, print_ in zip(held.paths, held.fingerprints):
        if print_ in where:
            raise ValueError(f"data.eval_path file {path!r} has the content of data.path's {where[print_]!r} (a copy: "
                             "the same size and fingerprint), so the held-out loss would be measured on training rows; "
                             "hold out other rows, or use data.eval_fraction instead")


# --- the record a checkpoint keeps --------------------------------------------------------------


def record(source: DataSource, num_samples: int) -> dict:
    """What a checkpoint's manifest records of the run's training data (JSON): the samples the order permutes,
    and per file its path, size, samples and fingerprint; for a dataset object (the Python API's), its kind
    and length only, which is all there is to compare."""
    train = source.train
    if isinstance(train, Files):
        assert len(train.fingerprints) == len(train.paths), "prepare fingerprints every training file"
        return {"num_samples": num_samples, "files": [
            {"path": p, "bytes": f.size, "samples": n, "fingerprint": f.digest}
            for p, n, f in zip(train.paths, train.samples, train.fingerprints)]}
    kind = "torch Dataset" if isinstance(train, Objects) else "Ray Dataset"
    return {"num_samples": num_samples, "objects": kind, "samples": train.total}


def change(recorded: Any, current: dict) -> Optional[str]:
    """What differs between the training data a checkpoint records (``record``'s form) and a resume's: the
    files added, removed, resized or rewritten, or a count of samples; None when they are the same samples
    in the same numbering (files moved or renamed in the same order are the same data), and when the
    checkpoint records nothing (saved before raytrain recorded its data): nothing to compare."""
    if not isinstance(recorded, dict):
        return None
    by_content = all(_comparable(f.get("fingerprint")) for f in recorded.get("files") or [])
    if _numbering(recorded, by_content) == _numbering(current, by_content):
        return None
    if recorded.get("objects") != current.get("objects"):
        then, now = (f"a {r['objects']}" if r.get("objects") else "files" for r in (recorded, current))
        return f"the checkpoint's run trained on {then}, this one on {now}"
    files = _file_changes(recorded.get("files") or [], current.get("files") or [])
    if files:
        return f"{len(files)} file(s) changed: " + "; ".join(files[:3]) + (" ..." if len(files) > 3 else "")
    if recorded.get("samples") != current.get("samples"):
        return f"the dataset holds {current.get('samples')} samples, the checkpoint's held {recorded.get('samples')}"
    return (f"the checkpoint's run trained on {recorded.get('num_samples')} samples, this one on "
            f"{current['num_samples']} (data.eval_fraction holds out the rest)")


def _numbering(data: dict, by_content: bool) -> tuple:
    """What decides which sample each number names: the kind, the counts, and each file's size, samples and
    (``by_content``) fingerprint, in order."""
    files = tuple((f.get("bytes"), f.get("samples"), f.get("fingerprint") if by_content else None)
                  for f in data.get("files") or [])
    return data.get("objects"), data.get("samples"), data.get("num_samples"), files


def _comparable(digest: Any) -> Any:
    """A fingerprint's digest when this raytrain computes its scheme; None (only sizes compared) otherwise."""
    return digest if isinstance(digest, str) and digest.startswith(SCHEME + ":") else None


def _file_changes(then: list[dict], now: list[dict]) -> list[str]:
    """Each file added, removed, resized or rewritten between two records' file lists, by path."""
    before, after = {f.get("path"): f for f in then}, {f["path"]: f for f in now}
    found = []
    for path in sorted(set(before) | set(after), key=str):
        old, new = before.get(path), after.get(path)
        if old is None:
            found.append(f"{path!r} was added")
        elif new is None:
            found.append(f"{path!r} was removed")
        elif old.get("bytes") != new["bytes"]:
            found.append(f"{path!r} was resized ({old.get('bytes')} -> {new['bytes']} bytes)")
        elif _comparable(old.get("fingerprint")) not in (None, new["fingerprint"]):
            found.append(f"{path!r} was rewritten (the same size, other content)")
        elif old.get("samples") != new["samples"]:
            found.append(f"{path!r} holds {new['samples']} samples, the checkpoint's run counted {old.get('samples')}")
    return found
