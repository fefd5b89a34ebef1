"""The driver's side of a run: reserve the workers, start the coordinator, relay its metric rows.

``run(prepared)`` trains a prepared run (raytrain.driver.prepare) with the layout it names; ``raytrain.train``
(raytrain.api) chooses the layout first when parallel.auto is set, and Tune trials call ``run``
directly. The driver hosts the rendezvous store, holds the checkpoint directory's lease, restarts
a lost coordinator from the last checkpoint, and writes what a person sees (raytrain.driver.report).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain import checkpoint
from raytrain.config.prepared import PreparedRun
from raytrain.control.coordinator import Coordinator, OutOfMemoryLost
from raytrain.control.crew import Reservation
from raytrain.control.goodput import Goodput
from raytrain.control.protocol import WorkersLost
from raytrain.control.workergroup import killed_by_ray_monitor, remove_replacement_placements, replacement_prefix
from raytrain.driver.connect import cluster_reachable, embedded, ensure_ray, while_reachable
from raytrain.driver.lease import Lease
from raytrain.driver.memory import check_run_memory
from raytrain.driver.placement import check_tp_fits_a_node, placement_groups, request, reserve
from raytrain.driver.prepare import remove_if_empty
from raytrain.driver.rendezvous import RendezvousStore, preload_torch_distributed
from raytrain.driver.report import RunReporter, evaluated
from raytrain.driver.signals import Aborted, StillStopping, StopOnSignal
from raytrain.reports import RunSummary
from raytrain.reports.oom import FIT_ADVICE
from raytrain.worker.actor import StageWorker

POLL_INTERVAL_S = 1.0
"""How often the driver collects metric rows from the coordinator."""
POLL_TIMEOUT_S = 30.0
"""How long the driver waits for a failed coordinator's last metric rows."""

preload_torch_distributed()  # run() hosts the rendezvous store: import torch meanwhile (ray.init, ...)


@dataclass
class Result:
    steps: int
    final_loss: float
    samples_per_s: float
    checkpoint: Optional[str]
    run_dir: str
    layout: str
    metrics: list[dict] = field(default_factory=list, repr=False)
    events: list[dict] = field(default_factory=list, repr=False)
    worker_pids: list[int] = field(default_factory=list, repr=False)
    final_pids: list[int] = field(default_factory=list, repr=False)
    committed_steps: list[int] = field(default_factory=list, repr=False)
    failures: int = 0
    recovery_s: list[float] = field(default_factory=list)
    coordinator_restarts: int = 0
    auto_layout: Optional[dict] = None
    """With parallel.auto: the chosen layout and every probe's layout, samples/s and status."""
    stopped: Optional[str] = None
    """The signal (SIGINT, SIGTERM) that stopped the run early at a step boundary, after a checkpoint."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps (1-based) not applied because their loss or gradient norm was not finite."""
    state_digests: dict[str, str] = field(default_factory=dict, repr=False)
    """With run.record_samples: ``"replica:stage"`` (``"replica:shard:stage"`` with fsdp > 1,
    ``"replica:shard:stage:tp"`` with tp > 1) -> a digest of that worker's parameters and optimizer state
    at the end (the replicas of a stage must be identical)."""
    eval_loss: Optional[float] = None
    """With eval.every: the last held-out loss (computed after the last step, so of the final
    parameters, unless the run stopped early); None without evaluation."""
    eval_metrics: dict = field(default_factory=dict)
    """With eval.metrics: their last values, by name (``eval_accuracy``, ...)."""
    goodput: Optional[dict] = None
    """The share of the wall time from the launch spent in committed steps, and badput by cause
    (raytrain.control.goodput.Goodput.record); None when the coordinator ended with a signal."""

    def summary(self) -> dict:
        """The JSON object printed as the last line of ``python -m raytrain train``."""
        return {"steps": self.steps, "final_loss": self.final_loss, "samples_per_s": self.samples_per_s,
                "checkpoint": self.checkpoint, "run_dir": self.run_dir, "layout": self.layout,
                "failures": self.failures, "recovery_s": self.recovery_s,
                "coordinator_restarts": self.coordinator_restarts, "stopped": self.stopped,
                "skipped_steps": self.skipped_steps, "eval_loss": self.eval_loss, **self.eval_metrics,
                **({"goodput": self.goodput["goodput"], "badput_s": self.goodput["badput_s"]} if self.goodput else {}),
                **({"auto_layout": self.auto_layout["chosen"]} if self.auto_layout else {})}


