"""How much memory one worker of a layout needs: the estimate the driver checks a run against before
any actor starts (raytrain.driver.memory) and that ``parallel.auto`` ranks layouts by.

Arithmetic on parameter counts and widths, no torch. The estimate of the fullest worker is:

- **state**: 16 bytes per parameter it owns (fp32 parameter, gradient and AdamW's two moments), its
  stage's parameters divided among its fsdp shards;
- **unsharded**: under fsdp, the largest layer's full parameters and gradients, which FSDP2 gathers
  for that layer's forward and backward (fp32, 8 bytes per parameter); with more than one micro-batch,
  also the whole stage's unsharded gradients, which FSDP2 accumulates until the last micro-batch's
  backward reduce-scatters them (4 bytes per parameter of the stage); where the pipeline splits
  backwards, every layer of the worker, gathered with its gradient from its first backward of the
  step until its reduction after the last weight half (8 bytes per parameter of the stage);
- **activations**: what backward needs of each micro-batch it holds at once (GPipe: all of them;
  1F1B: at most pp - stage; without a pipeline: one; with virtual stages the schedule's own peak of chunk
  activations, each counted at the worker's largest chunk), per transformer layer 18 fp32 values per token
  and unit of width (measured: experiments/activation_memory.py finds 14-18 for the built-in GPT; no
  seq_len x seq_len term, which scaled_dot_product_attention never keeps), or with activation checkpointing
  each layer's input plus one layer rebuilt in backward; the last stage adds its logits and their gradient.
  Not estimated for a model.factory model, whose layers raytrain does not know;
- **snapshot**: with checkpoint.async_save, the host copy of its parameters and moments that a background
  save writes while training goes on (12 bytes per parameter it owns);
- **device** (GPU runs only, ``device_costs``): the CUDA context and libraries' workspaces, NCCL's buffers
  when there are peers, with resources.bf16 a bf16 copy of every parameter its forward casts (2 bytes per
  parameter of its stage), and the caching allocator's slack over all of it;
- **process** (CPU runs only): the worker process itself, Python, Ray's core worker, torch and its libraries
  before any tensor, and the host allocator's slack over the tensors (fitted to the measured peaks of
  experiments/bench_memory.py and bench_scale.py: the estimate lands 0-15% above them).

It is an estimate, not a bound: experiments/bench_memory.py prints it beside each layout's measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain.pipeline.actions import Placement
from raytrain.pipeline.checker import peak_live_activations
from raytrain.pipeline.schedule import build_schedule

STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and AdamW's two moments."""
SNAPSHOT_BYTES_PER_PARAM = 12
"""fp32 parameter and AdamW's two moments, copied for a background save (checkpoint.async_save)."""
UNSHARDED_BYTES_PER_PARAM = 8
"""fp32 parameter and gradient of the layer FSDP2 has gathered."""
ACCUMULATED_GRAD_BYTES_PER_PARAM = 4
"""fp32 unsharded gradient FSDP2 holds between micro-batches (gradient sync only after the last)."""
ACTIVATION_VALUES_PER_TOKEN_WIDTH = 18
"""fp32 values a transformer layer leaves for backward per token and unit of width: measured 14-18 for the
built-in GPT (experiments/activation_memory.py). Korthikanti et al.'s 34 counts bytes of 2-byte activations."""
PROCESS_BYTES = 0.45 * 2**30
"""A CPU worker's process before any tensor: Python, Ray's core worker, torch and its libraries (resident)."""
HOST_ALLOCATOR_SLACK = 0.10
"""The share a CPU worker's allocator holds beyond what its tensors use (fragmentation, freed pages kept)."""
CUDA_RUNTIME_BYTES = 0.75 * 2**30
"""A GPU worker's CUDA context, cuBLAS and cuDNN workspaces, before any tensor."""
NCCL_BYTES = 0.5 * 2**30
"""NCCL's communicator buffers of a worker that has peers (a few channels of NCCL_BUFFSIZE per peer and group)."""
BF16_COPY_BYTES_PER_PARAM = 2
"""The bf16 copy of a parameter that autocast makes for a forward (and keeps for its backward)."""
ALLOCATOR_SLACK = 0.10
"""The share the CUDA caching allocator holds beyond what tensors use (fragmentation, rounding)."""


