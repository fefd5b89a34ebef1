"""The TCPStore where every generation's process groups meet, hosted by the driver.

The driver outlives coordinators and workers, so a re-formed generation or a restarted coordinator
finds the same store; each coordinator incarnation keys its generations under its own namespace.
Hosting it here also keeps torch out of the coordinator: on a small machine a third ``import torch``
next to the workers' own delays the first step by about a second.
"""

from __future__ import annotations

import importlib
import threading
from typing import NamedTuple, Optional


class StoreAddress(NamedTuple):
    host: str
    port: int
    namespace: str
    """Key prefix of one coordinator incarnation; generations go under it."""


_preload: Optional[threading.Thread] = None


def preload_torch_distributed() -> None:
    """Start importing torch.distributed (~2 s of CPU) in the background, once per process."""
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


class RendezvousStore:
    def __init__(self):
        preload_torch_distributed()
        self._store = None

    def address(self, host: str, namespace: str) -> StoreAddress:
        """Start the store (once) on this process and return where workers reach it."""
        if self._store is None:
            _preload.join()
            import torch.distributed as dist

            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return StoreAddress(host, self._store.port, namespace)

    def close(self) -> None:
        self._store = None  # the server stops with its last reference
