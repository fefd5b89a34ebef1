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

    ties = _tied_names(module)
    module.to_empty(device=device)  # materialises each module's parameters apart: a tie comes undone
    for first, *others in ties:
        for name in others:
            _set_parameter(module, name, module.get_parameter(first))
    wrapped = list(module.parameters())
    with torch.no_grad():
        own = list(module.buffers())
        assert len(own) == len(buffers), (len(own), len(buffers))
        for buffer, value in zip(own, buffers):  # to_empty left them uninitialised
            buffer.copy_(value)
        buffers[:] = own  # the module's from now on: what the stage trains (batch norm's statistics) stays its state
        local = [p.to_local() if isinstance(p, DTensor) else p for p in wrapped]
        for new, old in zip(local, params):
            assert new.shape == old.shape, (new.shape, old.shape)
            new.copy_(old)
    repoint(optimizer, params, local)
    params[:] = local
    return wrapped


def _tied_names(module: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter that more than one submodule holds (tied embeddings), first name first."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _set_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, param)
