"""``raytrain.train(config) -> Result``: the one entry point the CLI and the tests call.

It checks the config against this machine (``prepare``), chooses the layout first when
parallel.auto is set (raytrain.tune.autolayout), then runs it (raytrain.driver.run).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from raytrain.config import Config
from raytrain.config.prepared import ModelFacts, PreparedRun
from raytrain.driver import run as driver
from raytrain.driver.placement import ResourcesUnavailable
from raytrain.driver.prepare import prepare
from raytrain.driver.run import Result, ensure_ray

__all__ = ["PreparedRun", "Result", "ResourcesUnavailable", "ensure_ray", "prepare", "train"]


def train(cfg: Config, stream=sys.stderr, on_rows: Optional[Callable[[list[dict]], None]] = None,
          placement=None, dataset: Any = None, eval_dataset: Any = None, model: Optional[Callable] = None) -> Result:
    """Run training to ``train.steps`` on the current (or an embedded) Ray cluster.

    ``dataset``: the training samples, a map-style ``torch.utils.data.Dataset`` (``dataset[i] -> (inputs,
    target)``) or a ``ray.data.Dataset`` (read through data.inputs and data.targets), instead of data.path;
    ``eval_dataset``: held-out samples of the same kind; ``model``: a function of the model config returning
    the layers, or (layers, loss_fn), as model.factory does. Bad input raises a ValueError before any actor
    starts. With parallel.auto, short Tune trials probe the layouts the cluster can hold once the data and
    the model are checked, and the run trains with the fastest; the Result's ``auto_layout`` says what was
    probed. The other arguments are ``raytrain.driver.run.run``'s.
    """
    objects = {"dataset": dataset, "eval_dataset": eval_dataset, "model": model}
    if not cfg.parallel.auto:
        return driver.run(prepare(cfg, **objects), stream, on_rows, placement)
    if any(v is not None for v in objects.values()):
        raise ValueError("parallel.auto probes layouts in Tune trials, which build the data and the model from the "
                         "config: give them as data.factory and model.factory (pkg.module:fn), or set the layout")
    # Here, not at the top: Tune's import costs every other run (and every CLI error) 1.5 s.
    from raytrain.tune.autolayout import choose_layout

    probed = {}

    def choose(cfg: Config, model: ModelFacts, layers) -> Config:
        ensure_ray()
        chosen, probed["auto_layout"] = choose_layout(cfg, model, layers, stream)
        return chosen

    result = driver.run(prepare(cfg, choose), stream, on_rows, placement)
    return dataclasses.replace(result, auto_layout=probed["auto_layout"])
