"""What the coordinator's EVALUATING state computes: the held-out loss (``eval_loss``) once every eval.every steps
are committed and after the last step, computed by every worker between two steps (raytrain.worker.stage_eval).

No step is sent ahead across such a boundary (raytrain.control.steps.may_send_ahead), so the workers
evaluate exactly the committed parameters. The value is the mean loss over the same
eval.batches x train.global_batch held-out rows every time: each replica's last stage (each shard of it) sums the
losses of its share of the rows, and the coordinator divides the sum over replicas by the rows
evaluated, so the value does not depend on the layout (dp, pp, schedule, micro-batches) beyond
float summation order. It goes into that step's metrics row (``eval_loss``, ``eval_rows``, ``eval_s``), with
eval.metrics (``eval_accuracy``, ...: sums over the targets' elements, divided once by their count).

A worker lost during an evaluation is repaired as one lost during a step or a save (REPAIRING, one
failure against elastic.max_failures); the evaluation then runs again at the same step on the
re-formed groups. If the repair had to reload a checkpoint, the steps after it run again, and so
does their evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raytrain.config import Config
from raytrain.control import steps
from raytrain.control.crew import Crew
from raytrain.control.ledger import Ledger
from raytrain.control.membership import Member
from raytrain.control.protocol import StepFailed, WorkerGroup, WorkersLost
from raytrain.control.runstate import Interrupted, Repairing, State


@dataclass(frozen=True)
class HeldOutLoss:
    """The held-out loss of the committed parameters: the mean over ``rows`` held-out rows; and eval.metrics,
    each the mean over the held-out targets' elements."""

    loss: float
    rows: int
    metrics: dict = field(default_factory=dict)

    def row(self) -> dict:
        """Its fields in a step's metrics row: ``eval_loss``, ``eval_rows``, ``eval_<metric>``."""
        return {"eval_loss": self.loss, "eval_rows": self.rows, **{f"eval_{k}": v for k, v in self.metrics.items()}}


def evaluate(worker_group: WorkerGroup, members: list[Member], columns: int, timeout_s: float, step: int,
             layout: str) -> HeldOutLoss:
    """Every member evaluates (a silent one is killed: WorkersLost); ``columns`` last stages (every
    shard of every replica evaluates its own rows) report their sums. StepFailed if one failed with
    every worker alive."""
    reports = worker_group.evaluate(members, timeout_s)
    failed = [r for r in reports if not r.ok]
    if failed:
        raise StepFailed(f"the evaluation after step {step} failed with every worker alive "
                         f"(layout {layout}): {failed[0].error}")
    last = [r for r in reports if r.loss_sum is not None]
    assert len(last) == columns, (len(last), columns)
    rows = sum(r.rows for r in last)
    metrics = {name: sum(r.metric_sums[name] for r in last) / max(1, sum(r.metric_counts[name] for r in last))
               for name in last[0].metric_sums}
    return HeldOutLoss(sum(r.loss_sum for r in last) / rows, rows, metrics)


def evaluating(crew: Crew, ledger: Ledger, cfg: Config) -> State:
    """EVALUATING: every member evaluates; the waiting step row gets the loss; then a checkpoint, if one is
    due (a worker lost meanwhile: REPAIRING, which comes back here)."""
    t0, membership = time.perf_counter(), crew.membership
    try:
        held_out = evaluate(crew.worker_group, membership.members(), membership.mesh().columns,
                            cfg.resources.step_timeout_s, ledger.step, crew.label())
    except WorkersLost as lost:
        return Repairing(tuple(lost.dead), Interrupted.EVAL)
    assert ledger.waiting_row is not None, "an evaluation follows a committed step"
    ledger.waiting_row.update(**held_out.row(), eval_s=round(time.perf_counter() - t0, 3))
    return steps.after_commit(ledger, cfg, evaluated=True)