def run(prepared: PreparedRun, stream=sys.stderr, on_rows: Optional[Callable[[list[dict]], None]] = None,
        placement=None) -> Result:
    """Train ``prepared`` to ``train.steps`` on the current (or an embedded) Ray cluster, with its layout.

    ``on_rows`` receives every batch of new metric rows as they arrive (Tune reports from it).
    ``placement=(placement_group, first_bundle)`` runs the workers in bundles first_bundle.. of an
    existing placement group (a Tune trial's) instead of reserving one. SIGINT or SIGTERM (when
    called from the main thread) stop the run at the next step boundary after a checkpoint; the
    Result's ``stopped`` names the signal. The same signal again within a second is that request; a later
    one aborts at once, raising signals.Aborted, which names the last checkpoint the run committed.
    """
    assert not prepared.cfg.parallel.auto, "parallel.auto chooses the layout before a run (raytrain.train)"
    launched = time.perf_counter()  # goodput's wall time counts from here
    cfg, stages = prepared.cfg, prepared.layout.stage_ranges
    ensure_ray()
    try:
        if placement is None:  # a Tune trial's placement group is Tune's to make
            check_tp_fits_a_node(cfg)
        check_run_memory(cfg, prepared.layout, prepared.model)
    except ValueError:  # exit 2, and the run that claimed its directory leaves nothing behind
        remove_if_empty(prepared.run_dir)
        raise
    held = Lease(cfg.checkpoint.dir, prepared.run_dir).acquire()  # a busy directory is a ValueError: exit 2
    stop = StopOnSignal(stream)
    try:
        reporter = RunReporter(prepared.run_dir, cfg.train.steps, prepared.layout, stream, cfg.run.loggers)
        stream.write(f"[raytrain] {prepared.layout.label}, {len(stages)} stage(s) "
                     f"{[f'{s[0]}-{s[-1]}' for s in stages]}, global batch {cfg.train.global_batch}, "
                     f"{prepared.num_samples} samples" + (f" (+{prepared.held_out} held out)" if prepared.held_out else "")
                     + f"; run dir {prepared.run_dir}\n")
        with stop:
            summary, restarts = _run_coordinators(prepared, placement, reporter, on_rows, stop, launched)
        return _result(prepared, summary, restarts, reporter)
    except KeyboardInterrupt as e:  # an aborting signal: StopOnSignal's, the CLI's outside it, or Ray's re-raise
        raise _aborted(prepared, stop.aborted or getattr(e, "reason", "SIGINT")) from None
    finally:
        held.release()


def _aborted(prepared: PreparedRun, reason: str) -> Aborted:
    """The abort of ``prepared``'s run by signal ``reason``, naming the last checkpoint the run committed."""
    last = _last_committed(prepared.cfg, prepared.resume)
    try:
        steps = checkpoint.read_manifest(last)["step"] if last is not None else 0
    except checkpoint.CheckpointError:
        last, steps = None, 0
    return Aborted(reason, last, steps, prepared.run_dir)


def _last_committed(cfg, resume: Optional[str]) -> Optional[str]:
    """The last checkpoint the run published (of its lineage: a run forked from an older checkpoint of
    checkpoint.dir never counts the newer ones beside it), else the one it resumed from (None when neither)."""
    return checkpoint.latest_of(cfg.checkpoint.dir, cfg.checkpoint.lineage) or resume


