"""Refuse a layout whose workers cannot hold their share of the model, before any actor starts: the
estimate of raytrain.models.memory against the memory Ray reports for a worker (on CPU: a node's
memory per CPU slot times resources.cpus_per_worker, on the node that has most). A run that would
be killed by the memory monitor minutes later, or while saving, fails now with the figures and a
degree of parallel.fsdp or parallel.pp that fits.

On GPU the limit is a device's memory: read from the card Ray names on each node (its ``accelerator_type``
resource, against a table of known cards), else asked of a device by a probe task; the estimate then adds
what the GPU path costs beyond the tensors (raytrain.models.memory.DeviceCosts).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import ray

from raytrain.config import Config
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts
from raytrain.models.memory import DeviceCosts, Widths, WorkerMemory, estimate, gib
from raytrain.pipeline.schedule import V_SCHEDULES

LARGEST_SUGGESTED_DEGREE = 64
"""How far the suggestion of an fsdp or pp degree that fits looks."""


KNOWN_DEVICE_GIB = {"H200": 140.4, "H100": 79.6, "GH200": 94.5, "A100": 39.5, "A100-80G": 79.2, "A10G": 22.5,
                    "L4": 22.5, "L40S": 45.0, "T4": 15.0, "V100": 15.8, "P100": 15.9, "P4": 7.4, "K80": 11.2,
                    "MI300x": 192, "MI250x": 128, "MI250": 128, "MI210": 64, "MI100": 32}
"""Device memory (GiB, 2**30 bytes) by Ray's accelerator_type name: the total a device reports (nvidia-smi's
MiB / 1024; an "80 GB" H100 has 81559 MiB, a "24 GB" L4 23034 MiB), not the marketing gigabytes. Where one
name covers several sizes (A100 40/80 GB, V100 16/32 GB) the smaller is taken: a refusal must never turn away
a layout that fits by the card's name."""


