"""Refuse a layout whose workers cannot hold their share of the model, before any actor starts: the
estimate of raytrain.models.memory against the memory Ray reports for a worker (on CPU: a node's
memory per CPU slot times resources.cpus_per_worker, on the node that has most). A run that would
be killed by the memory monitor minutes later, or while saving, fails now with the figures and a
degree of parallel.fsdp or parallel.pp that fits.

On GPU, device memory is not among the resources Ray reports, so no check is made there (yet).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import ray

from raytrain.config import Config
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts
from raytrain.models.memory import Widths, WorkerMemory, estimate, gib
from raytrain.pipeline.schedule import V_SCHEDULES

LARGEST_SUGGESTED_DEGREE = 64
"""How far the suggestion of an fsdp or pp degree that fits looks."""


def worker_memory_bytes(cfg: Config) -> Optional[float]:
    """Memory one worker may use on the cluster's most generous node: its memory per CPU slot times
    resources.cpus_per_worker; None on GPUs (Ray does not report device memory) or when Ray reports none."""
    if cfg.resources.use_gpu:
        return None
    shares = [node["Resources"].get("memory", 0) * cfg.resources.cpus_per_worker / node["Resources"]["CPU"]
              for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU")]
    return max(shares, default=0) or None


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
                    split=cfg.parallel.split_backward or layout.schedule in V_SCHEDULES)


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
    raise ValueError(f"layout {layout.label}: each worker needs an estimated {need.describe()}, more than the "
                     f"{gib(limit)} GiB a worker has (resources.cpus_per_worker={cfg.resources.cpus_per_worker} "
                     f"CPU slot(s) of the largest node); {_what_fits(cfg, layout, layer_params, limit, max_fsdp)}, "
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
        return ("no parallel.fsdp or parallel.pp up to the model's limits fits: use nodes with more memory per "
                "CPU slot, a larger resources.cpus_per_worker, or a smaller model")
    return " or ".join(fits) + " would fit" + (" (with parallel.schedule=1f1b, virtual_stages=1)" if chunked else "")