@dataclass(frozen=True)
class Widths:
    """What the activations of a transformer depend on: None for a model.factory model."""

    width: int
    heads: int
    seq_len: int
    vocab: int


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes the fullest worker of a layout needs, by what needs them."""

    state: float
    unsharded: float
    activations: float
    snapshot: float = 0.0
    device: float = 0.0
    """What a GPU adds (``device_costs``); 0 on CPU."""
    process: float = 0.0
    """On CPU, the worker process before any tensor and its allocator's slack (on a GPU that is host memory)."""

    @property
    def total(self) -> float:
        return self.state + self.unsharded + self.activations + self.snapshot + self.device + self.process

    def describe(self) -> str:
        """``5.21 GiB (state 4.80, gathered layer 0.25, activations 0.16)``"""
        parts = f"state {gib(self.state)}, gathered layer {gib(self.unsharded)}, activations {gib(self.activations)}"
        parts += f", checkpoint snapshot {gib(self.snapshot)}" if self.snapshot else ""
        parts += f", CUDA, NCCL, bf16 copies and allocator slack {gib(self.device)}" if self.device else ""
        parts += f", process {gib(self.process)}" if self.process else ""
        return f"{gib(self.total)} GiB ({parts})"


@dataclass(frozen=True)
class DeviceCosts:
    """A GPU run's worker: whether its forward casts to bf16 and whether it has peers (NCCL)."""

    bf16: bool
    peers: bool

    def extra(self, stage_params: float, tensors: float) -> float:
        """Bytes beyond ``tensors`` (the state, gathered layers, activations) a worker holding ``stage_params``
        parameters of its stage needs on the device."""
        casts = BF16_COPY_BYTES_PER_PARAM * stage_params if self.bf16 else 0.0
        fixed = CUDA_RUNTIME_BYTES + (NCCL_BYTES if self.peers else 0.0)
        return fixed + casts + ALLOCATOR_SLACK * (tensors + casts)


def builtin_gpt_layers(n_layer: int, d_model: int, vocab_size: int, seq_len: int) -> tuple[list[int], int]:
    """The built-in GPT's parameters per layer (raytrain.models.layers: embedding, blocks, head) and the
    rows of its largest parameter (how far fsdp may cut it), by arithmetic: the driver checks a run's
    memory without waiting for torch. tests/test_memory.py holds it to the built model."""
    D = d_model
    embedding = vocab_size * D + seq_len * D  # token and position tables
    block = 12 * D * D + 10 * D  # qkv 3D x D; proj, fc (4D), out with biases; two LayerNorms
    head = 2 * D + vocab_size * D  # LayerNorm and the untied output projection
    return [embedding, *[block] * n_layer, head], max(vocab_size, seq_len, 4 * D)


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


def stage_bounds(layer_params: list[int], pp: int, cuts: Optional[tuple[int, ...]] = None) -> list[tuple[int, int]]:
    """(first, end) layer of each stage: the layout's cuts, else cut balanced by parameter counts."""
    if cuts is None:
        from raytrain.pipeline.partition import balanced_cuts

        cuts = tuple(balanced_cuts([float(n) for n in layer_params], pp)) if pp > 1 else ()
    bounds = [0, *cuts, len(layer_params)]
    return list(zip(bounds, bounds[1:]))


