"""Pipeline schedules as data: per-stage ordered action lists, a rule checker and a timing model.

No Ray and no torch.distributed here. One executor (raytrain.worker.executor) runs any plan. Sends are
non-blocking and receives block, which is exactly what ``check_plan`` simulates, so a plan that
passes the checker cannot deadlock in the executor.

Actions print compactly: ``F3`` forward micro-batch 3, ``B3`` backward, ``>F3`` send activation to the
next stage, ``<F3`` receive it, ``>B3`` send input gradient to the previous stage, ``<B3`` receive it.

With ``split_backward``, a stage after the first may compute only the input gradient in ``B3`` and
the weight gradients later in ``W3`` (raytrain.pipeline.split_backward), so ``>B3`` leaves a weight-gradient
time sooner. A backward is split exactly when its micro-batch has a ``W`` on that stage. Splitting
costs a little (a graph walk and more autograd calls), so a schedule splits only the backwards whose
``W`` can move into time the stage would otherwise wait. The F/B order does not change:

- GPipe splits every backward and puts the ``W``s after the stage's last backward, where the stage
  waits for the earlier stages' backwards anyway; it keeps every micro-batch alive regardless.
- 1F1B splits the cool-down backwards, the ones after the stage's last forward, with ``W3`` right
  after ``>B3``. In the steady state a stage has no wait to fill, so a split there only adds its
  cost; in the cool-down each split lets the previous stage start one weight-gradient time sooner.
  The memory bound is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class ActionKind(str, Enum):
    """What an action does. Its value is how it prints; a ``str`` so ``Action("F", 0)`` still reads well."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # the weight half of a split backward
    SEND_F = ">F"  # activation to the next stage
    RECV_F = "<F"  # activation from the previous stage
    SEND_B = ">B"  # input gradient to the previous stage
    RECV_B = "<B"  # output gradient from the next stage

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def peer(self) -> int:
        """Offset of the stage a message goes to or comes from (0 for compute)."""
        return {">F": 1, "<B": 1, "<F": -1, ">B": -1}.get(self.value, 0)

    @property
    def flow(self) -> str:
        """The channel a message travels on: ``F`` activations, ``B`` gradients ("" for compute)."""
        return self.value[1:]


FORWARD, BACKWARD, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
COMPUTE = frozenset(k for k in ActionKind if k.is_compute)

Plan = list[list["Action"]]  # plan[stage] = that stage's ordered actions


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    mb: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))  # "F" (as plans are written) -> FORWARD

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


class PlanError(ValueError):
    """A plan breaks a rule (ordering, matching or deadlock); the message names stage and action."""


def _forward_unit(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = [Action(RECV_F, mb)] if stage > 0 else []
    acts.append(Action(FORWARD, mb))
    if stage < num_stages - 1:
        acts.append(Action(SEND_F, mb))
    return acts


def _backward_unit(stage: int, num_stages: int, mb: int) -> list[Action]:
    acts = [Action(RECV_B, mb)] if stage < num_stages - 1 else []
    acts.append(Action(BACKWARD, mb))
    if stage > 0:
        acts.append(Action(SEND_B, mb))
    return acts


def gpipe(num_stages: int, num_microbatches: int, split_backward: bool = False) -> Plan:
    """All forwards, then all backwards: simple, but every micro-batch's activations stay alive."""
    plan = []
    for s in range(num_stages):
        acts = [a for mb in range(num_microbatches) for a in _forward_unit(s, num_stages, mb)]
        acts += [a for mb in range(num_microbatches) for a in _backward_unit(s, num_stages, mb)]
        if split_backward and s > 0:
            acts += [Action(WEIGHT, mb) for mb in range(num_microbatches)]
        plan.append(acts)
    return plan


def one_f_one_b(num_stages: int, num_microbatches: int, split_backward: bool = False) -> Plan:
    """1F1B: p-s-1 warm-up forwards, then alternate forward/backward; at most p-s activations alive."""

    def backward(s: int, mb: int) -> list[Action]:
        cool_down = mb >= num_microbatches - (num_stages - s)  # after the stage's last forward
        weight = [Action(WEIGHT, mb)] if split_backward and s > 0 and cool_down else []
        return _backward_unit(s, num_stages, mb) + weight

    plan = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        acts = [a for mb in range(warmup) for a in _forward_unit(s, num_stages, mb)]
        next_f, next_b = warmup, 0
        while next_f < num_microbatches:
            acts += _forward_unit(s, num_stages, next_f)
            acts += backward(s, next_b)
            next_f, next_b = next_f + 1, next_b + 1
        while next_b < num_microbatches:
            acts += backward(s, next_b)
            next_b += 1
        plan.append(acts)
    return plan


def forward_only(num_stages: int, num_microbatches: int) -> Plan:
    """Every micro-batch's forward in order, no backward: the held-out loss (raytrain.control.evaluation).
    Not a training plan (``check_plan`` wants backwards); ``simulate`` runs it."""
    return [[a for mb in range(num_microbatches) for a in _forward_unit(s, num_stages, mb)] for s in range(num_stages)]


SCHEDULE_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_plan(kind: str, num_stages: int, num_microbatches: int, split_backward: bool = False) -> Plan:
    if kind not in SCHEDULE_BUILDERS:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULE_BUILDERS)}")
    plan = SCHEDULE_BUILDERS[kind](num_stages, num_microbatches, split_backward)
    check_plan(plan, num_microbatches)
    return plan


