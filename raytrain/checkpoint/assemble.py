"""Pieces of named tensors from checkpoint shards, copied straight into the tensors that want them.

A shard file holds, per global parameter name, a piece of the whole tensor: all of it, its rows
``[start, stop)`` of dim 0 (``rows``: what an fsdp shard writes), or a box of it, one ``[start,
stop)`` per dim (``slices``: the column and row slices of tensor parallelism), or several boxes stacked
along the one dim they differ in (a tensor-parallel rank's part of a fused colwise weight: its rows of
each of q, k and v, along dim 0; of a mixture's packed experts, its gate and up features, along dim 1).
A reader wants, per name, its own rows of the whole (a sharded worker), its own boxes (a
tensor-parallel worker: ``Boxes``) or all of it (another layout, a plain process). Each
overlap of a piece with what is wanted is copied into the reader's destination tensor, the
parameter itself for a worker, so a load holds no copy of the state beyond the destinations: the
pieces stay in the memory-mapped file (page cache, not the process's own memory).

Coverage is checked at the end: the copied boxes of every tensor must tile what was wanted, with
no overlap, or the checkpoint is missing a shard or mixes layouts. A piece that is the whole tensor
(AdamW's scalar ``step``, kept whole in every shard) is taken once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

from raytrain.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, int], ...]
"""[start, stop) per dim of the whole tensor; () for a 0-dim tensor."""
Key = tuple[str, Optional[str]]
"""(global parameter name, None for the parameter itself or the optimizer state's key such as exp_avg)."""
Destination = Callable[[str, Optional[str], tuple[int, ...], "torch.dtype"], "torch.Tensor"]
"""(name, key, shape of the wanted part, the checkpoint's dtype) -> the tensor to copy that part into."""
Rows = Optional[tuple[int, int, int]]
"""(start, stop, total) of dim 0 that a reader holds of a parameter, or None for all of it."""


class Boxes(NamedTuple):
    """Boxes of a whole tensor of shape ``whole`` that a reader (or a piece) holds, stacked along
    ``stack_dim`` in its tensor in this order: a tensor-parallel rank's part of a fused colwise weight is
    one box per part."""

    boxes: tuple[Box, ...]
    whole: tuple[int, ...]


Wanted = Union[Rows, Boxes]
"""What a reader wants of a tensor: all of it (None), rows of dim 0, or boxes."""


def slices_entry(boxes: list[Box], whole: tuple[int, ...]) -> list:
    """A shard's ``slices`` entry for a piece made of ``boxes`` of a tensor shaped ``whole``: one box as
    ``[[start, stop, total] per dim]``, several (stacked along ``stack_dim``) as a list of those."""
    entries = [[[a, b, n] for (a, b), n in zip(box, whole)] for box in boxes]
    return entries[0] if len(entries) == 1 else entries


def slice_boxes(entry: list) -> Boxes:
    """The boxes and the whole shape a ``slices`` entry describes (either form of ``slices_entry``)."""
    several = bool(entry) and bool(entry[0]) and isinstance(entry[0][0], (list, tuple))
    entries = entry if several else [entry]
    boxes = tuple(tuple((int(a), int(b)) for a, b, _ in e) for e in entries)
    wholes = {tuple(int(t) for *_, t in e) for e in entries}
    if len(wholes) != 1 or any(len(box) != len(next(iter(wholes))) for box in boxes):
        raise CheckpointError(f"a slices entry {entry!r} names boxes of different tensors: the shard is damaged")
    return Boxes(boxes, wholes.pop())


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _overlap(x: Box, y: Box) -> Optional[Box]:
    """The box where ``x`` and ``y`` meet, None if they do not (an empty meeting counts as none)."""
    box = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return box if all(a < b for a, b in box) else None


def _index(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor that holds ``origin`` of the whole."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def stack_dim(boxes) -> int:
    """The dim along which a tensor holding several ``boxes`` of a whole stacks them: the one dim they
    differ in (0 for a single box, or boxes of no dims)."""
    differ = [d for d in range(len(boxes[0])) if len({box[d] for box in boxes}) > 1]
    return differ[0] if len(differ) == 1 else 0


def _stacked_shape(boxes) -> Optional[tuple[int, ...]]:
    """The shape of a tensor that stacks ``boxes`` along ``stack_dim`` (None if their sizes differ in another dim)."""
    dim, sizes = stack_dim(boxes), [tuple(b - a for a, b in box) for box in boxes]
    if any(s[d] != sizes[0][d] for s in sizes for d in range(len(s)) if d != dim):
        return None
    return tuple(sum(s[d] for s in sizes) if d == dim else sizes[0][d] for d in range(len(sizes[0])))


def _stacked(tensor: "torch.Tensor", boxes: tuple[Box, ...]) -> list[tuple[Box, "torch.Tensor"]]:
    """Each box with its part of ``tensor``, which stacks them along ``stack_dim`` in order."""
    if len(boxes) == 1:
        return [(boxes[0], tensor)]
    dim, parts, offset = stack_dim(boxes), [], 0
    for box in boxes:
        size = box[dim][1] - box[dim][0]
        parts.append((box, tensor.narrow(dim, offset, size)))
        offset += size
    return parts


def piece_parts(shard: dict[str, Any], name: str, tensor: "torch.Tensor") -> tuple[list[tuple[Box, Any]], tuple[int, ...]]:
    """Where a shard's tensor ``name`` sits in the whole tensor: each of its boxes with its part of the
    tensor, and the whole's shape."""
    shape = tuple(tensor.shape)
    slices = shard.get("slices", {}).get(name)
    rows = shard.get("rows", {}).get(name)
    if slices is not None:
        boxes, whole = slice_boxes(slices)
    elif rows is not None and len(shape) > 0:
        start, stop, total = (int(v) for v in rows)
        boxes, whole = (((start, stop), *((0, n) for n in shape[1:])),), (total, *shape[1:])
    else:
        boxes, whole = (tuple((0, n) for n in shape),), shape
    fits = all(0 <= a <= b <= t for box in boxes for (a, b), t in zip(box, whole))
    dims = {len(box) for box in boxes} == {len(whole)} == {len(shape)}
    stacked = _stacked_shape(boxes) if dims and (shape or len(boxes) == 1) else None
    if stacked != shape or not fits:
        raise CheckpointError(f"{name}: a piece of shape {shape} claims the boxes {list(boxes)} of a tensor shaped "
                              f"{whole}: the shard is damaged")
    return _stacked(tensor, boxes), whole


class Assembler:
    """Copies the wanted parts of named tensors from shards, one shard at a time, into destinations."""

    def __init__(self, wanted: Optional[dict[str, Wanted]], destination: Destination):
        """``wanted``: name -> what is wanted of it (None: all; rows of dim 0; ``Boxes``), for the names
        wanted (None: every name)."""
        self.wanted, self.destination = wanted, destination
        # key -> (each wanted box of the whole with its part of the destination, the destination)
        self.targets: dict[Key, tuple[list[tuple[Box, "torch.Tensor"]], "torch.Tensor"]] = {}
        self.copied: dict[Key, list[tuple[int, Box]]] = {}  # key -> (index of the wanted box, box copied)
        self.rng: Any = None

    def add(self, shard: dict[str, Any]) -> None:
        """Copy what is wanted of one shard (its tensors may be memory-mapped: none is kept)."""
        if self.rng is None:
            self.rng = shard.get("rng")
        for name, tensor in shard["model"].items():
            if self.wanted is not None and name not in self.wanted:
                continue
            parts, whole = piece_parts(shard, name, tensor)
            want = self._wanted_boxes(name, whole)
            self._copy((name, None), parts, whole, want, tensor.dtype)
            for key, value in shard["optim"].get(name, {}).items():  # AdamW: moments shaped as the parameter, a step
                if value.shape == tensor.shape:
                    self._copy((name, key), _stacked(value, tuple(b for b, _ in parts)), whole, want, value.dtype)
                else:
                    own = tuple(value.shape)
                    whole_box = tuple((0, n) for n in own)
                    self._copy((name, key), [(whole_box, value)], own, (whole_box,), value.dtype)

    def _wanted_boxes(self, name: str, whole: tuple[int, ...]) -> tuple[Box, ...]:
        wanted = self.wanted.get(name) if self.wanted is not None else None
        if wanted is None:
            return (tuple((0, n) for n in whole),)
        if isinstance(wanted, Boxes):
            if wanted.whole != whole:
                raise CheckpointError(f"{name} has shape {whole} in the checkpoint and {wanted.whole} in this "
                                      "model: was it written by another model config?")
            return wanted.boxes
        start, stop, total = wanted
        if not whole or total != whole[0]:
            raise CheckpointError(f"{name} has {whole[0] if whole else 0} rows in the checkpoint and {total} in this "
                                  "model: was it written by another model config?")
        return (((start, stop), *((0, n) for n in whole[1:])),)

    def _target(self, key: Key, want: tuple[Box, ...], dtype) -> list[tuple[Box, "torch.Tensor"]]:
        """The wanted boxes of ``key`` with their parts of its destination (made on first use)."""
        if key not in self.targets:
            shape = _stacked_shape(want) if want[0] else ()
            dest = self.destination(key[0], key[1], shape, dtype)
            self.targets[key] = (_stacked(dest, want) if want[0] else [(want[0], dest)], dest)
            self.copied[key] = []
        return self.targets[key][0]

    def _copy(self, key: Key, parts: list[tuple[Box, Any]], whole: tuple[int, ...], want: tuple[Box, ...],
              dtype) -> None:
        targets = self._target(key, want, dtype)
        everything = tuple((0, n) for n in whole)
        if [b for b, _ in parts] == [everything] and self._covered(key) == sum(_volume(b) for b, _ in targets):
            return  # a whole tensor again (AdamW's step in every shard): the first one is kept
        for box, piece in parts:
            for j, (wbox, dest) in enumerate(targets):
                meet = _overlap(box, wbox) if box else ()
                if meet is None:
                    continue  # a shard may hold none of what this reader wants
                dest[_index(meet, wbox)].copy_(piece[_index(meet, box)])
                self.copied[key].append((j, meet))

    def _covered(self, key: Key) -> int:
        return sum(_volume(b) for _, b in self.copied[key])

    def check(self, where: str) -> None:
        """Every wanted tensor was copied whole, each element once: else CheckpointError."""
        for key, (targets, _) in sorted(self.targets.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            for j, (wbox, _) in enumerate(targets):
                boxes = [b for i, b in self.copied[key] if i == j]
                twice = any(_overlap(x, y) for i, x in enumerate(boxes) for y in boxes[i + 1:] if x)
                if twice or sum(_volume(b) for b in boxes) != _volume(wbox):
                    name, part = key
                    rows = ", ".join(f"[{a}, {b})" for a, b in wbox)
                    raise CheckpointError(f"{where} holds pieces of {name} ({part or 'parameter'}) that do not cover "
                                          f"{rows} once: a shard file is missing or from another layout")

    def tensors(self) -> dict[str, Any]:
        """The destinations as a state: ``model`` name -> tensor, ``optim`` name -> key -> tensor."""
        model: dict[str, Any] = {}
        optim: dict[str, dict[str, Any]] = {}
        for (name, key), (_, dest) in sorted(self.targets.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            if key is None:
                model[name] = dest
            else:
                optim.setdefault(name, {})[key] = dest
        return {"model": model, "optim": optim}


def new_tensors(device: str = "cpu") -> Destination:
    """Destinations allocated as they are first needed: a plain process's whole tensors, or "meta" ones to check
    a checkpoint's coverage without reading its data."""
    import torch

    return lambda name, key, shape, dtype: torch.empty(shape, dtype=dtype, device=device)
