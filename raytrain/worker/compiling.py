"""train.compile on a worker: each layer of the stage compiled where it is built, and the seconds this
process spent compiling, which its step reports so that the coordinator charges them to start-up badput
(raytrain.control.goodput) rather than to the step's work.

``nn.Module.compile`` compiles a layer in place: its parameter names, its hooks and the checkpoints that
hold it are those of the eager layer, and FSDP2's hooks on it run outside the compiled graph (Dynamo skips
them). Every block of a kind shares one compiled graph; a repair that re-wraps the layers (FSDP2, tensor
parallel) re-uses it unless a shape changed.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

import torch.nn as nn

from raytrain.compat import on_compile
from raytrain.config import TrainConfig
from raytrain.models.layers import Recomputed


def as_run(layers: Iterable[nn.Module], train: TrainConfig) -> list[nn.Module]:
    """The layers as a step runs them: each wrapped to be recomputed in backward (train.activation_checkpointing),
    then compiled in place (train.compile; lazily, at its first call), in torchtitan's order."""
    layers = [Recomputed(layer) for layer in layers] if train.activation_checkpointing else list(layers)
    if train.compile:
        for layer in layers:
            layer.compile()
    return layers


class CompileClock:
    """The seconds this process has spent compiling since the last ``take``: one per process (Dynamo's
    callbacks are process-wide), started by the first stage that compiles."""

    _instance = None
    _lock = threading.Lock()

    def __init__(self):
        self._spent, self._since = 0.0, None
        on_compile(self._start, self._end)

    @classmethod
    def of_process(cls) -> "CompileClock":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _start(self) -> None:
        self._since = time.perf_counter()

    def _end(self) -> None:
        if self._since is not None:
            self._spent += time.perf_counter() - self._since
            self._since = None

    def take(self) -> float:
        """Seconds spent compiling since the last call."""
        spent, self._spent = self._spent, 0.0
        return spent


class NotCompiling:
    """The clock of a process whose layers are not compiled (train.compile off): it never compiled."""

    @staticmethod
    def take() -> float:
        return 0.0


def compile_clock(train: TrainConfig):
    """The process's CompileClock with train.compile, else one that always reads 0."""
    return CompileClock.of_process() if train.compile else NotCompiling()

