"""One training step as the coordinator sees it: send ``run_step`` to every member, collect the
replies (raytrain.reports.StepReport), and turn them into a metrics row. Also the rules for what may
happen between two steps, and which state follows a committed step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from raytrain.data import order
from raytrain.config import Config
from raytrain.config.mesh import Mesh
from raytrain.control.ledger import Ledger
from raytrain.control.membership import Member
from raytrain.control.protocol import StepFailed, WorkerGroup, WorkersLost, lost_members
from raytrain.control.runstate import Checkpointing, Evaluating, Running, State
from raytrain.control.workergroup import worker_error
from raytrain.optim.lr_schedule import learning_rate
from raytrain.reports import StepReport


class NonFiniteStep(Exception):
    """Internal: every worker voted against applying ``step`` (a loss or gradient was not finite)."""

    def __init__(self, step: int, results: list[StepReport]):
        super().__init__(f"step {step} was not finite")
        self.step, self.results = step, results


class DrainBoundary(Exception):
    """Internal: every worker skipped ``step`` because workers leave the run before it (the vote of the
    step before said so); it runs again once the run has re-formed without them."""

    def __init__(self, step: int):
        super().__init__(f"step {step} waits for the run to re-form without the workers that leave")


class StepLost(WorkersLost):
    """Workers died during a step; ``reports`` are the survivors' replies (their committed steps)."""

    def __init__(self, dead: list[Member], reports: list[StepReport]):
        super().__init__(dead)
        self.reports = reports


@dataclass
class StepCall:
    """``run_step`` sent to every member; ``started`` is when its time starts to count."""

    step: int
    members: list
    refs: list
    started: Optional[float]  # None while it waits behind the step before it
    hold: bool = False  # a member told to leave in it does not vote to go (raytrain.control.drain)


def send(worker_group: WorkerGroup, members: list[Member], step: int, trace: bool, started: Optional[float],
         hold: bool = False) -> StepCall:
    return StepCall(step, members, worker_group.send_step(members, step, trace, hold), started, hold)


def collect(worker_group: WorkerGroup, call: StepCall, timeout_s: float, layout: str,
            settle_s: Optional[float] = None) -> list[StepReport]:
    """Every member's report of ``call.step``; StepLost, NonFiniteStep, DrainBoundary or StepFailed when
    it did not commit.

    A member silent for longer than a step may take, or for ``settle_s`` after another reported a
    failed collective, is killed and counted as lost.
    """
    outcomes = worker_group.collect(call.members, call.refs, timeout_s, settle_s)
    for o in outcomes:
        if o.silent:
            worker_group.kill_hung(o.member)
        if o.error is not None:
            raise StepFailed(f"step {call.step + 1} raised on a worker of stage {o.member.stage} (layout {layout}): "
                             f"{worker_error(o.error)}")
    reports = [o.value for o in outcomes if o.answered]
    for o in outcomes:
        if o.answered:
            o.member.committed, o.member.saved = o.value.committed, o.value.saved
    dead = [o.member for o in outcomes if not o.answered]
    if dead:
        raise StepLost(dead, reports)
    if any(r.nonfinite for r in reports):
        raise NonFiniteStep(call.step, reports)
    if all(r.drain_skipped for r in reports):
        raise DrainBoundary(call.step)
    failed = [r for r in reports if not r.ok]
    if failed:
        raise StepFailed(f"step {call.step + 1} failed with every worker alive (layout {layout}): {failed[0].error}")
    return reports


def wait_out(worker_group: WorkerGroup, call: Optional[StepCall], timeout_s: float) -> list[Member]:
    """Wait out a step sent ahead of one that failed; returns the members that died meanwhile.

    Workers whose own step failed skip it; the others fail it against their lost peers, so it ends
    within elastic.detect_timeout_s. Their progress (a committed step) is recorded.
    """
    if call is None:
        return []
    outcomes = worker_group.collect(call.members, call.refs, timeout_s)
    for o in outcomes:
        if o.value is not None:
            o.member.committed, o.member.saved = o.value.committed, o.value.saved
    return lost_members(worker_group, outcomes)


def may_send_ahead(step: int, steps: int, checkpoint_every: int, membership_changing: bool,
                   eval_every: int = 0) -> bool:
    """Whether ``step`` may be queued on the workers before the step before it has finished.

    Only when nothing happens between the two: no checkpoint or evaluation after the previous step
    (nor the end of the run), and no replica that may join (a granted placement or a replacement starting).
    """
    return (step < steps and not checkpoint_due(step, steps, checkpoint_every)
            and not eval_due(step, steps, eval_every) and not membership_changing)


