"""User model factories for tests (``model.factory=tests.factories:NAME``): workers import them too."""

import ray
from torch import nn


class RaisesInForward(nn.Module):
    def forward(self, x):
        raise ValueError("boom in forward: a user model's own error")


def forward_raises(cfg):
    """A model whose forward raises a ValueError, as a user's bug would."""
    return [nn.Embedding(cfg.vocab_size, 8), RaisesInForward()]


def raises_in_workers(cfg):
    """Builds on the driver, raises in a worker actor's constructor."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        raise ValueError("boom while building the model in a worker")
    return [nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size)]
