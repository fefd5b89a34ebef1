"""A worker's place in one generation of the run: one frozen value, formed by ``join``.

Everything that depends on the membership (rank, neighbours, this stage's plan, this worker's share
of the global batch, the process groups, the shape of the activations this stage receives) is fixed
for a generation and changes only when the coordinator forms a new one. A worker holds it from
``join`` until it leaves; nothing in it is updated in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from raytrain import data
from raytrain.config import Config
from raytrain.config.mesh import Mesh, StoreAddress
from raytrain.pipeline import schedule
from raytrain.pipeline.schedule import Action
from raytrain.worker.groups import Groups, init_groups

# Shape handshake: [ndim, dtype code, dims...] padded to this length.
_SHAPE_MSG_LEN = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


@dataclass(frozen=True)
class Generation:
    """This worker's place in generation ``number`` (see the module docstring); built by ``form_generation``."""

    number: int
    mesh: Mesh
    rank: int
    replica: int
    stage: int
    shard: int
    """This worker's shard of its stage (0 unless parallel.fsdp > 1)."""
    tp_index: int
    """This worker's rank in its stage's tp group (0 unless parallel.tp > 1). The tp ranks of a column
    read the same samples and compute the same loss: only tp rank 0 reports them."""
    is_first: bool
    is_last: bool
    prev_rank: Optional[int]
    """Global rank of the previous stage of this pipeline column (None on the first stage)."""
    next_rank: Optional[int]
    plan: tuple[Action, ...]
    """This stage's actions for every step."""
    split_mbs: frozenset[int]
    """Micro-batches whose backward this stage splits (they have a W action)."""
    last_grad_action: int
    """Index in ``plan`` of the action that fills the step's last gradients: buckets reduce from then on."""
    share: int
    """This worker's samples of each global batch: its replica's share, divided among its shards."""
    batch_offset: int
    """Where this worker's share starts within each global batch."""
    mb_bounds: tuple[tuple[int, int], ...]
    """[lo, hi) of each micro-batch within the share."""
    groups: Groups
    input_tail: Optional[tuple[int, ...]]
    """Per-sample shape of the activation this stage receives (None on the first stage: token ids)."""
    input_dtype: Optional[torch.dtype]


def form_generation(cfg: Config, rank: int, mesh: Mesh, shares: list[int], store: StoreAddress, number: int,
                    stage_output: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                    on_groups: Callable[[Groups], None] = lambda groups: None) -> Generation:
    """Form generation ``number``'s process groups and learn this stage's input shape (collective over
    every member). ``shares`` are the replicas' samples of the global batch; the shards of a replica
    divide its share. ``stage_output`` runs this stage's layers on an example input (no grad); it is
    given the generation's groups first (a sharded stage re-forms its FSDP wrapping on them)."""
    replica, stage = mesh.coords(rank)
    shard, tp_index = mesh.shard(rank), mesh.tp_index(rank)
    is_first, is_last = stage == 0, stage == mesh.pp - 1
    backend = "nccl" if cfg.resources.use_gpu else "gloo"
    groups = init_groups(mesh, rank, store, number, backend, cfg.elastic.detect_timeout_s)
    prev_rank = None if is_first else mesh.rank(replica=replica, shard=shard, stage=stage - 1, tp=tp_index)
    next_rank = None if is_last else mesh.rank(replica=replica, shard=shard, stage=stage + 1, tp=tp_index)
    on_groups(groups)
    tail, dtype = _exchange_shapes(cfg.model.seq_len, prev_rank, next_rank, stage_output, device)
    par = cfg.parallel
    plan = tuple(schedule.build_plan(par.schedule, mesh.pp, par.microbatches, par.split_backward)[stage])
    slices = data.even_shares(shares[replica], mesh.fsdp)
    return Generation(
        number=number, mesh=mesh, rank=rank, replica=replica, stage=stage, shard=shard, tp_index=tp_index,
        is_first=is_first,
        is_last=is_last, prev_rank=prev_rank, next_rank=next_rank, plan=plan,
        split_mbs=frozenset(schedule.split_microbatches(list(plan))),
        last_grad_action=schedule.last_gradient_action(list(plan)),
        share=slices[shard], batch_offset=sum(shares[:replica]) + sum(slices[:shard]),
        mb_bounds=tuple(data.microbatch_bounds(slices[shard], par.microbatches)),
        groups=groups, input_tail=tail, input_dtype=dtype,
    )


def for_evaluation(gen: Generation) -> Generation:
    """The same place in the run with a forward-only plan over the same micro-batches: no backward, no
    split backward, and no action arms the gradient buckets (``last_grad_action`` matches none)."""
    plan = tuple(schedule.forward_only(gen.mesh.pp, len(gen.mb_bounds))[gen.stage])
    return dataclasses.replace(gen, plan=plan, split_mbs=frozenset(), last_grad_action=-1)


def _exchange_shapes(seq_len: int, prev_rank: Optional[int], next_rank: Optional[int],
                     stage_output: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
    """Learn the per-sample shape and dtype of this stage's input from the previous stage, and tell the next."""
    tail = dtype = None
    if prev_rank is None:
        example = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    else:
        msg = torch.zeros(_SHAPE_MSG_LEN, dtype=torch.long, device=device)
        dist.recv(msg, src=prev_rank)
        ndim, code = int(msg[0]), int(msg[1])
        tail, dtype = tuple(int(d) for d in msg[2 : 2 + ndim - 1]), _DTYPES[code]
        example = torch.zeros(1, *tail, dtype=dtype, device=device)
    if next_rank is not None:
        out = stage_output(example)
        msg = torch.zeros(_SHAPE_MSG_LEN, dtype=torch.long, device=device)
        msg[0], msg[1] = out.dim(), _DTYPES.index(out.dtype)
        msg[2 : 2 + out.dim() - 1] = torch.tensor(out.shape[1:])
        dist.send(msg, dst=next_rank)
    return tail, dtype