def checkpoint_due(committed: int, steps: int, checkpoint_every: int) -> bool:
    """Whether a checkpoint is written once ``committed`` steps are done: every checkpoint.every, and at the end."""
    return committed == steps or bool(checkpoint_every and committed % checkpoint_every == 0)


def eval_due(committed: int, steps: int, eval_every: int) -> bool:
    """Whether the held-out loss is computed once ``committed`` steps are done: every eval.every, and
    at the end (so the run ends with the final parameters' value); never with eval.every=0."""
    return eval_every > 0 and committed > 0 and checkpoint_due(committed, steps, eval_every)


def after_commit(ledger: Ledger, cfg: Config, evaluated: bool = False) -> State:
    """The state after a step was committed (run, rolled forward or skipped): its evaluation, then
    its checkpoint, if due; else the next step, and the step's row goes out now."""
    if not evaluated and eval_due(ledger.step, cfg.train.steps, cfg.eval.every):
        return Evaluating()
    if checkpoint_due(ledger.step, cfg.train.steps, cfg.checkpoint.every):
        return Checkpointing()
    ledger.flush_row(None)
    return Running()


def aggregate_step(step: int, results: list[StepReport], wall_s: float, cfg: Config, mesh: Mesh, layout: str) -> dict:
    """One metrics.jsonl row from every worker's report of a step; ``dp`` is its live replica count."""
    B = cfg.train.global_batch
    # the workers holding the last stage report their loss (the last worker's, or on the V the first's)
    loss = sum(r.loss_sum for r in results if r.loss_sum is not None) / B
    # Bubble: idle share of each replica's pipeline span (its stages x its slowest stage's span).
    bubbles = []
    for replica in range(mesh.dp):
        stages = [r for r in results if mesh.coords(r.rank)[0] == replica]
        span = max(r.pipeline_s for r in stages)
        bubbles.append(1.0 - sum(r.busy_s for r in stages) / (len(stages) * span) if span > 0 else 0.0)
    row = {
        "step": step + 1,
        "loss": loss,
        "grad_norm": results[0].grad_norm,
        "step_s": wall_s,
        "time": time.time(),
        "samples_per_s": B / wall_s,
        "worker_step_s": max(r.wall_s for r in results),
        "data_s": max(r.data_s for r in results),  # the slowest reader holds up its pipeline
        "compile_s": max(r.compile_s for r in results),  # train.compile: every worker compiles at once
        "bubble": sum(bubbles) / len(bubbles),
        "peak_live_activations": {str(r.rank): r.peak_live for r in results},
        "peak_mem_mb": {str(r.rank): round(r.peak_mem_mb, 1) for r in results},
        "layout": layout,
        "lr": learning_rate(cfg.train, step),
        "dp": mesh.dp,
    }
    if any(r.events is not None for r in results):
        row["events"] = {str(r.rank): r.events for r in results if r.events is not None}
    if cfg.run.record_samples:
        row["sample_ids"] = [i for r in sorted(results, key=lambda r: r.rank) for i in r.sample_ids or []]
    return row


def rolled_forward_row(step: int, results: list[StepReport], cfg: Config, mesh: Mesh, num_samples: int, layout: str) -> dict:
    """The row of a step committed by roll-forward: every worker voted for it, some died before replying.

    Its loss is known only if the last stage of every column survived; its samples are the whole
    global batch of the step (every replica had finished its slice before the vote).
    """
    return _unreported_step_row(step, cfg, num_samples, layout, mesh.dp, rolled_forward=True,
                                loss=loss_of(results, cfg, mesh.columns), lr=learning_rate(cfg.train, step))


def loss_of(results: list[StepReport], cfg: Config, columns: int) -> Optional[float]:
    """The step's mean loss when the last stage of every pipeline column (replica, or shard of one:
    ``Mesh.columns``) reported it, else None."""
    last = [r.loss_sum for r in results if r.loss_sum is not None]
    return sum(last) / cfg.train.global_batch if len(last) == columns else None


def skipped_row(step: int, loss: Optional[float], grad_norm: Optional[float], cfg: Config, num_samples: int,
                layout: str, dp: int) -> dict:
    """The row of a step not applied because a value was not finite; its samples count as seen."""
    return _unreported_step_row(step, cfg, num_samples, layout, dp, skipped=True, loss=loss, grad_norm=grad_norm)


def _unreported_step_row(step: int, cfg: Config, num_samples: int, layout: str, dp: int, **fields) -> dict:
    """A committed step's row without the workers' timings; its samples are the whole global batch."""
    B = cfg.train.global_batch
    row = {"step": step + 1, **fields, "time": time.time(), "layout": layout, "dp": dp}
    if cfg.run.record_samples:
        row["sample_ids"] = order.sample_ids(cfg.train.seed, num_samples, step * B, (step + 1) * B,
                                             cfg.data.order_origin)
    return row
