"""The TCPStore where every generation's process groups meet, hosted by the driver.

The driver outlives coordinators and workers, so a re-formed generation or a restarted coordinator
finds the same store; each coordinator incarnation keys its generations under its own namespace.
Hosting it here also keeps torch out of the coordinator: on a small machine a third ``import torch``
next to the workers' own delays the first step by about a second.
"""

from __future__ import annotations

from raytrain.config.mesh import StoreAddress
from raytrain.models.user_code import preload_torch_distributed, wait_for_preload


class RendezvousStore:
    def __init__(self):
        preload_torch_distributed()
        self._store = None

    def address(self, host: str, namespace: str) -> StoreAddress:
        """Start the store (once) on this process and return where workers reach it."""
        if self._store is None:
            wait_for_preload()
            import torch.distributed as dist

            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return StoreAddress(host, self._store.port, namespace)

    def close(self) -> None:
        self._store = None  # the server stops with its last reference
