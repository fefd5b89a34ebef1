"""The rules every pipeline schedule obeys, and the timing model that runs it: no Ray, no torch.

``simulate`` runs a schedule under the executor's semantics (raytrain.worker.executor): sends are
non-blocking, receives block, and the messages from one worker to another arrive in the order they were
sent, whatever they carry (torch.distributed's point-to-point order, on gloo and NCCL alike). So a schedule
that passes ``check_schedule`` cannot deadlock in the executor, nor receive one tensor in another's place.

A row of a schedule is a pipeline worker ("stage" in messages, as in a schedule without virtual stages); with
virtual stages its actions name their chunk, and ``Placement`` says which pipeline stage a chunk is.
"""

from __future__ import annotations

from typing import Optional

from raytrain.pipeline.actions import (BACKWARD, COMPUTE, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, WEIGHT, Action,
                                       ActionKind, Placement, Schedule, ScheduleError, format_grid)

_ORDER = [(RECV_F, FORWARD), (FORWARD, SEND_F), (FORWARD, BACKWARD), (RECV_B, BACKWARD), (BACKWARD, SEND_B),
          (BACKWARD, WEIGHT), (SEND_B, WEIGHT)]
"""(first, then): within one chunk, ``first`` of a micro-batch comes before ``then`` of it."""


def check_schedule(schedule: Schedule, num_microbatches: int, placement: Optional[Placement] = None) -> None:
    """Raise ScheduleError unless every worker's list is complete and ordered and the whole schedule runs."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    placement = placement or Placement(len(schedule))
    if placement.workers != len(schedule):
        raise ScheduleError(f"a schedule of {len(schedule)} rows for a placement of {placement.workers} workers")
    for worker, acts in enumerate(schedule):
        _check_worker(schedule, placement, worker, acts, num_microbatches)
    simulate(schedule, placement=placement)


def _required(placement: Placement, worker: int, chunk: int) -> list[ActionKind]:
    """What every micro-batch needs on this chunk: compute, and messages to and from remote neighbours."""
    kinds = [FORWARD, BACKWARD]
    if placement.neighbour(worker, chunk, -1) is not None and not placement.is_local(worker, chunk, -1):
        kinds += [RECV_F, SEND_B]
    if placement.neighbour(worker, chunk, +1) is not None and not placement.is_local(worker, chunk, +1):
        kinds += [SEND_F, RECV_B]
    return kinds


def _check_worker(schedule: Schedule, placement: Placement, worker: int, acts: list[Action],
                  num_microbatches: int) -> None:
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for i, a in enumerate(acts):
        if (a.kind, a.mb, a.chunk) in seen:
            raise ScheduleError(f"stage {worker} action {i} ({a!r}) appears twice\n"
                                f"{format_grid(schedule, mark=(worker, i))}")
        if not 0 <= a.mb < num_microbatches:
            raise ScheduleError(f"stage {worker} action {i} ({a!r}): micro-batch out of range 0..{num_microbatches - 1}")
        if not 0 <= a.chunk < placement.chunks:
            raise ScheduleError(f"stage {worker} action {i} ({a!r}): chunk out of range 0..{placement.chunks - 1}")
        seen[(a.kind, a.mb, a.chunk)] = i
    allowed = {c: set(_required(placement, worker, c)) | {WEIGHT} for c in range(placement.chunks)}
    extra = [a for a in acts if a.kind not in allowed[a.chunk]]
    if extra:
        raise ScheduleError(f"stage {worker} has communication with a stage that does not exist "
                            f"or sits on the same worker: {extra}")
    for chunk in range(placement.chunks):
        if placement.stage(worker, chunk) == 0 and any(a.kind == WEIGHT and a.chunk == chunk for a in acts):
            raise ScheduleError(f"stage {worker} has W actions on the first pipeline stage: it sends no input "
                                "gradient, so its backward is never split")
        for mb in range(num_microbatches):
            for kind in _required(placement, worker, chunk):
                if (kind, mb, chunk) not in seen:
                    missing = repr(Action(kind, mb, chunk))
                    raise ScheduleError(f"stage {worker} is missing {missing}\n{format_grid(schedule)}")
            order = [((first, mb, chunk), (then, mb, chunk)) for first, then in _ORDER]
            order += _hand_off_order(placement, worker, chunk, mb)
            for first, then in order:
                if first in seen and then in seen and seen[first] > seen[then]:
                    i = seen[then]
                    raise ScheduleError(f"stage {worker} action {i} ({Action(*then)!r}) comes before {Action(*first)!r}"
                                        f"\n{format_grid(schedule, mark=(worker, i))}")


def _hand_off_order(placement: Placement, worker: int, chunk: int, mb: int) -> list[tuple[tuple, tuple]]:
    """Chunk-to-chunk rules on one worker: a forward after the previous chunk's, a backward before it."""
    if not placement.is_local(worker, chunk, -1):
        return []
    _, before = placement.neighbour(worker, chunk, -1)
    return [((FORWARD, mb, before), (FORWARD, mb, chunk)), ((BACKWARD, mb, chunk), (BACKWARD, mb, before))]


