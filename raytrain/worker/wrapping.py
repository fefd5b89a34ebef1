"""What re-wrapping a stage every generation shares between FSDP2 (raytrain.worker.sharded) and tensor
parallelism (raytrain.worker.tensor_parallel): the new wrapping, built on the meta device, is given the
current values, and the optimizer moves to its local tensors."""

from __future__ import annotations

import torch


def repoint(optimizer: torch.optim.Optimizer, old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    """Move the optimizer's parameters and their state from ``old`` to ``new`` (same order and shapes)."""
    by_old = {id(o): n for o, n in zip(old, new)}
    state = dict(optimizer.state)
    optimizer.state.clear()
    optimizer.state.update({by_old[id(p)]: s for p, s in state.items()})
    for group in optimizer.param_groups:
        group["params"] = [by_old[id(p)] for p in group["params"]]


def adopt(module: torch.nn.Module, device: torch.device, buffers: list[torch.Tensor], params: list[torch.Tensor],
          optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Materialise a freshly wrapped (meta) ``module`` on ``device`` holding ``buffers`` and ``params`` (this
    worker's local parts, in the module's order); ``params`` and ``optimizer`` then point at the module's
    local tensors (a DTensor's ``to_local()``: views of its storage). Returns the module's parameters."""
    from torch.distributed.tensor import DTensor  # imported by the wrappers that need it, never at start-up

    module.to_empty(device=device)
    wrapped = list(module.parameters())
    with torch.no_grad():
        own = list(module.buffers())
        assert len(own) == len(buffers), (len(own), len(buffers))
        for buffer, value in zip(own, buffers):  # to_empty left them uninitialised
            buffer.copy_(value)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in wrapped]
        for new, old in zip(local, params):
            assert new.shape == old.shape, (new.shape, old.shape)
            new.copy_(old)
    repoint(optimizer, params, local)
    params[:] = local
    return wrapped