def estimate(layer_params: list[int], *, pp: int, fsdp: int, micro_batch: int, microbatches: int, schedule: str,
             widths: Optional[Widths], recompute: bool = False,
             cuts: Optional[tuple[int, ...]] = None, async_save: bool = False, tp: int = 1,
             virtual_stages: int = 1, head_split: bool = False, table_split: int = 0,
             split: bool = False, device: Optional[DeviceCosts] = None) -> WorkerMemory:
    """The fullest worker's needs when the model's layers (their parameter counts, in order) are cut
    into ``pp`` x ``virtual_stages`` chunks, each worker holding ``virtual_stages`` of them, and each
    sharded ``fsdp`` ways; ``micro_batch`` rows per micro-batch. With ``tp`` > 1 each layer between the
    first and the last (the blocks) holds a ``1 / tp`` part; the embedding and the head stay whole on
    every tp rank, but for ``table_split`` of the embedding's parameters (its token table) and, with
    ``head_split``, the head (with its logits), split by vocabulary. ``split``: the
    schedule splits backwards into input and weight halves (sharded layers then stay gathered). ``device``: a
    GPU run's costs beyond the tensors (None on CPU)."""
    chunks = stage_bounds(layer_params, pp * virtual_stages, cuts)
    last_layer = len(layer_params) - 1
    whole = (0,) if head_split else (0, last_layer)
    layer_params = [n if i in whole else n / tp for i, n in enumerate(layer_params)]
    layer_params[0] -= table_split - table_split / tp
    logits_part = tp if head_split else 1
    worst = WorkerMemory(0.0, 0.0, 0.0)
    for index, held in enumerate(_worker_chunks(chunks, pp, virtual_stages, schedule)):
        params = [n for first, end in held for n in layer_params[first:end]]
        state = STATE_BYTES_PER_PARAM * sum(params) / fsdp
        unsharded = UNSHARDED_BYTES_PER_PARAM * max(params) if fsdp > 1 else 0.0
        if fsdp > 1 and split and pp > 1:
            unsharded = UNSHARDED_BYTES_PER_PARAM * sum(params)
        elif fsdp > 1 and microbatches > 1:
            unsharded += ACCUMULATED_GRAD_BYTES_PER_PARAM * sum(params)
        live = _live_microbatches(pp, index, microbatches, schedule, virtual_stages, split)
        last = any(end == len(layer_params) for _, end in held)  # it computes the logits
        layers = max(end - first for first, end in held)
        activations = (activation_bytes(widths, micro_batch, layers, recompute, last, live, logits_part)
                       if widths else 0.0)
        snapshot = SNAPSHOT_BYTES_PER_PARAM * sum(params) / fsdp if async_save and device is None else 0.0  # host, on GPU
        extra = device.extra(sum(params), state + unsharded + activations) if device else 0.0
        tensors = state + unsharded + activations + snapshot
        process = PROCESS_BYTES + HOST_ALLOCATOR_SLACK * tensors if device is None else 0.0  # a GPU's: host memory
        candidate = WorkerMemory(state, unsharded, activations, snapshot, extra, process)
        worst = candidate if candidate.total > worst.total else worst
    return worst


def _worker_chunks(chunks: list[tuple[int, int]], pp: int, virtual_stages: int, schedule: str):
    """Each pipeline worker's chunks (bounds), by the schedule's placement."""
    placement = Placement.of_schedule(schedule, pp, virtual_stages)
    return [[chunks[placement.stage(w, c)] for c in range(virtual_stages)] for w in range(pp)]


def _live_microbatches(pp: int, stage: int, microbatches: int, schedule: str, virtual_stages: int = 1,
                       split: bool = False) -> int:
    """Micro-batches (chunk activations, with virtual stages) a worker holds at once: one without a
    pipeline (accumulation finishes each before the next), all of them in GPipe, at most pp - stage in
    1F1B, and the schedule's own count (of the schedule ``split`` or not) for the interleaved and V schedules."""
    if pp == 1:
        return 1
    if virtual_stages > 1:
        return peak_live_activations(build_schedule(schedule, pp, microbatches, split, virtual_stages)[stage])
    return microbatches if schedule == "gpipe" else min(microbatches, pp - stage)


def activation_bytes(w: Widths, micro_batch: int, layers: int, recompute: bool, last: bool, live: int,
                 logits_part: int = 1) -> float:
    """fp32 bytes that ``live`` micro-batches leave for backward in ``layers`` transformer layers (the
    embedding and the head count as layers: a slight overestimate); a worker holds 1 / ``logits_part`` of
    the logits (a head split by vocabulary)."""
    tokens = micro_batch * w.seq_len
    full = ACTIVATION_VALUES_PER_TOKEN_WIDTH * tokens * w.width
    logits = 2 * tokens * w.vocab / logits_part if last else 0  # the logits and their gradient
    if recompute:  # each layer's input is kept; backward rebuilds one layer of one micro-batch at a time
        return 4.0 * (live * (layers * tokens * w.width + logits) + full)
    return 4.0 * live * (layers * full + logits)
