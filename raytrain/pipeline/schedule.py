"""Pipeline schedules as data: per-worker ordered action lists (raytrain.pipeline.actions), checked by
raytrain.pipeline.checker and run by one executor (raytrain.worker.executor).

A schedule says only in which order each worker computes: forwards, backwards and the weight halves of
split backwards, on which chunk and micro-batch (``compute orders``). ``lower`` adds the messages: a send
right after the compute that produces it, and before a compute that needs a message, the receives of
everything its sender sent on that channel until then (messages between two workers arrive in the
order they were sent). Between two chunks on one worker nothing is sent: the next chunk takes the
tensor (a local hand-off).

With ``split_backward``, a stage after the first may compute only the input gradient in ``B3`` and
the weight gradients later in ``W3`` (raytrain.pipeline.split_backward), so ``>B3`` leaves a weight-gradient
time sooner. A backward is split exactly when its micro-batch has a ``W`` on that chunk. Splitting
costs a little (a graph walk and more autograd calls), so a schedule splits only the backwards whose
``W`` can move into time the worker would otherwise wait. The F/B order does not change:

- GPipe splits every backward and puts the ``W``s after the stage's last backward, where the stage
  waits for the earlier stages' backwards anyway; it keeps every micro-batch alive regardless.
- 1F1B and interleaved 1F1B split the cool-down backwards, the ones after the worker's last forward, with
  ``W3`` right after ``>B3``. In the steady state a worker has no wait to fill, so a split there only adds
  its cost; in the cool-down each split lets the previous stage start one weight-gradient time sooner.
  The memory bound is unchanged.
- Zero-bubble V always splits (it is built on the split: its ``W``s fill the places 1F1B waits in).
"""

from __future__ import annotations

from raytrain.pipeline.actions import (BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, WEIGHT, Action, Placement,
                                       Schedule)
from raytrain.pipeline.checker import check_schedule

ComputeOrder = list[Action]  # one worker's F, B and W actions, in order


def gpipe(num_stages: int, num_microbatches: int, split_backward: bool = False) -> Schedule:
    """All forwards, then all backwards: simple, but every micro-batch's activations stay alive."""
    orders = []
    for s in range(num_stages):
        acts = [Action(FORWARD, mb) for mb in range(num_microbatches)]
        acts += [Action(BACKWARD, mb) for mb in range(num_microbatches)]
        if split_backward and s > 0:
            acts += [Action(WEIGHT, mb) for mb in range(num_microbatches)]
        orders.append(acts)
    return lower(Placement(num_stages), orders)


def one_f_one_b(num_stages: int, num_microbatches: int, split_backward: bool = False) -> Schedule:
    """1F1B: p-s-1 warm-up forwards, then alternate forward/backward; at most p-s activations alive."""
    m = num_microbatches
    orders = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        forwards = [Action(FORWARD, mb) for mb in range(m)]
        backwards = [Action(BACKWARD, mb) for mb in range(m)]
        order = _one_forward_one_backward(forwards, backwards, warmup)
        cool_down = {(0, mb) for mb in range(m) if mb >= m - (num_stages - s)}  # after the stage's last forward
        orders.append(_weights_after(order, cool_down if split_backward and s > 0 else set()))
    return lower(Placement(num_stages), orders)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, split_backward: bool = False,
                            virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM's interleaved schedule) on the looped placement.

    Each of the ``num_stages`` workers holds ``virtual_stages`` chunks. Forwards run in rounds of
    ``num_stages`` micro-batches: the round's micro-batches on chunk 0, then the same on chunk 1, and so
    on; backwards in the same rounds, last chunk first. Worker s warms up with 2(p-s-1) + (v-1)p
    forwards, so that its steady state finds each backward's gradient already there; the bubble is
    1F1B's divided by v, for v times as many (smaller) messages. Needs m to be a multiple of p.
    """
    p, v, m = num_stages, virtual_stages, num_microbatches
    assert m % p == 0, f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the stages ({p})"
    total = m * v

    def unit(k: int, backward: bool) -> Action:
        round_chunk = (k // p) % v
        chunk = v - 1 - round_chunk if backward else round_chunk
        mb = (k // (p * v)) * p + k % p
        return Action(BACKWARD if backward else FORWARD, mb, chunk)

    placement = Placement(p, v)
    orders = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        order = _one_forward_one_backward([unit(k, False) for k in range(total)],
                                          [unit(k, True) for k in range(total)], warmup)
        last_forward = max(i for i, a in enumerate(order) if a.kind == FORWARD)
        cool_down = {(a.chunk, a.mb) for a in order[last_forward:] if a.kind == BACKWARD}
        split = {key for key in cool_down if placement.stage(s, key[0]) > 0} if split_backward else set()
        orders.append(_weights_after(order, split))
    return lower(placement, orders)


def zero_bubble_v(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble V (Qi et al., 2024, "ZB-V"): two chunks per worker on the V placement, every backward
    after the first stage split into B and W, and the W's placed where 1F1B would wait.

    Worker s (chunks at stages s and 2p-1-s) warms up with 2(p-s)-1 forwards of chunk 0, then s pairs of
    forwards (chunk 1, chunk 0), then p-s rounds of chunk 1's F, B, W; its steady state alternates chunk 0's
    F, B, W with chunk 1's; its cool-down finishes the backwards first and the W's last, so the gradients a
    previous worker waits for leave as soon as they can. It holds about 2p chunk activations at most, as
    1F1B holds p whole-stage ones. With fewer than 2p-1 micro-batches the schedule is built for 2p-1 and the
    extra micro-batches are dropped.
    """
    p = num_stages
    n = max(num_microbatches, 2 * p - 1)
    placement = Placement(p, 2, v_shape=True)
    orders = []
    for s in range(p):
        order = _zbv_order(p, s, n)
        order = [a for a in order if a.mb < num_microbatches]
        if placement.stage(s, 0) == 0:  # the first stage's backward is whole (no input gradient to send)
            order = [a for a in order if not (a.kind == WEIGHT and a.chunk == 0)]
        orders.append(order)
    return lower(placement, orders)


