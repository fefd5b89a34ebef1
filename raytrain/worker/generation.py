"""A worker's place in one generation of the run: one frozen value, formed by ``join``.

Everything that depends on the membership (rank, neighbours, this stage's actions of the schedule, this worker's share
of the global batch, the process groups, the shape of the activations each of its chunks receives) is
fixed for a generation and changes only when the coordinator forms a new one. A worker holds it from
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
from raytrain.pipeline import checker, schedule
from raytrain.pipeline.actions import Action, Placement
from raytrain.worker import activations
from raytrain.worker.activations import Activation, TensorShape
from raytrain.worker.groups import Groups, init_groups

SHAPE_MSG_LEN = 64
"""Shape handshake: [is a tuple, tensors, then per tensor: ndim, dtype code, dims...], padded to this length."""
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.float64,
           torch.uint8, torch.int16, torch.int8]


@dataclass(frozen=True)
class ChunkPlace:
    """Where one of this worker's model chunks sits in the pipeline, and whom it talks to (one chunk, the
    whole stage, without virtual stages)."""

    stage: int
    """Its pipeline stage, of parallel.pp x parallel.virtual_stages."""
    is_first: bool
    """It takes the token ids (the first stage) ..."""
    is_last: bool
    """... or computes the loss (the last)."""
    prev_rank: Optional[int]
    """Global rank of the worker of the previous stage when that is another worker, else None."""
    next_rank: Optional[int]
    prev_chunk: Optional[int]
    """This worker's chunk that is the previous stage (a local hand-off), else None."""
    input_shapes: tuple[TensorShape, ...] = ()
    """Per-sample shape and dtype of each tensor of the activation it receives (the samples' inputs on the
    first stage)."""
    input_is_tuple: bool = False
    """Whether that activation is a tuple of tensors, not one tensor."""

    @property
    def input_tail(self) -> Optional[tuple]:
        """The per-sample shape of its input (a tuple of them for a tuple activation); None on the first stage."""
        if self.is_first:
            return None
        tails = tuple(k.tail for k in self.input_shapes)
        return tails if self.input_is_tuple else tails[0]


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
    """This worker holds the first pipeline stage (it reads the inputs) ..."""
    is_last: bool
    """... or the last (it reads the targets and reports the loss)."""
    placement: Placement
    """Which pipeline stage each worker's chunk is."""
    chunks: tuple[ChunkPlace, ...]
    """This worker's model chunks, in chunk order."""
    actions: tuple[Action, ...]
    """This worker's actions for every step."""
    split: frozenset[tuple[int, int]]
    """(chunk, micro-batch) of the backwards this worker splits (they have a W action)."""
    last_grad_action: int
    """Index in ``actions`` of the action that fills the step's last gradients: buckets reduce from then on."""
    chunk_last_grad_actions: tuple[int, ...]
    """Of each chunk, the index in ``actions`` of the action that fills its last gradients (a sharded chunk,
    an FSDP2 root of its own, reduce-scatters them in it)."""
    share: int
    """This worker's samples of each global batch: its replica's share, divided among its shards."""
    batch_offset: int
    """Where this worker's share starts within each global batch."""
    mb_bounds: tuple[tuple[int, int], ...]
    """[lo, hi) of each micro-batch within the share."""
    groups: Groups


ChunkOutput = Callable[[int, Activation], Activation]
"""(chunk, example input) -> that chunk's output, without gradients."""


def form_generation(cfg: Config, rank: int, mesh: Mesh, shares: list[int], store: StoreAddress, number: int,
                    chunk_output: ChunkOutput, device: torch.device, sample_inputs: TensorShape,
                    on_groups: Callable[[Groups], None] = lambda groups: None,
                    tie_workers: tuple[tuple[int, ...], ...] = ()) -> Generation:
    """Form generation ``number``'s process groups and learn the input shape of each of this worker's chunks
    (collective over every member). ``shares`` are the replicas' samples of the global batch; the shards of
    a replica divide its share. ``chunk_output`` runs a chunk's layers on an example input (no grad); it is
    given the generation's groups first (a sharded stage re-forms its FSDP wrapping on them).
    ``sample_inputs``: a sample's inputs, what the first stage takes; ``tie_workers``: the pipeline workers
    holding each parameter tied across stages (raytrain.worker.groups)."""
    replica, stage = mesh.coords(rank)
    shard, tp_index = mesh.shard(rank), mesh.tp_index(rank)
    par = cfg.parallel
    placement = Placement.of_schedule(par.schedule, mesh.pp, par.virtual_stages)
    backend = "nccl" if cfg.resources.use_gpu else "gloo"
    groups = init_groups(mesh, rank, store, number, backend, cfg.elastic.detect_timeout_s, tie_workers)
    on_groups(groups)
    def column_rank(worker: int) -> int:  # the rank of pipeline worker ``worker`` of this column
        return mesh.rank(replica=replica, shard=shard, stage=worker, tp=tp_index)

    places = [_place(placement, stage, chunk, column_rank) for chunk in range(placement.chunks)]
    chunks = _exchange_shapes(sample_inputs, places, chunk_output, device)
    actions = tuple(schedule.build_schedule(par.schedule, mesh.pp, par.microbatches, par.split_backward,
                                            par.virtual_stages)[stage])
    slices = data.even_shares(shares[replica], mesh.fsdp)
    return Generation(
        number=number, mesh=mesh, rank=rank, replica=replica, stage=stage, shard=shard, tp_index=tp_index,
        is_first=any(c.is_first for c in chunks), is_last=any(c.is_last for c in chunks),
        placement=placement, chunks=chunks,
        actions=actions, split=frozenset(checker.split_keys(list(actions))),
        last_grad_action=checker.last_gradient_action(list(actions)),
        chunk_last_grad_actions=tuple(checker.last_gradient_action(list(actions), chunk) for chunk in range(len(chunks))),
        share=slices[shard], batch_offset=sum(shares[:replica]) + sum(slices[:shard]),
        mb_bounds=tuple(data.microbatch_bounds(slices[shard], par.microbatches)),
        groups=groups,
    )