def worker_memory_bytes(cfg: Config) -> Optional[float]:
    """Memory one worker may use on the cluster's most generous node: on CPU its memory per CPU slot times
    resources.cpus_per_worker; on GPU one device's memory (``device_memory_bytes``); None when unknown."""
    if cfg.resources.use_gpu:
        return device_memory_bytes()
    shares = [node["Resources"].get("memory", 0) * cfg.resources.cpus_per_worker / node["Resources"]["CPU"]
              for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU")]
    return max(shares, default=0) or None


def device_memory_bytes() -> Optional[float]:
    """The largest device memory of the cluster's GPU nodes: by the card each names (``accelerator_type:X``),
    else asked of a device by a probe task; None when the cluster has no GPU or none answers in time."""
    sizes = []
    for node in ray.nodes():
        resources = node["Resources"] if node["Alive"] else {}
        if resources.get("GPU"):
            cards = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
            known = [KNOWN_DEVICE_GIB[c] * 2**30 for c in cards if c in KNOWN_DEVICE_GIB]
            sizes.append(max(known) if known else None)
    if not sizes:
        return None
    if None in sizes:  # a card the table does not know: ask one
        sizes = [s for s in sizes if s is not None] + [_probe_device_memory()]
    return max((s for s in sizes if s), default=None)


def _probe_device_memory() -> Optional[float]:
    """One GPU's memory, asked of it by a task holding it (bounded: None when no GPU is free in time)."""
    probe = ray.remote(num_gpus=1, num_cpus=0)(_total_device_memory).remote()
    try:
        return ray.get(probe, timeout=DEVICE_PROBE_TIMEOUT_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
        ray.cancel(probe, force=True)
        return None


DEVICE_PROBE_TIMEOUT_S = 60.0
"""How long the memory check waits for a GPU to ask its memory of, before it goes unchecked."""


def _total_device_memory() -> float:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory)


def layout_memory(cfg: Config, layout: Layout, layer_params: list[int]) -> WorkerMemory:
    """The estimate for the fullest worker of ``layout`` (its cuts, if chosen) over these layers. The
    built-in GPT's head and token table split by vocabulary where tp divides it; a Hugging Face or
    model.factory head and table are counted whole (an overestimate where they split: untied ones,
    raytrain.models.tensor_plan)."""
    m = cfg.model
    widths = None if m.factory is not None else Widths(m.d_model, m.n_head, m.seq_len, m.vocab_size)
    micro_batch = max(1, cfg.train.global_batch // (layout.mesh.columns * layout.microbatches))
    builtin = m.factory is None and m.hf is None
    by_vocabulary = builtin and layout.tp > 1 and m.vocab_size % layout.tp == 0
    return estimate(layer_params, pp=layout.pp, fsdp=layout.fsdp, micro_batch=micro_batch,
                    microbatches=layout.microbatches, schedule=layout.schedule, widths=widths,
                    recompute=cfg.train.activation_checkpointing, cuts=layout.cuts,
                    async_save=cfg.checkpoint.async_save, tp=layout.tp, virtual_stages=layout.virtual_stages,
                    head_split=by_vocabulary, table_split=m.vocab_size * m.d_model if by_vocabulary else 0,
                    split=cfg.parallel.split_backward or layout.schedule in V_SCHEDULES,
                    device=DeviceCosts(cfg.resources.bf16, layout.mesh.world_size > 1) if cfg.resources.use_gpu else None)


def check_run_memory(cfg: Config, layout: Layout, model: ModelFacts) -> None:
    """``check_memory`` for a run, once Ray is up (its memory figures), over the layer sizes prepare
    counted (raytrain.driver.model_check: by arithmetic for the built-in GPT)."""
    limit = worker_memory_bytes(cfg) if cfg.resources.check_memory else None
    check_memory(cfg, layout, list(model.layer_params), model.max_fsdp, limit)


def check_memory(cfg: Config, layout: Layout, layer_params: list[int], max_fsdp: int,
                 limit: Optional[float]) -> None:
    """A ValueError naming the estimate, the ``limit`` (bytes a worker has) and a degree that fits when
    the layout's fullest worker cannot fit. ``max_fsdp``: the most shards the model's parameters can be
    cut into."""
    if limit is None or not layer_params:
        return
    need = layout_memory(cfg, layout, layer_params)
    if need.total <= limit:
        return
    has = ("one GPU of the largest kind the cluster has" if cfg.resources.use_gpu else
           f"resources.cpus_per_worker={cfg.resources.cpus_per_worker} CPU slot(s) of the largest node")
    raise ValueError(f"layout {layout.label}: each worker needs an estimated {need.describe()}, more than the "
                     f"{gib(limit)} GiB a worker has ({has}); {_what_fits(cfg, layout, layer_params, limit, max_fsdp)}, "
                     "or set resources.check_memory=false to try anyway")


def _what_fits(cfg: Config, layout: Layout, layer_params: list[int], limit: float, max_fsdp: int) -> str:
    """The smallest parallel.fsdp and parallel.pp (each alone, the rest as configured; with virtual stages,
    under plain 1F1B) that fit."""
    plain = dataclasses.replace(layout, cuts=None)  # another degree cuts anew
    chunked = layout.virtual_stages > 1
    if chunked:  # chunks bring rules of their own (m a multiple of pp, pp x v layers): suggest plain 1F1B
        plain = dataclasses.replace(plain, schedule="1f1b", virtual_stages=1)
    fits = []
    for key, degrees in (("fsdp", range(layout.fsdp + 1, min(max_fsdp, LARGEST_SUGGESTED_DEGREE) + 1)),
                         ("pp", range(layout.pp + 1, min(len(layer_params), LARGEST_SUGGESTED_DEGREE) + 1))):
        for degree in degrees:
            grid = dataclasses.replace(plain.mesh, **{key: degree})
            if layout_memory(cfg, dataclasses.replace(plain, mesh=grid), layer_params).total <= limit:
                fits.append(f"parallel.{key}={degree}")
                break
    if not fits:
        more = ("GPUs with more memory" if cfg.resources.use_gpu else
                "nodes with more memory per CPU slot, a larger resources.cpus_per_worker")
        return f"no parallel.fsdp or parallel.pp up to the model's limits fits: use {more}, or a smaller model"
    return " or ".join(fits) + " would fit" + (" (with parallel.schedule=1f1b, virtual_stages=1)" if chunked else "")
