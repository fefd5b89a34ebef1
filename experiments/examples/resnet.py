"""A small ResNet as a model factory: a stem, residual blocks and a head, each block one layer, so that a
pipeline cuts between blocks and a residual connection never crosses a stage.

``model.options``: ``channels`` (16), ``blocks`` (4), ``classes`` (3), ``norm`` (``batch``: BatchNorm, whose
statistics are buffers and whose forward depends on the micro-batch; ``group``: GroupNorm, which no layout
changes). The images come from ``experiments.examples.shapes:decode``.
"""

from __future__ import annotations

from torch import nn


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(4, channels)


class Block(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2016)."""

    def __init__(self, channels: int, norm: str):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), _norm(norm, channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), _norm(norm, channels))
        self.act = nn.ReLU()

    def forward(self, x_BCHW):
        return self.act(x_BCHW + self.body(x_BCHW))


def resnet(model):
    o = {"channels": 16, "blocks": 4, "classes": 3, "norm": "batch", **model.options}
    c = o["channels"]
    stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), _norm(o["norm"], c), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, o["classes"]))
    return [stem, *(Block(c, o["norm"]) for _ in range(o["blocks"])), head]