def _place(placement: Placement, worker: int, chunk: int, rank_of: Callable[[int], int]) -> ChunkPlace:
    """Chunk ``chunk`` of pipeline worker ``worker``: its stage and neighbours (``rank_of``: a worker's rank
    in this pipeline column)."""
    stage = placement.stage(worker, chunk)
    prev, after = placement.neighbour(worker, chunk, -1), placement.neighbour(worker, chunk, +1)
    return ChunkPlace(
        stage=stage, is_first=prev is None, is_last=after is None,
        prev_rank=rank_of(prev[0]) if prev is not None and prev[0] != worker else None,
        next_rank=rank_of(after[0]) if after is not None and after[0] != worker else None,
        prev_chunk=prev[1] if prev is not None and prev[0] == worker else None,
    )


def for_evaluation(gen: Generation) -> Generation:
    """The same place in the run with a forward-only schedule over the same micro-batches: no backward, no
    split backward, and no action arms the gradient buckets (``last_grad_action`` matches none)."""
    actions = tuple(schedule.forward_only(gen.mesh.pp, len(gen.mb_bounds), gen.placement)[gen.stage])
    return dataclasses.replace(gen, actions=actions, split=frozenset(), last_grad_action=-1,
                               chunk_last_grad_actions=(-1,) * len(gen.chunks))


def _exchange_shapes(sample_inputs: TensorShape, chunks: list[ChunkPlace], chunk_output: ChunkOutput,
                     device: torch.device) -> tuple[ChunkPlace, ...]:
    """Learn the per-sample shapes and dtypes of each chunk's input from the previous stage, and tell the
    next: chunk by chunk in pipeline order, a hand-off between two chunks of this worker without a message."""
    learned: dict[int, tuple[tuple[TensorShape, ...], bool]] = {}
    outputs: dict[int, Activation] = {}  # chunk -> its example output, for a local next chunk
    sends = []
    for c in sorted(range(len(chunks)), key=lambda c: chunks[c].stage):
        place = chunks[c]
        if place.is_first:
            kinds, is_tuple = (sample_inputs,), False
        elif place.prev_chunk is not None:
            example = outputs[place.prev_chunk]
            kinds, is_tuple = activations.shapes(example), isinstance(example, tuple)
        else:
            msg = torch.zeros(SHAPE_MSG_LEN, dtype=torch.long, device=device)
            dist.recv(msg, src=place.prev_rank)
            kinds, is_tuple = _decode_shapes(msg.tolist())
        learned[c] = kinds, is_tuple
        if not place.is_last:
            outputs[c] = out = chunk_output(c, activations.zeros(1, kinds, is_tuple, device))
            if place.next_rank is not None:
                msg = torch.tensor(_encode_shapes(out), dtype=torch.long, device=device)
                sends.append((dist.isend(msg, dst=place.next_rank), msg))
    for work, _ in sends:
        work.wait()
    return tuple(dataclasses.replace(place, input_shapes=learned[c][0], input_is_tuple=learned[c][1])
                 for c, place in enumerate(chunks))


def _encode_shapes(out: Activation) -> list[int]:
    """The handshake message of an activation (see SHAPE_MSG_LEN)."""
    kinds = activations.shapes(out)
    msg = [int(isinstance(out, tuple)), len(kinds)]
    for k in kinds:
        msg += [len(k.tail), _DTYPES.index(k.dtype), *k.tail]
    assert len(msg) <= SHAPE_MSG_LEN, f"an activation of {len(kinds)} tensors is too large to describe: {kinds}"
    return msg + [0] * (SHAPE_MSG_LEN - len(msg))


def _decode_shapes(msg: list[int]) -> tuple[tuple[TensorShape, ...], bool]:
    is_tuple, count, at, kinds = bool(msg[0]), msg[1], 2, []
    for _ in range(count):
        ndim, code = msg[at], msg[at + 1]
        kinds.append(TensorShape(tuple(msg[at + 2: at + 2 + ndim]), _DTYPES[code]))
        at += 2 + ndim
    return tuple(kinds), is_tuple
