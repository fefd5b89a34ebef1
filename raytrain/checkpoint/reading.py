"""Loading a checkpoint of any layout into any reader: a worker's own parameters and optimizer state,
or a plain process's whole model.

Every shard is checked before it is loaded (raytrain.checkpoint.verification.iter_shards) and its pieces
are copied straight into the tensors the reader wants (raytrain.checkpoint.assemble), one memory-mapped
file at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from raytrain.checkpoint.assemble import Assembler, Destination, Wanted, new_tensors
from raytrain.checkpoint.errors import CheckpointError
from raytrain.checkpoint.listing import resolve
from raytrain.checkpoint.verification import iter_shards

if TYPE_CHECKING:
    import torch


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


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], by_name: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Load AdamW state keyed by global parameter name into ``optimizer``, whose parameters are ``names`` in
    order: state for all of them or for none (a fresh optimizer), never for some."""
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) != len(names):
        raise CheckpointError(f"the checkpoint has optimizer state for some parameters but not for {missing[:3]}: it "
                              "was written by another model or is damaged; resume from another checkpoint")
    current = optimizer.state_dict()
    current["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    optimizer.load_state_dict(current)