def _result(prepared: PreparedRun, summary: RunSummary, restarts: int, reporter: RunReporter) -> Result:
    steps = list({r["step"]: r for r in reporter.steps}.values())  # a restart re-runs steps after its checkpoint
    timed = [r for r in steps[1:] if "step_s" in r]  # the first step pays for warm-up
    batch = prepared.cfg.train.global_batch
    samples_per_s = len(timed) * batch / sum(r["step_s"] for r in timed) if timed else 0.0
    measured = [r for r in steps if "eval_loss" in r]
    return Result(
        steps=summary.steps, final_loss=steps[-1]["loss"] if steps else float("nan"),
        samples_per_s=samples_per_s, checkpoint=summary.checkpoint, run_dir=prepared.run_dir,
        layout=prepared.layout.label, metrics=steps, events=reporter.events, worker_pids=summary.worker_pids,
        final_pids=summary.final_pids, committed_steps=summary.committed_steps, failures=summary.failures,
        recovery_s=summary.recovery_s, coordinator_restarts=restarts, stopped=summary.stopped,
        skipped_steps=[s + 1 for s in summary.skipped_steps], state_digests=summary.digests,
        eval_loss=measured[-1]["eval_loss"] if measured else None,
        eval_metrics={k: v for k, v in evaluated(measured[-1]).items() if k != "eval_loss"} if measured else {},
        goodput=reporter.goodput.record() if reporter.goodput is not None else None,
    )


def _run_coordinators(prepared: PreparedRun, placement, reporter: RunReporter, on_rows, stop,
                      launched: float) -> tuple[RunSummary, int]:
    """Start a coordinator and drive it to the end, restarting it from the last checkpoint when it
    is lost; returns its summary and the number of restarts, after a ``goodput`` event (its wall time
    counted from ``launched``). Placement groups it reserved are removed, and every row received is
    written, however it ends."""
    cfg, resume = prepared.cfg, prepared.resume
    if placement is not None:  # a Tune trial runs in what Tune reserved for it: nothing started elsewhere
        cfg = dataclasses.replace(cfg, elastic=dataclasses.replace(cfg.elastic, replace_at_notice=False))
    rendezvous, groups = RendezvousStore(), []
    try:
        reservation = _placements(cfg, placement, groups)
        here = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        first_created = None
        for restarts in range(cfg.elastic.coordinator_restarts + 1):
            created = time.perf_counter()
            first_created = first_created or created
            # On the driver's node: losing a worker node never takes the coordinator (or its store) with it.
            coordinator = ray.remote(Coordinator).options(
                num_cpus=0, max_concurrency=4, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            ).remote(dataclasses.replace(prepared, cfg=cfg, resume=resume), reservation, worker_cls=StageWorker)
            try:
                store = rendezvous.address(host, namespace=f"coordinator{restarts}")
                summary = _drive(coordinator, store, reporter, on_rows, stop, cfg.elastic.detect_timeout_s)
                if summary.time_book:
                    goodput = Goodput.of(summary.time_book, time.perf_counter() - launched, created - first_created)
                    reporter.add_goodput(goodput)
                return summary, restarts
            except ray.exceptions.RayError as e:
                if stop.reason is not None and (_coordinator_lost(e) or (embedded() and not cluster_reachable())):
                    # The signal reached the coordinator's process too (every process of the job was
                    # signalled): the user asked to stop, so stop at the last checkpoint rather than restart.
                    # With an embedded Ray the signal may end its object store first, so the wait on the
                    # coordinator fails as a lost object rather than a lost actor: the same stop.
                    return _stopped_without_coordinator(cfg, reporter, stop.reason, resume), restarts
                if not _coordinator_lost(e) or restarts == cfg.elastic.coordinator_restarts:
                    reporter.add([{"event": "failed", "error": str(getattr(e, "cause", e)).splitlines()[0][:500]}])
                    if isinstance(e, ray.exceptions.OutOfMemoryError):  # the coordinator itself, each time
                        raise coordinator_out_of_memory(e, _last_committed(cfg, resume)) from None
                    raise getattr(e, "cause", e) if isinstance(e, ray.exceptions.RayTaskError) else e from None
                resume = _last_committed(cfg, resume)
                reporter.add([{"event": "coordinator_restarted", "resume_from": resume, "restarts": restarts + 1,
                               "reason": f"coordinator lost: {str(e).splitlines()[0][:200]}"}])
            finally:  # each clean-up given up once an embedded Ray ends with a signal to the whole group
                if while_reachable(_stop, coordinator):  # then its replacements' placement groups, should it have died
                    while_reachable(remove_replacement_placements, replacement_prefix(cfg))
    finally:
        for group in groups:
            if not while_reachable(remove_placement_group, group):
                break
        rendezvous.close()
        reporter.finish()