# --- rule checker -------------------------------------------------------------------------------


def _check_stage_order(plan: Plan, num_microbatches: int) -> None:
    p = len(plan)
    for s, acts in enumerate(plan):
        seen: dict[tuple[ActionKind, int], int] = {}
        for i, a in enumerate(acts):
            if (a.kind, a.mb) in seen:
                raise PlanError(f"stage {s} action {i} ({a!r}) appears twice\n{format_grid(plan, mark=(s, i))}")
            if not 0 <= a.mb < num_microbatches:
                raise PlanError(f"stage {s} action {i} ({a!r}): micro-batch out of range 0..{num_microbatches - 1}")
            seen[(a.kind, a.mb)] = i
        for mb in range(num_microbatches):
            required = [FORWARD, BACKWARD]
            required += [RECV_F, SEND_B] if s > 0 else []
            required += [SEND_F, RECV_B] if s < p - 1 else []
            for kind in required:
                if (kind, mb) not in seen:
                    raise PlanError(f"stage {s} is missing {kind}{mb}\n{format_grid(plan)}")
            before = [(RECV_F, FORWARD), (FORWARD, SEND_F), (FORWARD, BACKWARD), (RECV_B, BACKWARD), (BACKWARD, SEND_B),
                      (BACKWARD, WEIGHT), (SEND_B, WEIGHT)]
            for first, then in before:
                if (first, mb) in seen and (then, mb) in seen and seen[(first, mb)] > seen[(then, mb)]:
                    i = seen[(then, mb)]
                    raise PlanError(
                        f"stage {s} action {i} ({then}{mb}) comes before {first}{mb}\n{format_grid(plan, mark=(s, i))}"
                    )
        extra = [a for a in acts if (s == 0 and a.kind in (RECV_F, SEND_B)) or (s == p - 1 and a.kind in (SEND_F, RECV_B))]
        if extra:
            raise PlanError(f"stage {s} has communication with a stage that does not exist: {extra}")
        if s == 0 and any(a.kind == WEIGHT for a in acts):
            raise PlanError("stage 0 has W actions: it sends no input gradient, so its backward is never split")


def split_microbatches(stage_actions: list[Action]) -> set[int]:
    """The micro-batches whose backward this stage splits: those with a ``W``."""
    return {a.mb for a in stage_actions if a.kind == WEIGHT}


def last_gradient_action(stage_actions: list[Action]) -> int:
    """Index of the action that fills the step's last weight gradients: the last W or whole backward."""
    split = split_microbatches(stage_actions)
    return max(i for i, a in enumerate(stage_actions)
               if a.kind == WEIGHT or (a.kind == BACKWARD and a.mb not in split))


