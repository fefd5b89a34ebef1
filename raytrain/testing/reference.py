"""The plain single-process reference: same model, data order, loss and optimizer, no Ray.

The equivalence tests and benchmarks compare every layout against this (ARCHITECTURE.md, invariants:
the layout does not change the math)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from raytrain import checkpoint, data
from raytrain.config import Config
from raytrain.data.rows import MapDataset
from raytrain.models.layers import build_model
from raytrain.models.user_code import API_MODEL, register_api_model
from raytrain.optim.optimizer import apply_step, make_optimizer


def train_reference(
    cfg: Config, steps: int | None = None, resume_from: str | None = None, dataset=None, model=None
) -> tuple[nn.Sequential, list[float]]:
    """Train up to step ``steps`` (default train.steps) with full batches in this process.

    ``resume_from`` continues from a checkpoint written by any layout; ``dataset`` (a map-style torch
    Dataset) and ``model`` (a model function) as ``raytrain.train`` takes them. Returns the model and losses.
    """
    if model is not None:
        register_api_model(model)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, factory=API_MODEL))
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*spec.layers)
    optimizer = make_optimizer(model.parameters(), cfg.train)
    start = 0
    if resume_from is not None:
        state = checkpoint.merged_state(resume_from)
        names = [n for n, _ in model.named_parameters()]  # a tied parameter once, as checkpoints hold it
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name in state["model"]:  # a buffer that is not state (a rotary table) is not in it
                    tensor.copy_(state["model"][name])
        checkpoint.load_optimizer_state(optimizer, names, state["optim"])
        start = checkpoint.read_manifest(resume_from)["step"]
    samples = MapDataset(dataset) if dataset is not None else data.open_dataset(data.counted_source(cfg).train, cfg)
    num_samples = data.training_rows(cfg, len(samples))
    B = cfg.train.global_batch
    losses = []
    for step in range(start, cfg.train.steps if steps is None else steps):
        ids = data.sample_ids(cfg.train.seed, num_samples, step * B, (step + 1) * B, cfg.data.order_origin)
        epochs = data.position_epochs(num_samples, step * B, (step + 1) * B, cfg.data.order_origin)
        x, y = samples.batch(ids, data.sample_seeds(cfg.train.seed, ids, epochs))
        optimizer.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        apply_step(optimizer, cfg.train, step)
        losses.append(loss.item())
    return model, losses


def reference_eval_loss(cfg: Config, model: nn.Module) -> float:
    """The held-out loss of ``model`` (eval.every): the mean loss over the first eval.batches x
    train.global_batch held-out rows, one full batch at a time in this process."""
    source = data.counted_source(cfg)
    num_samples = data.training_rows(cfg, source.train.total)
    files, first = data.held_out_source(cfg, source, num_samples)
    held_out = data.open_dataset(files, cfg)
    loss_fn, B, total = build_model(cfg.model, cfg.train.seed, []).loss_fn, cfg.train.global_batch, 0.0
    with torch.no_grad():
        for batch in range(cfg.eval.batches):
            x, y = held_out.batch(data.held_out_ids(first, batch, B, 0, B))
            total += float(loss_fn(model(x), y)) * B
    return total / (cfg.eval.batches * B)
