"""The coordinator's EVALUATING state: the held-out loss (``eval_loss``) once every eval.every steps
are committed and after the last step, computed by every worker between two steps (raytrain.worker.stage_eval).

No step is sent ahead across such a boundary (raytrain.control.steps.may_send_ahead), so the workers
evaluate exactly the committed parameters. The value is the mean loss over the same
eval.batches x train.global_batch held-out rows every time: each replica's last stage (each shard of it) sums the
losses of its share of the rows, and the coordinator divides the sum over replicas by the rows
evaluated, so the value does not depend on the layout (dp, pp, schedule, micro-batches) beyond
float summation order. It goes into that step's metrics row (``eval_loss``, ``eval_rows``, ``eval_s``).

A worker lost during an evaluation is repaired as one lost during a step or a save (REPAIRING, one
failure against elastic.max_failures); the evaluation then runs again at the same step on the
re-formed groups. If the repair had to reload a checkpoint, the steps after it run again, and so
does their evaluation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raytrain.control import steps
from raytrain.control.runstate import RunState
from raytrain.control.workergroup import StepFailed, WorkersLost

if TYPE_CHECKING:
    from raytrain.control.coordinator import Coordinator


class Evaluation:
    """EVALUATING for one coordinator (whose team, group and progress it uses)."""

    def __init__(self, coordinator: "Coordinator"):
        self.c = coordinator

    def due(self, committed: int) -> bool:
        """Whether an evaluation follows once ``committed`` steps are done."""
        return steps.eval_due(committed, self.c.cfg.train.steps, self.c.cfg.eval.every)

    def evaluating(self) -> RunState:
        """Every member evaluates; the held step row gets the loss; then a checkpoint, if one is due."""
        c, p = self.c, self.c.progress
        t0 = time.perf_counter()
        calls = [(m, "evaluate", ()) for m in c.team.members()]
        try:
            reports = c.group.call(calls, c.cfg.resources.step_timeout_s)  # a silent worker is killed: lost
        except WorkersLost as lost:
            p.lost, p.reports, p.during = lost.dead, [], "eval"
            return RunState.REPAIRING
        failed = [r for r in reports if not r["ok"]]
        if failed:
            raise StepFailed(f"the evaluation after step {p.step} failed with every worker alive "
                             f"(layout {c.layout()}): {failed[0]['error']}")
        last = [r for r in reports if "loss_sum" in r]
        columns = c.team.mesh().columns  # every shard of every replica evaluates its own rows
        assert len(last) == columns and p.row is not None, (len(last), columns, p.row)
        rows = sum(r["rows"] for r in last)
        p.row.update(eval_loss=sum(r["loss_sum"] for r in last) / rows, eval_rows=rows,
                     eval_s=round(time.perf_counter() - t0, 3))
        return c.after_commit(evaluated=True)