def _placements(cfg, placement, groups: list) -> Reservation:
    """Where the run's workers start: a Tune trial's ``placement`` (its placement group, first bundle), or the
    starting replicas reserved here by axis (raytrain.driver.placement); and the replicas asked for beyond
    them (up to elastic.max_dp, and standby replicas), granted whenever capacity appears. The placement groups
    reserved here go into ``groups`` as they are made, to be removed."""
    if placement is not None:  # a Tune trial runs in what Tune reserved for it: nothing is asked elsewhere
        return Reservation(*placement)
    replicas = reserve(cfg, fixed_cluster=embedded())
    groups += placement_groups(replicas)
    extra = (cfg.elastic.max_dp or cfg.parallel.dp) - cfg.parallel.dp + cfg.elastic.standby
    growth = [request(cfg) for _ in range(extra)]
    groups += placement_groups(growth)
    return Reservation(growth=tuple(growth), replicas=tuple(replicas))


def _stopped_without_coordinator(cfg, reporter: RunReporter, reason: str, resume: Optional[str]) -> RunSummary:
    """The summary of a run stopped by a signal that also ended its coordinator: it ends at the last
    published checkpoint (the steps after it were never committed to storage)."""
    last = _last_committed(cfg, resume)
    step = checkpoint.read_manifest(last)["step"] if last is not None else 0
    reporter.add([{"event": "stopped", "step": step, "reason": reason, "checkpoint": last,
                   "note": "the coordinator ended with the signal; resume from this checkpoint"}])
    return RunSummary(steps=step, checkpoint=last, stopped=reason)


def _coordinator_lost(error: Exception) -> bool:
    """Whether the coordinator actor (or a worker in a place it does not repair) was lost, which a
    restart from the last checkpoint fixes, rather than an error the coordinator raised on purpose.
    Ray's memory monitor killing the coordinator is such a loss (an OutOfMemoryError, not an actor error)."""
    if isinstance(error, ray.exceptions.RayTaskError):  # raised in the coordinator: restart only for a lost worker
        return isinstance(getattr(error, "cause", None), (ray.exceptions.RayActorError, WorkersLost))
    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError))


def coordinator_out_of_memory(error: Exception, last_checkpoint: Optional[str]) -> OutOfMemoryLost:
    """The one line of a run whose coordinator Ray's memory monitor killed (after every restart)."""
    kept = f"resume from {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
    return OutOfMemoryLost(f"the coordinator {killed_by_ray_monitor(str(error)).text()}, with "
                           f"elastic.coordinator_restarts used up; {kept}; the node is short of memory: {FIT_ADVICE}")


def _drive(coordinator, store, reporter: RunReporter, on_rows, stop, detect_timeout_s: float) -> RunSummary:
    """Run the coordinator to completion, forwarding its metric rows as they come (also the rows
    it produced before it failed) and a stop request when a signal arrived (then saying, while no step
    ends, what the stop waits for)."""

    def collect(timeout=None):
        rows = ray.get(coordinator.poll.remote(), timeout=timeout)
        reporter.add(rows)
        if on_rows is not None and rows:
            on_rows(rows)

    run_ref = coordinator.run.remote(store)
    stopping: Optional[StillStopping] = None
    try:
        while not ray.wait([run_ref], timeout=POLL_INTERVAL_S)[0]:
            if stop.reason is not None and stopping is None:
                coordinator.request_stop.remote(stop.reason)
                stopping = StillStopping(stop.reason, detect_timeout_s)
            collect()
            if stopping is not None:
                stopping.check(len(reporter.steps))
        summary = ray.get(run_ref)
    finally:
        try:
            collect(timeout=POLL_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass  # the coordinator is gone: its last rows went with it
    return summary


def _stop(coordinator) -> None:
    try:
        ray.get(coordinator.shutdown.remote(), timeout=30)
    except ray.exceptions.RayError:
        pass  # already gone: its workers went with it
    ray.kill(coordinator, no_restart=True)