def simulate(plan: Plan, forward_cost: float = 1.0, backward_cost: float = 1.0, weight_cost: float = 0.0,
             split_cost: float = 0.0):
    """Run the plan under the executor's semantics (non-blocking sends, blocking receives).

    A backward costs ``backward_cost``; where the stage has a ``W`` for it, ``weight_cost`` of that
    moves to the ``W`` and the input half costs ``split_cost`` more (the price of splitting).

    Returns ``(finish_time, busy_time_per_stage, timeline)`` where timeline[stage] lists
    ``(start, end, action)`` for compute actions. Raises PlanError on a deadlock or a receive that
    does not match the next message in flight on its channel.
    """
    p = len(plan)
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    # channels[(src, dst, kind)] = FIFO of (mb, time the message is available)
    channels: dict[tuple[int, int, str], list[tuple[int, float]]] = {}
    split = [split_microbatches(acts) for acts in plan]
    cost_of = {FORWARD: forward_cost, WEIGHT: weight_cost}
    input_half_cost = backward_cost - weight_cost + split_cost
    while any(pos[s] < len(plan[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(plan[s]):
                a = plan[s][pos[s]]
                if a.kind in COMPUTE:
                    cost = cost_of.get(a.kind, input_half_cost if a.mb in split[s] else backward_cost)
                    timeline[s].append((clock[s], clock[s] + cost, a))
                    clock[s] += cost
                    busy[s] += cost
                elif a.kind.is_send:
                    channels.setdefault((s, s + a.kind.peer, a.kind.flow), []).append((a.mb, clock[s]))
                else:
                    src = s + a.kind.peer
                    queue = channels.get((src, s, a.kind.flow), [])
                    if not queue:
                        break  # blocked: wait for the peer
                    mb, ready = queue.pop(0)
                    if mb != a.mb:
                        raise PlanError(
                            f"stage {s} action {pos[s]} ({a!r}) would receive micro-batch {mb} from stage {src}: "
                            f"sends and receives are out of order\n{format_grid(plan, mark=(s, pos[s]))}"
                        )
                    clock[s] = max(clock[s], ready)
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [(s, pos[s]) for s in range(p) if pos[s] < len(plan[s])]
            s, i = stuck[0]
            raise PlanError(f"deadlock: stages {[s for s, _ in stuck]} all wait to receive\n{format_grid(plan, mark=(s, i))}")
    leftovers = {k: v for k, v in channels.items() if v}
    if leftovers:
        raise PlanError(f"messages sent but never received: {leftovers}")
    return max(clock), busy, timeline


def check_plan(plan: Plan, num_microbatches: int) -> None:
    """Raise PlanError unless every stage's list is complete and ordered and the whole plan runs."""
    if not plan:
        raise PlanError("a plan needs at least one stage")
    _check_stage_order(plan, num_microbatches)
    simulate(plan)


def idle_fraction(plan: Plan, forward_cost: float = 1.0, backward_cost: float = 1.0, weight_cost: float = 0.0) -> float:
    """Fraction of stage-time spent waiting, for stages of equal cost."""
    finish, busy, _ = simulate(plan, forward_cost, backward_cost, weight_cost)
    return 1.0 - sum(busy) / (finish * len(plan))


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def peak_live_activations(stage_actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward (its weight half, if split) has not yet."""
    split = split_microbatches(stage_actions)
    live = peak = 0
    for a in stage_actions:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == (WEIGHT if a.mb in split else BACKWARD):
            live -= 1
    return peak


def format_grid(plan: Plan, mark: Optional[tuple[int, int]] = None) -> str:
    """One row per stage, one column per action; ``mark=(stage, index)`` brackets a cell."""
    rows = []
    for s, acts in enumerate(plan):
        cells = []
        for i, a in enumerate(acts):
            text = repr(a)
            cells.append(f"[{text}]" if mark == (s, i) else f" {text} ")
        rows.append(f"stage {s}: " + "".join(c.ljust(6) for c in cells))
    return "\n".join(rows)
