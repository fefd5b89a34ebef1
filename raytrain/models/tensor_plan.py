"""Which part of each parameter a tensor-parallel rank holds, as boxes of the whole tensor.

A layer declares its plan as ``tp_plan``: submodule name -> (style, fused parts), e.g. the built-in
GPT's ``Block.tp_plan`` (raytrain.models.layers). ``colwise`` splits a linear's output features (its
weight's and bias's dim 0), ``rowwise`` its input features (its weight's dim 1; the bias stays whole,
added once after the sum); a parameter in no planned submodule is replicated. A colwise linear that
fuses ``parts`` projections (q, k and v in one weight) is split per part, so rank r holds its rows of
each part: several boxes, stacked along dim 0 in the rank's local tensor in that order.

Checkpoints record these boxes (``slices``, raytrain.checkpoint.assemble), so any layout reads a tp
worker's file, and a tp worker loads its boxes from any layout's. No torch.distributed here.
"""

from __future__ import annotations

from typing import Optional

Box = tuple[tuple[int, int], ...]
"""[start, stop) per dim of the whole tensor."""
Plan = dict[str, tuple[str, int]]
"""Submodule name -> ("colwise" | "rowwise", fused parts)."""


def layer_plan(layer) -> Plan:
    """A layer's tensor-parallel plan (empty: every parameter replicated)."""
    return dict(getattr(layer, "tp_plan", {}))


def split_of(plan: Plan, param_name: str) -> Optional[tuple[str, int, int]]:
    """(style, parts, dim) by which parameter ``param_name`` (its name within the layer) is split, or None
    when it is replicated (no plan names its submodule, or it is a rowwise bias)."""
    module, _, leaf = param_name.rpartition(".")
    if module not in plan:
        return None
    style, parts = plan[module]
    if style == "colwise":
        return style, parts, 0
    if style == "rowwise":
        return (style, parts, 1) if leaf == "weight" else None
    raise ValueError(f"unknown tensor-parallel style {style!r} for {module}")


def local_boxes(plan: Plan, param_name: str, shape: tuple[int, ...], tp: int, index: int) -> list[Box]:
    """The boxes of the whole tensor (of ``shape``) that tp rank ``index`` of ``tp`` holds, in the order
    its local tensor stacks them along dim 0; one whole box when the parameter is replicated."""
    whole = tuple((0, n) for n in shape)
    split = split_of(plan, param_name)
    if split is None or tp == 1:
        return [whole]
    _, parts, dim = split
    part = shape[dim] // parts
    width = part // tp
    assert part * parts == shape[dim] and width * tp == part, (param_name, shape, parts, tp)
    boxes = []
    for p in range(parts):
        start = p * part + index * width
        boxes.append(tuple((start, start + width) if d == dim else whole[d] for d in range(len(shape))))
    return boxes


def rows_of_stack(boxes: list[Box], start: int, stop: int) -> list[Box]:
    """The boxes of the whole that rows ``[start, stop)`` of a tp rank's local tensor (``boxes`` stacked
    along dim 0) hold: what an fsdp shard of a tensor-parallel parameter owns. Never empty: a shard
    owning no rows holds an empty box."""
    held, offset = [], 0
    for box in boxes:
        (a, b), rest = box[0], box[1:]
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            held.append(((a + lo - offset, a + hi - offset), *rest))
        offset += b - a
    return held or [((boxes[0][0][0], boxes[0][0][0]), *boxes[0][1:])]
