"""Importing user code (model.factory's module) safely beside a background import of torch.distributed.

The driver starts importing torch.distributed early (``preload_torch_distributed``), while it connects
to Ray; a user module imported meanwhile must wait for that import to finish (``import_user_module``).
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable, Optional


_preload: Optional[threading.Thread] = None

API_MODEL = "raytrain.models.user_code:api_model"
"""model.factory when the Python API is given a model function (``raytrain.train(cfg, model=fn)``): every
process that builds the model has it registered (``register_api_model``), and this calls it."""
_api_model: Optional[Callable] = None


def register_api_model(builder: Callable) -> None:
    """Make ``builder`` (the Python API's model function) the one API_MODEL builds, in this process."""
    global _api_model
    _api_model = builder


def api_model(model_cfg):
    """model.factory=API_MODEL: the registered model function's layers for ``model_cfg``."""
    if _api_model is None:
        raise ValueError(f"model.factory={API_MODEL!r} builds the model given to raytrain.train(model=...); none was "
                         "given in this process")
    return _api_model(model_cfg)


def preload_torch_distributed() -> None:
    """Start importing torch.distributed (seconds of CPU) in the background, once per process."""
    global _preload
    if _preload is None:
        _preload = threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True)
        _preload.start()


def import_user_module(name: str):
    """Import user code (model.factory's module) only once the preload is done, never beside it.

    A module whose first line is ``import torch.nn as nn`` holds torch.nn's import lock while it waits for
    torch, which the preload holds while it imports torch.nn: Python breaks that deadlock by handing one
    thread a half-initialised torch, and the import fails ('cannot initialize type "RpcBackendOptions"').
    The wait costs the user's module nothing: it imports torch anyway.
    """
    if _preload is not None:
        _preload.join()
    return importlib.import_module(name)


def wait_for_preload() -> None:
    """Block until the background import of torch.distributed (if one was started) is done."""
    if _preload is not None:
        _preload.join()