def _zbv_order(p: int, s: int, n: int) -> ComputeOrder:
    """Worker s's compute order in zero-bubble V over ``n`` micro-batches (see ``zero_bubble_v``).

    Units are written ``"F0"`` (a forward on chunk 0), ``"B1"``, ``"W1"``; each takes that chunk's next
    micro-batch of its kind."""
    order: ComputeOrder = []
    done = {unit: 0 for unit in ("F0", "F1", "B0", "B1", "W0", "W1")}  # micro-batches taken of each unit

    def add(*units: str) -> None:
        for unit in units:
            order.append(Action(unit[0], done[unit], int(unit[1])))
            done[unit] += 1

    for _ in range(2 * (p - s) - 1):
        add("F0")
    for _ in range(s):
        add("F1", "F0")
    for _ in range(p - s):
        add("F1", "B1", "W1")
    while done["F1"] < done["F0"] or done["F0"] < n:
        if done["F0"] < n:
            add("F0")
        add("B0", "W0", "F1", "B1", "W1")
    for _ in range(s):
        add("B0", "B1")
    for _ in range(p - s):
        add("B0", "W0")
    while done["W1"] < done["B1"]:
        add("W1")
    while done["W0"] < done["B0"]:
        add("W0")
    return order


def dual_pipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto the V placement, in the order of torch's
    ``ScheduleDualPipeV``): two chunks per worker at stages s and 2p-1-s, as zero-bubble V.

    Where ZB-V splits every backward, DualPipeV splits only where a weight half fills a wait, in its
    warm-up and cool-down (at most 2(p-1) per worker, however many micro-batches): its steady state
    pairs a forward of one chunk with a whole backward of the other (on a GPU, DualPipe overlaps that
    pair's compute with its messages; here they run one after the other). Each split costs a graph
    walk and more autograd calls, so fewer splits are a shorter step for the same bubble. It holds one
    chunk activation more than ZB-V (2p + 1). Needs m >= 2p micro-batches.
    """
    p, m = num_stages, num_microbatches
    assert m >= 2 * p, f"dualpipev needs at least 2 x stages ({2 * p}) micro-batches, got {m}"
    placement = Placement(p, 2, v_shape=True)
    orders = []
    for s in range(p):
        order = _dual_pipe_v_order(p, s, m)
        if placement.stage(s, 0) == 0:  # the first stage's backward is whole (no input gradient to send)
            order = [a for a in order if not (a.kind == WEIGHT and a.chunk == 0)]
        orders.append(order)
    return lower(placement, orders)


def _dual_pipe_v_order(p: int, s: int, m: int) -> ComputeOrder:
    """Worker s's compute order in DualPipeV (see ``dual_pipe_v``): its eight phases, as DeepSeek's
    reference and torch name them. ``"F1"`` is a forward of chunk 1, ``"B0"`` a whole backward of
    chunk 0, ``"I0"`` its input half whose W joins a queue; ``"W"`` runs the oldest queued W."""
    order: ComputeOrder = []
    forwards, backwards, weights = [0, 0], [0, 0], []

    def add(*units: str) -> None:
        for unit in units:
            if unit == "W":
                if weights:
                    order.append(weights.pop(0))
                continue
            chunk = int(unit[1])
            if unit[0] == "F":
                order.append(Action(FORWARD, forwards[chunk], chunk))
                forwards[chunk] += 1
                continue
            order.append(Action(BACKWARD, backwards[chunk], chunk))
            if unit[0] == "I":
                weights.append(Action(WEIGHT, backwards[chunk], chunk))
            backwards[chunk] += 1

    add(*["F0"] * (2 * (p - s - 1)))
    add(*["F0", "F1"] * (s + 1))
    add(*["I1", "W", "F1"] * (p - s - 1))
    add(*["F0", "B1", "F1", "B0"] * (m - 2 * p + s + 1))
    add(*["B1", "F1", "B0"] * (p - s - 1))
    split = False  # the second half of the last backwards splits, as in DeepSeek's reference
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        add("I1" if split else "B1")
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        add("I0" if split else "B0")
    add(*["W", "I0"] * (p - s - 1))
    add(*["W"] * len(weights))
    return order


def forward_only(num_stages: int, num_microbatches: int, placement: Placement | None = None) -> Schedule:
    """Every micro-batch's forward in order, no backward: the held-out loss (raytrain.control.evaluation).
    Not a training schedule (``check_schedule`` wants backwards); ``simulate`` runs it."""
    placement = placement or Placement(num_stages)
    orders = [[Action(FORWARD, mb, c) for c in sorted(range(placement.chunks), key=lambda c: placement.stage(s, c))
               for mb in range(num_microbatches)]  # chunk by chunk: the micro-batches pipeline through each
              for s in range(num_stages)]
    return lower(placement, orders)


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> ComputeOrder:
    """``warmup`` forwards, then one forward and one backward in turn, then the backwards left."""
    order = list(forwards[:warmup])
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup:]


def _weights_after(order: ComputeOrder, split: set[tuple[int, int]]) -> ComputeOrder:
    """``order`` with a W right after the backward of each (chunk, micro-batch) in ``split``."""
    out = []
    for a in order:
        out.append(a)
        if a.kind == BACKWARD and (a.chunk, a.mb) in split:
            out.append(Action(WEIGHT, a.mb, a.chunk))
    return out


_MESSAGES = {FORWARD: (SEND_F, RECV_F, +1), BACKWARD: (SEND_B, RECV_B, -1)}
"""compute -> (the send after it, the receive that matches it, toward which neighbour)."""
_NEEDS = {FORWARD: (RECV_F, -1), BACKWARD: (RECV_B, +1)}
"""compute -> (the receive it waits for, from which neighbour)."""


def lower(placement: Placement, orders: list[ComputeOrder]) -> Schedule:
    """The schedule of ``orders`` with its messages: each send right after the compute that produces it, and
    before each compute that needs a message, the receives of that channel up to it (module docstring)."""
    sent = {}  # (src, dst) -> the messages src sends dst, in order: (kind of the receive, chunk there, mb)
    for w, order in enumerate(orders):
        for a in order:
            if a.kind in _MESSAGES and _remote(placement, w, a.chunk, _MESSAGES[a.kind][2]):
                _, receive, offset = _MESSAGES[a.kind]
                dst, chunk = placement.neighbour(w, a.chunk, offset)
                sent.setdefault((w, dst), []).append((receive, chunk, a.mb))
    schedule = []
    for w, order in enumerate(orders):
        received = {}  # src -> messages of (src, w) already received
        acts = []
        for a in order:
            needs = _NEEDS.get(a.kind)
            if needs is not None and _remote(placement, w, a.chunk, needs[1]):
                src = placement.neighbour(w, a.chunk, needs[1])[0]
                queue, done = sent[(src, w)], received.get(src, 0)
                upto = queue.index((needs[0], a.chunk, a.mb)) + 1
                acts += [Action(kind, mb, chunk) for kind, chunk, mb in queue[done:upto]]
                received[src] = max(done, upto)
            acts.append(a)
            if a.kind in _MESSAGES and _remote(placement, w, a.chunk, _MESSAGES[a.kind][2]):
                acts.append(Action(_MESSAGES[a.kind][0], a.mb, a.chunk))
        schedule.append(acts)
    return schedule


def _remote(placement: Placement, worker: int, chunk: int, offset: int) -> bool:
    """Whether the stage ``offset`` away exists and lives on another worker."""
    return placement.neighbour(worker, chunk, offset) is not None and not placement.is_local(worker, chunk, offset)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
"""What parallel.schedule may name; the last three put several model chunks on each worker."""
V_SCHEDULES = ("zbv", "dualpipev")
"""The schedules on the V placement: two chunks per worker, at stages s and 2p-1-s."""


def build_schedule(kind: str, num_stages: int, num_microbatches: int, split_backward: bool = False,
                   virtual_stages: int = 1) -> Schedule:
    """The checked schedule named ``kind`` (parallel.schedule) for ``num_stages`` workers of ``virtual_stages``
    chunks each."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULES)}")
    if num_stages == 1 and virtual_stages == 1:
        kind = "1f1b" if kind in ("interleaved_1f1b", *V_SCHEDULES) else kind  # one stage: one chunk, nothing to interleave
    if kind == "interleaved_1f1b":
        schedule = interleaved_one_f_one_b(num_stages, num_microbatches, split_backward, virtual_stages)
    elif kind in V_SCHEDULES:
        assert virtual_stages == 2, f"{kind} has two chunks per worker (the V)"
        schedule = {"zbv": zero_bubble_v, "dualpipev": dual_pipe_v}[kind](num_stages, num_microbatches)
    else:
        assert virtual_stages == 1, f"{kind} has one chunk per worker"
        schedule = {"gpipe": gpipe, "1f1b": one_f_one_b}[kind](num_stages, num_microbatches, split_backward)
    check_schedule(schedule, num_microbatches, Placement.of_schedule(kind, num_stages, virtual_stages))
    return schedule