def split_microbatches(stage_actions: list[Action], chunk: int = 0) -> set[int]:
    """The micro-batches whose backward this worker splits on ``chunk``: those with a ``W``."""
    return {a.mb for a in stage_actions if a.kind == WEIGHT and a.chunk == chunk}


def split_keys(stage_actions: list[Action]) -> set[tuple[int, int]]:
    """(chunk, micro-batch) of every backward this worker splits: those with a ``W``."""
    return {(a.chunk, a.mb) for a in stage_actions if a.kind == WEIGHT}


def last_gradient_action(stage_actions: list[Action], chunk: Optional[int] = None) -> int:
    """Index of the action that fills the step's last weight gradients (of ``chunk``, if given): the last
    W or whole backward."""
    split = split_keys(stage_actions)
    fills = [i for i, a in enumerate(stage_actions)
             if a.kind == WEIGHT or (a.kind == BACKWARD and (a.chunk, a.mb) not in split)]
    return max(i for i in fills if chunk is None or stage_actions[i].chunk == chunk)


def _message(placement: Placement, worker: int, a: Action) -> tuple[int, tuple[str, int, int]]:
    """(peer worker, what travels: flow, receiving stage, micro-batch) of a send or receive."""
    stage = placement.stage(worker, a.chunk)
    peer_stage = stage + a.kind.peer
    receiver = peer_stage if a.kind.is_send else stage
    return placement.owner(peer_stage)[0], (a.kind.flow, receiver, a.mb)


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 1.0, weight_cost: float = 0.0,
             split_cost: float = 0.0, placement: Optional[Placement] = None):
    """Run the schedule under the executor's semantics (non-blocking sends, blocking receives, one ordered
    channel per pair of workers).

    A backward costs ``backward_cost``; where the worker has a ``W`` for it, ``weight_cost`` of that
    moves to the ``W`` and the input half costs ``split_cost`` more (the price of splitting). Costs are
    per chunk: with virtual stages a chunk is a fraction of a worker's layers.

    Returns ``(finish_time, busy_time_per_worker, timeline)`` where timeline[worker] lists
    ``(start, end, action)`` for compute actions. Raises ScheduleError on a deadlock or a receive that
    does not match the next message in flight on its channel.
    """
    placement = placement or Placement(len(schedule))
    p = len(schedule)
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    channels: dict[tuple[int, int], list[tuple[tuple, float]]] = {}  # (src, dst) -> FIFO of (message, ready)
    split = [split_keys(acts) for acts in schedule]
    cost_of = {FORWARD: forward_cost, WEIGHT: weight_cost}
    input_half_cost = backward_cost - weight_cost + split_cost
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if a.kind in COMPUTE:
                    split_here = (a.chunk, a.mb) in split[s]
                    cost = cost_of.get(a.kind, input_half_cost if split_here else backward_cost)
                    timeline[s].append((clock[s], clock[s] + cost, a))
                    clock[s] += cost
                    busy[s] += cost
                elif a.kind.is_send:
                    peer, message = _message(placement, s, a)
                    channels.setdefault((s, peer), []).append((message, clock[s]))
                else:
                    src, wanted = _message(placement, s, a)
                    queue = channels.get((src, s), [])
                    if not queue:
                        break  # blocked: wait for the peer
                    message, ready = queue.pop(0)
                    if message != wanted:
                        raise ScheduleError(
                            f"stage {s} action {pos[s]} ({a!r}) would receive {message} from stage {src}: "
                            f"sends and receives are out of order\n{format_grid(schedule, mark=(s, pos[s]))}"
                        )
                    clock[s] = max(clock[s], ready)
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [(s, pos[s]) for s in range(p) if pos[s] < len(schedule[s])]
            s, i = stuck[0]
            raise ScheduleError(f"deadlock: stages {[s for s, _ in stuck]} all wait to receive\n"
                                f"{format_grid(schedule, mark=(s, i))}")
    leftovers = {k: v for k, v in channels.items() if v}
    if leftovers:
        raise ScheduleError(f"messages sent but never received: {leftovers}")
    return max(clock), busy, timeline


def idle_fraction(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 1.0, weight_cost: float = 0.0,
                  placement: Optional[Placement] = None) -> float:
    """Fraction of worker-time spent waiting, for chunks of equal cost."""
    finish, busy, _ = simulate(schedule, forward_cost, backward_cost, weight_cost, placement=placement)
    return 1.0 - sum(busy) / (finish * len(schedule))


def bubble_formula(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of GPipe and 1F1B (virtual_stages 1), and of interleaved 1F1B (Narayanan et al., 2021:
    the bubble shrinks by the number of chunks per worker): (p-1)/v over m + (p-1)/v."""
    bubble = (num_stages - 1) / virtual_stages
    return bubble / (num_microbatches + bubble)


def peak_live_activations(stage_actions: list[Action]) -> int:
    """Most (chunk, micro-batch) pairs whose forward ran and whose backward (its weight half, if split)
    has not yet: the activations a worker holds at once, in chunks."""
    split = split_keys(stage_actions)
    live = peak = 0
    for a in stage_actions:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == (WEIGHT if (a.chunk, a.mb) in split else BACKWARD):
            live -= 1
    return peak
