"""Models as ordered lists of layers, so a pipeline can cut them anywhere between two layers.

The built-in model is a small GPT decoder: ``[Embedding, Block x n_layer, Head]``. Global parameter
names are those of ``nn.Sequential(*layers)`` (``"3.attn.qkv.weight"``), whatever the layout.

A user model is ``model.factory = "pkg.module:function"`` (or the Python API's ``model=`` function); the
function takes the ModelConfig and returns an ``nn.Sequential`` (or list of modules), or a pair
``(layers, loss_fn)`` where ``loss_fn(output, targets) -> scalar mean loss``. The default loss
(``default_loss``) is cross entropy for integer targets and mean squared error for float ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from raytrain.config import ModelConfig
from raytrain.models.user_code import import_user_module

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the batch (over every sample of a batch of (B, C)
    logits and (B,) class ids)."""
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.size(-1)).float(), targets_BT.reshape(-1))


def default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A model.factory's loss unless it gives one: cross entropy for integer targets (class ids, tokens: the
    output's last dimension holds the classes), mean squared error for float targets (the output's shape:
    an output of (B, 1) against targets of (B,) is compared as (B,))."""
    if not targets.is_floating_point():
        return cross_entropy_loss(output, targets)
    if output.shape != targets.shape and output.shape == (*targets.shape, 1):
        output = output.squeeze(-1)
    if output.shape != targets.shape:
        raise ValueError(f"mean squared error needs the output {tuple(output.shape)} and the targets "
                         f"{tuple(targets.shape)} to have one shape")
    return F.mse_loss(output.float(), targets.float())


class Embedding(nn.Module):
    tp_plan = {"tok": ("vocab_embedding", 1), "": ("sequence_scatter", 1)}
    """Under parallel.tp each rank holds its rows of the token table (where tp divides the vocabulary); with
    parallel.sequence_parallel each rank keeps its share of the tokens: the blocks' norms and residuals run
    on them (raytrain.models.tensor_plan)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        pos_T = torch.arange(idx_BT.size(1), device=idx_BT.device)
        return self.tok(idx_BT) + self.pos(pos_T)  # (B, T, D)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention.

    Its tensor-parallel plan (``tp_plan``, applied by raytrain.worker.tensor_parallel): q/k/v and the MLP's
    up projection colwise, the attention's and the MLP's out projections rowwise, the norms replicated.
    ``qkv`` fuses three projections, so each tp rank holds its rows of each of q, k and v (its heads), not
    one contiguous third; ``forward`` reads the head count from what ``qkv`` returns, so a rank runs its
    n_head / tp heads and one process all of them, with the same arithmetic."""

    tp_plan = {"ln1": ("sequence_parallel", 1), "qkv": ("colwise", 3), "proj": ("rowwise", 1),
               "ln2": ("sequence_parallel", 1), "fc": ("colwise", 1), "out": ("rowwise", 1)}
    """Submodule -> (style, fused parts): how parallel.tp splits this block's linears (and, with
    parallel.sequence_parallel, runs its norms on the rank's tokens)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)  # a key bias has no gradient: Adam would amplify noise
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x_BTD))  # (B, T, 3 * H * Dh): H is n_head / tp under tensor parallelism
        B, T, _ = qkv.shape  # every token: under sequence parallelism x holds this rank's T / tp
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        H = q.size(-1) // self.head_dim
        q, k, v = (t.view(B, T, H, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * self.head_dim)
        x_BTD = x_BTD + self.proj(y)
        return x_BTD + self.out(F.gelu(self.fc(self.ln2(x_BTD))))


class Head(nn.Module):
    tp_plan = {"ln": ("sequence_parallel", 1), "lm_head": ("vocab_parallel", 1)}
    """Under parallel.tp the head is split by vocabulary and the loss computed on the split logits
    (raytrain.models.tensor_plan); with parallel.sequence_parallel its norm runs on the rank's tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x_BTD))  # (B, T, V)


class Recomputed(nn.Module):
    """A layer whose activations are recomputed in backward instead of kept from forward (torch's
    non-reentrant activation checkpointing): same values and gradients, less memory."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def _build_gpt_layer(cfg: ModelConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.gpt_layers - 1:
        return Head(cfg)
    return Block(cfg)


@dataclass
class ModelSpec:
    """The layers a worker hosts, with their global indices, and the loss."""

    layers: list[nn.Module]
    layer_ids: list[int]
    num_layers: int
    loss_fn: LossFn

    def param_names(self) -> list[str]:
        """Global names in ``nn.Sequential(*layers).parameters()`` order: a parameter two layers share
        (tied embeddings) once, under its first name."""
        seen: set[int] = set()
        names = []
        for i, layer in zip(self.layer_ids, self.layers):
            for n, p in layer.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    names.append(f"{i}.{n}")
        return names


def persistent_buffer_names(layers: Sequence[nn.Module], layer_ids: Sequence[int]) -> list[Optional[str]]:
    """Of each buffer of ``nn.Sequential(*layers)``, in its ``buffers()`` order (a shared one once): its global
    name (``"3.running_mean"``: the layer's global index, then its name in the layer) when it is state (in
    ``state_dict``: batch norm's statistics), else None (a rotary table a layer rebuilds)."""
    stage = nn.Sequential(*layers)
    persistent = set(stage.state_dict(keep_vars=True))
    names: list[Optional[str]] = []
    for name, _ in stage.named_buffers():
        local, _, rest = name.partition(".")
        names.append(f"{layer_ids[int(local)]}.{rest}" if name in persistent else None)
    return names


def build_model(cfg: ModelConfig, seed: int, layer_ids: Optional[Sequence[int]] = None) -> ModelSpec:
    """Build the layers ``layer_ids`` (all when None), initialised identically under every layout.

    The built-in GPT seeds each layer from (seed, layer index), so a stage builds only its own layers
    and still gets the same weights as a single process; so does a Hugging Face model (``model.hf``,
    raytrain.models.hf_weights), built on the meta device with only these layers materialised. A user
    factory is built whole under ``seed`` and sliced.
    """
    if cfg.hf is not None:
        from raytrain.models.hf_weights import build_hf_stage

        layers, num_layers = build_hf_stage(cfg.hf, cfg.hf_cut, seed, layer_ids, cfg.trust_remote_code)
        ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
        return ModelSpec(layers, ids, num_layers, cross_entropy_loss)
    if cfg.factory is None:
        n = cfg.gpt_layers
        ids = list(range(n)) if layer_ids is None else list(layer_ids)
        layers = []
        for i in ids:
            torch.manual_seed(seed * 100_003 + i)
            layers.append(_build_gpt_layer(cfg, i))
        return ModelSpec(layers, ids, n, cross_entropy_loss)
    all_layers, loss_fn = load_factory_model(cfg, seed)
    ids = list(range(len(all_layers))) if layer_ids is None else list(layer_ids)
    return ModelSpec([all_layers[i] for i in ids], ids, len(all_layers), loss_fn)


def load_factory_model(cfg: ModelConfig, seed: int) -> tuple[list[nn.Module], LossFn]:
    """The factory's layers and loss, built under ``seed``; a ValueError naming model.factory and what it
    returned when that is not a model (prepare builds it on the driver, so this fails before any actor)."""
    module_name, _, fn_name = cfg.factory.partition(":")
    torch.manual_seed(seed)
    built = getattr(import_user_module(module_name), fn_name)(cfg)
    return factory_layers(cfg.factory, built)


FACTORY_RETURNS = "an nn.Sequential, a list of nn.Module, or (layers, loss_fn) with loss_fn(output, targets)"


def factory_layers(factory: str, built) -> tuple[list[nn.Module], LossFn]:
    """``built`` (what model.factory returned) as (layers, loss_fn), checked."""
    def wrong(what: str) -> ValueError:
        return ValueError(f"model.factory={factory!r} returned {what}; it must return {FACTORY_RETURNS} "
                          "-> mean loss: fix the function")

    loss_fn: LossFn = default_loss
    pair = ""  # a tuple is read as (layers, loss_fn): say so when its layers are wrong
    if isinstance(built, tuple):
        if len(built) != 2:
            raise wrong(f"a tuple of {len(built)}")
        built, loss_fn = built
        pair = "a (layers, loss_fn) pair whose layers are "
        if not callable(loss_fn):
            raise wrong(f"{_kind(loss_fn)} as its loss function")
    iterable = hasattr(built, "__iter__") and not isinstance(built, (nn.Module, str, bytes, dict))
    if not (iterable or isinstance(built, (nn.Sequential, nn.ModuleList))):
        raise wrong(pair + _kind(built))
    layers = list(built)
    if not layers:
        raise wrong(f"{pair}an empty {type(built).__name__}")
    bad = next((i for i, m in enumerate(layers) if not isinstance(m, nn.Module)), None)
    if bad is not None:
        raise wrong(f"{pair}a {type(built).__name__} holding {_kind(layers[bad])} at index {bad}")
    return layers, loss_fn


def _kind(value) -> str:
    return "None" if value is None else type(value).__name__


def full_model(cfg: ModelConfig, seed: int) -> nn.Sequential:
    """The whole model as one nn.Sequential: its state_dict keys are the global parameter names."""
    return nn.Sequential(*build_model(cfg, seed).layers)
