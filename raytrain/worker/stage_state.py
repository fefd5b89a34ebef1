"""A stage's parameters, buffers and optimizer state, by global parameter name: broadcast, shards, digest.

What a worker hands to a new peer (``broadcast``), writes to and reads from checkpoints (``shard``,
``load``), and what must be identical on every replica of a stage (``digest``). A sharded stage's
worker holds rows of each parameter (``rows``), a tensor-parallel one boxes of it (``slices``); its peer
in another replica holds the same part.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from raytrain import checkpoint
from raytrain.worker.gradsync import all_reduce_flat


class StageBuffers:
    """A stage's buffers that are state (batch norm's running statistics), by global name: checkpointed (by
    one worker of the stage: every shard and tp rank holds them whole), handed to new peers, averaged over
    the data-parallel replicas after every step so that they stay identical, and put back when a step is
    tried again."""

    def __init__(self, names: list[Optional[str]], buffers: list[torch.Tensor], writes: bool):
        """``buffers`` is read at every call (a sharded stage re-points its items each generation); ``names``
        the global name of each, None for one that is not state; ``writes``: this worker saves them."""
        self._names, self._buffers, self.writes = names, buffers, writes
        self._before: Optional[tuple[int, list[torch.Tensor]]] = None  # (step, values) from its first attempt

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, b) for n, b in zip(self._names, self._buffers) if n is not None]

    def broadcast(self, src_rank: int, group) -> None:
        for _, b in self.items():
            dist.broadcast(b, src=src_rank, group=group)

    def average(self, groups) -> None:
        """Average the floating ones over each of ``groups`` (the dp and fsdp groups: every replica and shard
        of the stage saw its own samples); one collective over each, however many buffers (a ResNet-50 has
        106)."""
        floating = [b for _, b in self.items() if b.is_floating_point()]
        for group in groups:
            if group is None or not floating:
                continue
            all_reduce_flat(floating, group)
            size = dist.get_world_size(group)
            for b in floating:
                b.div_(size)

    def before_step(self, step: int) -> None:
        """Keep their values at a step's first attempt; put them back at another attempt of the same step
        (its forward already moved them once)."""
        if self._before is not None and self._before[0] == step:
            with torch.no_grad():
                for (_, b), value in zip(self.items(), self._before[1]):
                    b.copy_(value)
        elif self.items():
            self._before = (step, [b.detach().clone() for _, b in self.items()])


class StageState:
    """Views of one stage's parameters (in module order, with their global names), its buffers that are
    state, and its optimizer."""

    def __init__(self, names: list[str], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 device: torch.device, fused_optimizer: bool, rows: Optional[list[tuple[int, int, int]]] = None,
                 slices: Optional[list[list]] = None, written: Optional[list[bool]] = None,
                 buffers: Optional[StageBuffers] = None):
        """``params`` is read at every call (a sharded stage re-points its items each generation);
        ``rows`` are the (start, stop, total) rows of dim 0 of each that this worker owns, None when whole;
        ``slices`` the checkpoint's ``slices`` entry of each (raytrain.checkpoint.assemble: the boxes of it,
        stacked along one dim, that a tensor-parallel worker holds), None when not tensor-parallel; ``written``:
        which parameters this worker's checkpoint shard holds (None: all). A tp rank other than 0 leaves out
        those every tp rank holds the same part of: rank 0 writes them, so no piece is in two files."""
        self.names, self.params, self.optimizer, self.device, self.rows = names, params, optimizer, device, rows
        self.slices, self.written = slices, written
        self.buffers = buffers or StageBuffers([], [], False)
        self._step_device = device if fused_optimizer else torch.device("cpu")  # where AdamW keeps ``step``

    def broadcast(self, src_rank: int, group, committed: int) -> int:
        """Broadcast parameters, optimizer state and the step count from ``src_rank`` in ``group``
        (collective over it); returns the source's step count."""
        self._ensure_optimizer_state()
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=src_rank, group=group)
                state = self.optimizer.state[p]
                for key in sorted(state):
                    self._broadcast_(state[key], src_rank, group)
            self.buffers.broadcast(src_rank, group)
            count = torch.tensor([committed], dtype=torch.long, device=self.device)
            dist.broadcast(count, src=src_rank, group=group)
        return int(count)

    def _broadcast_(self, tensor: torch.Tensor, src_rank: int, group) -> None:
        """Broadcast in place; a tensor off the device (AdamW keeps ``step`` on the CPU unless fused)
        travels as a device copy, since NCCL only moves device memory."""
        if tensor.device == self.device:
            dist.broadcast(tensor, src=src_rank, group=group)
        else:
            on_device = tensor.to(self.device)
            dist.broadcast(on_device, src=src_rank, group=group)
            tensor.copy_(on_device)

    def _ensure_optimizer_state(self) -> None:
        """Give a fresh optimizer AdamW's state tensors so a broadcast can fill them in place."""
        for p in self.params:
            if not self.optimizer.state[p]:
                self.optimizer.state[p].update(step=torch.zeros((), dtype=torch.float32, device=self._step_device),
                                               exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def shard(self, copy: bool = False) -> dict[str, Any]:
        """Model and optimizer state keyed by global parameter name (a checkpoint shard), with the rows each
        tensor holds when this worker owns a row slice. The tensors are the live ones (``copy``: snapshots
        on the CPU): torch.save streams a live tensor as is, or one at a time through the CPU if it is on a
        device, so a synchronous save costs no copy of the state."""
        take = _snapshot if copy else _as_saved
        mine = set(self.names) if self.written is None else {n for n, w in zip(self.names, self.written) if w}
        buffers = {n: take(b) for n, b in self.buffers.items()} if self.buffers.writes else {}
        shard = {
            "model": {**{n: take(p) for n, p in zip(self.names, self.params) if n in mine}, **buffers},
            "optim": {n: {k: take(v) for k, v in st.items()} for n, st in self._optimizer_state().items() if n in mine},
            "rng": torch.get_rng_state(),
        }
        if self.rows is not None:
            shard["rows"] = {n: list(r) for n, r in zip(self.names, self.rows) if n in mine}
        if self.slices is not None:
            shard["slices"] = {n: s for n, s in zip(self.names, self.slices) if n in mine}
        return shard

    def _optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's live state tensors by global parameter name (none for a fresh optimizer)."""
        return {n: dict(self.optimizer.state[p]) for n, p in zip(self.names, self.params) if self.optimizer.state[p]}

    def load(self, ckpt_dir: str) -> int:
        """Take this stage's parameters and optimizer state (its rows of them, when sharded) from any
        layout's checkpoint, copied file by file into the live tensors; returns its step."""
        if self.slices is not None:
            wanted = {n: checkpoint.slice_boxes(s) for n, s in zip(self.names, self.slices)}
        else:
            rows = self.rows or [None] * len(self.names)
            wanted = {n: None if r is None else tuple(r) for n, r in zip(self.names, rows)}
        wanted.update({n: None for n, _ in self.buffers.items()})  # whole on every worker
        with torch.no_grad():
            pieces = checkpoint.load_into(ckpt_dir, wanted, self._destination(ckpt_dir))
        loaded = pieces.tensors()
        missing = [n for n in [*self.names, *(n for n, _ in self.buffers.items())] if n not in loaded["model"]]
        if missing:
            raise checkpoint.CheckpointError(
                f"{ckpt_dir} lacks parameters {missing[:3]} of this model: was it written by another model config?"
            )
        without = [n for n in self.names if n not in loaded["optim"]]
        if without and len(without) != len(self.names):
            raise checkpoint.CheckpointError(
                f"{ckpt_dir} has optimizer state for some parameters but not for {without[:3]}: it was written by "
                "another model or is damaged; resume from another checkpoint")
        if pieces.rng is not None:
            torch.set_rng_state(pieces.rng)
        return checkpoint.read_manifest(ckpt_dir)["step"]

    def _destination(self, ckpt_dir: str):
        """Where a loaded piece goes: the parameter itself, or its optimizer state tensor (made on first use)."""
        by_name = {**dict(zip(self.names, self.params)), **dict(self.buffers.items())}

        def destination(name: str, key: Optional[str], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            p = by_name[name]
            if key is None:
                if shape != tuple(p.shape):
                    raise checkpoint.CheckpointError(f"{ckpt_dir}: {name} has shape {shape}, model has {tuple(p.shape)}")
                return p.data
            state = self.optimizer.state[p]
            if key not in state:  # AdamW's scalar step stays on the CPU unless fused; its moments are shaped as p
                state[key] = (torch.zeros(shape, dtype=torch.float32, device=self._step_device) if not shape
                              else torch.zeros(shape, dtype=p.dtype, device=p.device))
            if tuple(state[key].shape) != shape:
                raise checkpoint.CheckpointError(
                    f"{ckpt_dir}: the optimizer's {key} of {name} has shape {shape}, model's {tuple(state[key].shape)}")
            return state[key]

        return destination

    def digest(self, committed: int) -> str:
        """sha256 of ``committed`` and every parameter and optimizer tensor (name, dtype, shape, bytes),
        by sorted global name: equal on two workers exactly when they hold the same state. A fresh
        optimizer (no state yet) differs from one given zero state by a broadcast."""
        h = hashlib.sha256(f"committed {committed}\n".encode())
        optim = self._optimizer_state()
        by_name = {**dict(zip(self.names, self.params)), **dict(self.buffers.items())}
        for name in sorted(by_name):
            _hash_tensor(h, name, by_name[name])
            for key in sorted(optim.get(name, {})):
                _hash_tensor(h, f"{name} {key}", optim[name][key])
        return h.hexdigest()


def _as_saved(t: torch.Tensor) -> torch.Tensor:
    """A live tensor as torch.save may stream it: itself, unless it views part of a larger storage (torch.save
    writes whole storages), which is copied."""
    t = t.detach()
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous()
    return t if whole else t.clone()


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU that training can no longer change."""
    return t.detach().to("cpu", copy=True)


def all_finite(shard: dict[str, Any]) -> bool:
    """Whether every parameter and optimizer value of a shard is finite."""
    tensors = list(shard["model"].values()) + [t for state in shard["optim"].values() for t in state.values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _hash_tensor(h, label: str, t: torch.Tensor) -> None:
    """Hash a tensor's bytes in place (a copy only of a device or strided tensor, one at a time)."""
    t = t.detach().cpu().contiguous()
    h.update(f"{label} {t.dtype} {tuple(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
