"""A stage's parameters and optimizer state, by global parameter name: broadcast, shards, digest.

What a worker hands to a new peer (``broadcast``), writes to and reads from checkpoints (``shard``,
``load``), and what must be identical on every replica of a stage (``digest``). A sharded stage's
worker holds rows of each parameter (``rows``); its peer in another replica holds the same rows.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from raytrain import checkpoint


class StageState:
    """Views of one stage's parameters (in module order, with their global names) and its optimizer."""

    def __init__(self, names: list[str], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 device: torch.device, fused_optimizer: bool, rows: Optional[list[tuple[int, int, int]]] = None):
        """``params`` is read at every call (a sharded stage re-points its items each generation);
        ``rows`` are the (start, stop, total) rows of dim 0 of each that this worker owns, None when whole."""
        self.names, self.params, self.optimizer, self.device, self.rows = names, params, optimizer, device, rows
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

    def shard(self) -> dict[str, Any]:
        """Model and optimizer state keyed by global parameter name, on the CPU (a checkpoint shard),
        with the rows each tensor holds when this worker owns a row slice."""
        shard = {
            "model": {n: p.detach().cpu().clone() for n, p in zip(self.names, self.params)},
            "optim": checkpoint.optimizer_state_by_name(self.optimizer, self.names),
            "rng": torch.get_rng_state(),
        }
        if self.rows is not None:
            shard["rows"] = {n: list(r) for n, r in zip(self.names, self.rows)}
        return shard

    def load(self, ckpt_dir: str) -> int:
        """Take this stage's parameters and optimizer state (its rows of them, when sharded) from any
        layout's checkpoint; returns its step."""
        rows = self.rows or [None] * len(self.names)
        wanted = {n: None if r is None else tuple(r) for n, r in zip(self.names, rows)}
        state = checkpoint.load_rows(ckpt_dir, wanted)
        missing = [n for n in self.names if n not in state["model"]]
        if missing:
            raise checkpoint.CheckpointError(
                f"{ckpt_dir} lacks parameters {missing[:3]} of this model: was it written by another model config?"
            )
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                src = state["model"][name]
                if src.shape != p.shape:
                    raise checkpoint.CheckpointError(f"{ckpt_dir}: {name} has shape {tuple(src.shape)}, model has {tuple(p.shape)}")
                p.copy_(src)
        checkpoint.load_optimizer_state(self.optimizer, self.names, state["optim"])
        if state["rng"] is not None:
            torch.set_rng_state(state["rng"])
        return checkpoint.read_manifest(ckpt_dir)["step"]

    def digest(self, committed: int) -> str:
        """sha256 of ``committed`` and every parameter and optimizer tensor (name, dtype, shape, bytes),
        by sorted global name: equal on two workers exactly when they hold the same state. A fresh
        optimizer (no state yet) differs from one given zero state by a broadcast."""
        h = hashlib.sha256(f"committed {committed}\n".encode())
        optim = checkpoint.optimizer_state_by_name(self.optimizer, self.names)
        by_name = dict(zip(self.names, self.params))
        for name in sorted(by_name):
            _hash_tensor(h, name, by_name[name])
            for key in sorted(optim.get(name, {})):
                _hash_tensor(h, f"{name} {key}", optim[name][key])
        return h.hexdigest()


def all_finite(shard: dict[str, Any]) -> bool:
    """Whether every parameter and optimizer value of a shard is finite."""
    tensors = list(shard["model"].values()) + [t for state in shard["optim"].values() for t in state.values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _hash_tensor(h, label: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{label} {t.dtype} {tuple(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
