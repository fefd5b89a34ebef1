"""One Tune trial: a raytrain run in the trial's own placement group, reporting every step to Tune.

Ray pickles the trainable by reference, so ``raytrain_trainable`` must stay importable by this module
path (``raytrain.tune.trainable.raytrain_trainable``) in every trial's process.
"""

from __future__ import annotations

import os
import time

import ray
from ray import tune

from raytrain.tune.space import BASE_KEY, trial_config


def raytrain_trainable(params: dict) -> None:
    """One trial: a raytrain run in this trial's placement group, reporting every step."""
    from raytrain import checkpoint
    from raytrain.driver.prepare import prepare
    from raytrain.driver.run import run

    started = time.time()
    base = params[BASE_KEY]
    overrides = dict(params)
    trial_dir = tune.get_context().get_trial_dir()
    # Each start of the trial (first, resumed, or cloned by PBT) gets its own run and checkpoint
    # directories, so a restart never mistakes an older incarnation's checkpoint for its latest.
    run_dir = os.path.join(trial_dir, f"run-{int(started * 1000)}")
    # Tune attaches each checkpoint to the metrics of its step, so a trial saves synchronously.
    overrides.update({"run.dir": trial_dir, "run.name": os.path.basename(run_dir),
                      "checkpoint.dir": os.path.join(run_dir, "checkpoints"), "checkpoint.async_save": False})
    restored = tune.get_checkpoint()
    local_ckpt = None
    if restored is not None:
        local_ckpt = restored.to_directory(os.path.join(run_dir, "restored"))
        overrides["checkpoint.resume"] = local_ckpt
    cfg = trial_config(base, overrides)
    if local_ckpt is not None and checkpoint.read_manifest(local_ckpt)["step"] >= cfg.train.steps:
        return  # paused (PBT) or interrupted at its last step: nothing is left to train
    state = {"first_step_s": None, "samples": 0, "seconds": 0.0, "eval_step": 0, "ended": False,
             "eval": {"eval_loss": float("nan"), **{f"eval_{m}": float("nan") for m in cfg.eval.metrics}}}

    def report(rows: list[dict]) -> None:
        for row in rows:
            if "step" not in row or "loss" not in row or state["ended"]:
                continue
            if state["first_step_s"] is None:
                state["first_step_s"] = time.time() - started
            # The first step pays for warm-up; a step rolled forward after a repair has no timing.
            if (row["step"] > 1 or local_ckpt is not None) and "step_s" in row:
                state["samples"] += cfg.train.global_batch
                state["seconds"] += row["step_s"]
            metrics = {
                "step": row["step"], "loss": row["loss"],
                "samples_per_s": state["samples"] / state["seconds"] if state["seconds"] else row.get("samples_per_s", 0.0),
                "bubble": row.get("bubble"), "layout": cfg.layout().label, "first_step_s": state["first_step_s"],
            }
            if "eval_loss" in row:
                state["eval"].update({k: row[k] for k in state["eval"]})
                state["eval_step"] = row["step"]
            if cfg.eval.every:  # every report has the latest values (NaN before the first): Tune wants its metric in each
                metrics.update(state["eval"], eval_step=state["eval_step"])
            ckpt = tune.Checkpoint.from_directory(row["checkpoint"]) if row.get("checkpoint") else None
            try:
                tune.report(metrics, checkpoint=ckpt)
            except SystemExit:
                # Tune ends a paused or stopped trial's thread with SystemExit from report; the run
                # stops on it, and the rows its teardown still forwards must not report again, for
                # a second report would wait forever on the session's lock.
                state["ended"] = True
                raise

    pg = ray.util.get_current_placement_group()
    run(prepare(cfg), stream=open(os.devnull, "w"), on_rows=report, placement=(pg, 0))
