"""User model factories for tests (``model.factory=tests.factories:NAME``): workers import them too."""

import ray
import torch
from torch import nn


def _in_a_worker() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class RaisesInForward(nn.Module):
    """Raises in a worker actor's forward (the driver's check of the model on the first samples passes), as
    a user's bug that only some batch or device shows would."""

    def forward(self, x):
        if _in_a_worker():
            raise ValueError("boom in forward: a user model's own error")
        return x


def forward_raises(cfg):
    """A model whose forward raises a ValueError in the workers, as a user's bug would."""
    return [nn.Embedding(cfg.vocab_size, 8), RaisesInForward(), nn.Linear(8, cfg.vocab_size)]


def raises_in_workers(cfg):
    """Builds on the driver, raises in a worker actor's constructor."""
    if _in_a_worker():
        raise ValueError("boom while building the model in a worker")
    return [nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size)]


class Scale(nn.Module):
    """A learned scalar: a parameter FSDP cannot cut along dim 0."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.scale


def with_a_scalar(cfg):
    return [nn.Embedding(cfg.vocab_size, 8), Scale(), nn.Linear(8, cfg.vocab_size)]


def one_row_head(cfg):
    """A model whose last layer has a 1-row parameter (a shard of it may be empty)."""
    return [nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, 1), nn.Linear(1, cfg.vocab_size)]


class GatedMLP(nn.Module):
    """A residual SwiGLU block that declares its own tensor-parallel plan: the fused gate-and-up
    projection splits by columns (two parts: each tp rank holds its columns of each), the down
    projection by rows. ``forward`` reads its local width from what ``up`` returns."""

    tp_plan = {"up": ("colwise", 2), "down": ("rowwise", 1)}

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        gate, up = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def planned_mlp(cfg):
    """Embedding, two planned gated MLPs, a head: a model.factory model parallel.tp can split."""
    return [nn.Embedding(cfg.vocab_size, cfg.d_model), GatedMLP(cfg.d_model, 2 * cfg.d_model),
            GatedMLP(cfg.d_model, 2 * cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size)]


class PlansItsNorm(GatedMLP):
    tp_plan = {"norm": ("colwise", 1)}


def plan_names_a_norm(cfg):
    """A plan that names a LayerNorm, which tensor parallelism cannot split as a linear."""
    return [nn.Embedding(cfg.vocab_size, cfg.d_model), PlansItsNorm(cfg.d_model, 64), nn.Linear(cfg.d_model, cfg.vocab_size)]


def sequence_parallel_block_after_a_plain_embedding(cfg):
    """The built-in GPT's block, which runs on a tp rank's share of the tokens, after an embedding that
    does not split them: sequence parallelism cannot apply."""
    from raytrain.models.layers import Block, Head

    return [nn.Embedding(cfg.vocab_size, cfg.d_model), Block(cfg), Head(cfg)]


class TiedHead(nn.Module):
    """An output head whose weight is the token embedding's (tied embeddings)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm = nn.LayerNorm(embedding.embedding_dim)
        self.weight = embedding.weight

    def forward(self, x):
        return nn.functional.linear(self.norm(x), self.weight)


def tied_embedding_head(cfg):
    """A token model whose head shares the embedding's weight: pp puts the two on different stages."""
    embedding = nn.Embedding(cfg.vocab_size, 16)
    return [embedding, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), TiedHead(embedding)]


def tuple_activations(cfg):
    """Stages that pass a tuple (hidden state, the token ids): a pipeline sends both, an integer one too."""
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab_size, 16)

        def forward(self, ids):
            return self.tok(ids), ids

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.again = nn.Embedding(cfg.vocab_size, 16)

        def forward(self, pair):
            h, ids = pair
            return torch.tanh(self.proj(h)) + self.again(ids), ids

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(16, cfg.vocab_size)

        def forward(self, pair):
            return self.out(pair[0])

    return [Embed(), Mix(), Head()]


def batch_norm_mlp(cfg):
    """The digits MLP with a batch norm: its running statistics are state (buffers). The linear before it has
    no bias: batch norm removes its mean, so its exact gradient would be 0 and the computed one float noise,
    which AdamW scales to full-size steps of random sign."""
    return nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


INFINITE_LOSS_ENV = "RAYTRAIN_TEST_INFINITE_LOSS"
"""Set in a worker process: its loss is inf while its gradients stay finite (``infinite_loss_here``)."""


def _loss_infinite_here(output, targets):
    """Cross entropy, plus inf where INFINITE_LOSS_ENV is set: a constant, so the gradients stay finite (as a
    masked loss whose every element was masked can be), and only the loss says the step is not finite."""
    import os

    loss = nn.functional.cross_entropy(output, targets)
    return loss + float("inf") if os.environ.get(INFINITE_LOSS_ENV) else loss


def infinite_loss_here(cfg):
    """The design documents' MLP on the digits, whose loss is inf in a worker process with INFINITE_LOSS_ENV."""
    return [nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)], _loss_infinite_here
