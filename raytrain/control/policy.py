"""Elastic choices as data: what the coordinator does after a loss, while short of workers, when a
stage has no up-to-date copy, when a step is not finite. Pure functions of the facts they are
given, so each choice is unit-tested without processes; the coordinator carries the decision out
and records it (with its reason and the config key behind it) in the events of metrics.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class Action(str, Enum):
    ROLL_FORWARD = "roll_forward"
    """Every worker voted for the failed step and some applied it: the others apply it too."""
    RETRY = "retry"
    """Nobody applied the failed step: run it again after the repair."""
    CONTINUE = "continue"
    """Enough replicas are live: re-form the groups and train on (the batch is re-divided)."""
    WAIT = "wait"
    """Fewer than elastic.min_dp replicas: wait for replacements to start."""
    RELOAD = "reload"
    """A pipeline stage lost every up-to-date copy: every worker loads the last checkpoint."""
    GROW = "grow"
    """Started workers can form more replicas (up to elastic.max_dp): bring them in."""
    SKIP = "skip"
    """A step's loss or gradient was not finite: count it as done without applying it."""
    GIVE_UP = "give_up"
    """Stop the run; ``reason`` says why and ``config_key`` what to change."""
    NONE = "none"
    """Nothing to decide: no limit reached, every stage has a live copy, nothing to grow into."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    config_key: Optional[str] = None

    def record(self) -> dict:
        """The decision as the fields of an event row."""
        return {"decision": self.action.value, "reason": self.reason,
                **({"config_key": self.config_key} if self.config_key else {})}


NO_DECISION = Decision(Action.NONE, "nothing to decide")
"""What a choice returns when there is nothing to choose (never None)."""


@dataclass(frozen=True)
class ElasticPolicy:
    min_dp: int
    target_dp: int
    max_failures: int
    capacity_wait_s: float
    skip_nonfinite: int

    def after_failure(self, failures: int) -> Decision:
        """A GIVE_UP once more workers were lost in this run than elastic.max_failures allows."""
        if failures > self.max_failures:
            return Decision(Action.GIVE_UP, f"{failures} repairs after lost workers in one run, more than "
                            f"elastic.max_failures="
                            f"{self.max_failures}: find why workers keep dying (their logs), or raise it",
                            "elastic.max_failures")
        return NO_DECISION

    @staticmethod
    def after_out_of_memory(step: int, last_oom_step: Optional[int]) -> Decision:
        """A GIVE_UP when a worker ran out of memory again at the step (or save) where one already did:
        with nothing committed between them the same layout would only run out once more, so repairing
        up to elastic.max_failures times would spend a reload per try for nothing."""
        if last_oom_step is not None and step == last_oom_step:
            return Decision(Action.GIVE_UP, f"workers ran out of memory twice after step {step} with no step "
                            "committed between: this layout does not fit in the workers' memory", "parallel")
        return NO_DECISION

    @staticmethod
    def settle_step(step: int, committed_by_survivors: list[int]) -> Decision:
        """Commit agreement after a loss during ``step``: a survivor that stepped proves that every
        worker voted, so the others roll forward; otherwise nobody stepped and it is retried."""
        if any(c == step + 1 for c in committed_by_survivors):
            return Decision(Action.ROLL_FORWARD, f"a survivor applied step {step + 1}, so every worker had voted for it")
        return Decision(Action.RETRY, f"no survivor applied step {step + 1}: it runs again after the repair")

    def capacity(self, live_replicas: int, waited_s: float) -> Decision:
        """After dropping broken replicas: train on, wait for replacements, or give up."""
        if live_replicas >= self.min_dp:
            kind = "shrinks to" if live_replicas < self.target_dp else "keeps"
            return Decision(Action.CONTINUE, f"{live_replicas} live replica(s): the run {kind} dp={live_replicas}",
                            "elastic.min_dp")
        if waited_s < self.capacity_wait_s:
            return Decision(Action.WAIT, f"{live_replicas} live replica(s), fewer than elastic.min_dp={self.min_dp}: "
                            "waiting for replacements", "elastic.capacity_wait_s")
        return Decision(Action.GIVE_UP, f"only {live_replicas} replica(s) could be formed, fewer than elastic.min_dp="
                        f"{self.min_dp}, and no capacity returned within elastic.capacity_wait_s={self.capacity_wait_s:g}s",
                        "elastic.min_dp")

    @staticmethod
    def stale_stages(stages: list[str], last_checkpoint: Optional[str]) -> Decision:
        """Stages (or shards of a stage, named by raytrain.control.membership) with no up-to-date worker: their
        state survives only in the last checkpoint. A sharded run at dp=1 has no live copy of a lost shard."""
        if not stages:
            return NO_DECISION
        what = ", ".join(stages)
        if last_checkpoint is None:
            return Decision(Action.GIVE_UP, f"{what} lost every replica and there is no checkpoint to "
                            "reload", "checkpoint.every")
        return Decision(Action.RELOAD, f"{what} lost every replica (no live copy of their state): it "
                        "survives only in the checkpoint, which every worker reloads", "parallel.dp")

    def grow(self, live_replicas: int, formable: int) -> Decision:
        """Bring started workers in at a step boundary when they form more replicas, up to the target."""
        if live_replicas >= self.target_dp or formable <= 0:
            return NO_DECISION
        return Decision(Action.GROW, f"{formable} more replica(s) can be formed: dp {live_replicas} -> "
                        f"{min(self.target_dp, live_replicas + formable)}", "elastic.max_dp")

    def nonfinite(self, skipped_before: int) -> Decision:
        if skipped_before < self.skip_nonfinite:
            return Decision(Action.SKIP, "non-finite loss or gradient norm: not applied", "train.skip_nonfinite")
        return Decision(Action.GIVE_UP, f"non-finite loss or gradient norm ({skipped_before} such step(s) skipped "
                        f"before, train.skip_nonfinite={self.skip_nonfinite})", "train.skip_nonfinite")
