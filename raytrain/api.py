"""``raytrain.train(config) -> Result``: the one entry point the CLI, the tests and Tune call."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain import checkpoint, data
from raytrain.config import Config, check_factory
from raytrain.connect import ensure_ray, run_root
from raytrain.coordinator import Coordinator
from raytrain.workergroup import WorkersLost
from raytrain.placement import ResourcesUnavailable, request, reserve  # noqa: F401 (ResourcesUnavailable is public here)
from raytrain.rendezvous import RendezvousStore, preload_torch_distributed
from raytrain.lease import Lease
from raytrain.report import RunReporter
from raytrain.signals import StopOnSignal

POLL_INTERVAL_S = 1.0
"""How often the driver collects metric rows from the coordinator."""
POLL_TIMEOUT_S = 30.0
"""How long the driver waits for a failed coordinator's last metric rows."""

preload_torch_distributed()  # train() hosts the rendezvous store: import torch meanwhile (ray.init, ...)


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
    """With run.record_samples: ``"replica:stage"`` -> a digest of that worker's parameters and
    optimizer state at the end (the replicas of a stage must be identical)."""

    def summary(self) -> dict:
        """The JSON object printed as the last line of ``python -m raytrain train``."""
        return {"steps": self.steps, "final_loss": self.final_loss, "samples_per_s": self.samples_per_s,
                "checkpoint": self.checkpoint, "run_dir": self.run_dir, "layout": self.layout,
                "failures": self.failures, "recovery_s": self.recovery_s,
                "coordinator_restarts": self.coordinator_restarts, "stopped": self.stopped,
                "skipped_steps": self.skipped_steps,
                **({"auto_layout": self.auto_layout["chosen"]} if self.auto_layout else {})}


def prepare(cfg: Config) -> tuple[Config, str, int, list[list[int]], Optional[str]]:
    """Everything that can fail on bad input, done before any actor starts.

    Returns the config with defaults filled in, the dataset path and size, the layer indices of each
    stage, and the checkpoint to resume from.
    """
    check_factory(cfg)
    data_path = data.resolve_data_path(cfg)
    num_samples = data.check_dataset(data_path, cfg.data.column, cfg.model.seq_len, cfg.train.global_batch,
                                     cfg.model.vocab_size)
    stages = [list(r) for r in _stage_ranges(cfg)]
    root = run_root(cfg.run.dir)  # under ~/raytrain in a Ray job: the job's working dir is temporary
    run_name = cfg.run.name or _new_run_name(root, cfg.layout())
    ckpt_dir = cfg.checkpoint.dir or os.path.join(root, run_name, "checkpoints")
    resume = _resume_source(cfg, root, ckpt_dir)
    try:
        checkpoint.check_writable(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.dir={ckpt_dir!r}: {e}; point checkpoint.dir at a writable directory or a "
                         f"pyarrow.fs URI (s3://, gs://, hdfs://) whose credentials this machine has") from e
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=root, name=run_name),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=ckpt_dir),
    )
    return cfg, data_path, num_samples, stages, resume


def _new_run_name(root: str, layout: str) -> str:
    """A timestamp and the layout, with a suffix when a run of the same second already has it."""
    base = time.strftime("%Y%m%d-%H%M%S-") + layout.replace(" ", "_").replace("=", "")
    name, n = base, 1
    while os.path.exists(os.path.join(root, name)):
        n += 1
        name = f"{base}-{n}"
    return name


def _resume_source(cfg: Config, root: str, ckpt_dir: str) -> Optional[str]:
    """The checkpoint ``checkpoint.resume`` names, checked; None when not resuming.

    ``latest`` means checkpoint.dir's latest when checkpoint.dir is set; else the checkpoint published
    last by any run under run.dir (each run has its own default checkpoint directory).
    """
    if cfg.checkpoint.resume is None:
        return None
    where = cfg.checkpoint.resume
    if where == "latest":
        where = ckpt_dir if cfg.checkpoint.dir or cfg.run.name else _newest_run_checkpoint(root) or ckpt_dir
    try:
        resume = checkpoint.resolve(where)
        manifest = checkpoint.read_manifest(resume)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}") from e
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume!r} ({resume}) is at step {manifest['step']}, not before "
            f"train.steps={cfg.train.steps}; raise train.steps to train further"
        )
    return resume


def _newest_run_checkpoint(root: str) -> Optional[str]:
    """The checkpoint published last under ``<root>/*/checkpoints`` (by its manifest's time)."""
    newest, newest_time = None, -1.0
    for run in os.scandir(root) if os.path.isdir(root) else []:
        found = checkpoint.latest(os.path.join(run.path, "checkpoints")) if run.is_dir() else None
        if found is not None:
            published = os.path.getmtime(os.path.join(found, checkpoint.MANIFEST))
            if published > newest_time:
                newest, newest_time = found, published
    return newest


def _layer_count(cfg: Config) -> int:
    if cfg.model.factory is None:
        return cfg.model.n_layer + 2  # embedding, blocks, head
    from raytrain.model import build_model

    return len(build_model(cfg.model, cfg.train.seed).layers)


def _stage_ranges(cfg: Config) -> list[range]:
    p = cfg.parallel
    if cfg.model.factory is None and p.pp == 1:
        return [range(cfg.model.n_layer + 2)]  # no cut to plan: keep torch out of the driver
    import torch

    from raytrain.model import build_model
    from raytrain.partition import balanced_cuts, param_costs, plan_stages, stage_ranges

    if cfg.model.factory is None and p.balance == "params":
        # Parameter counts need no real weights: build on the meta device.
        with torch.device("meta"):
            layers = build_model(cfg.model, cfg.train.seed).layers
    else:
        layers = build_model(cfg.model, cfg.train.seed).layers
    if p.pp > len(layers):
        raise ValueError(f"parallel.pp={p.pp} exceeds the {len(layers)} layers of model.factory; lower parallel.pp")
    if p.split_points is not None:
        if not (0 < p.split_points[0] and p.split_points[-1] < len(layers)):
            raise ValueError(f"parallel.split_points={p.split_points} out of range: cuts must lie in 1..{len(layers) - 1}")
        return stage_ranges(p.split_points, len(layers))
    if p.balance == "time":
        example = torch.zeros(max(1, cfg.train.global_batch // (p.dp * p.microbatches)), cfg.model.seq_len, dtype=torch.long)
        return plan_stages(layers, p.pp, example_input=example)
    return stage_ranges(balanced_cuts(param_costs(layers), p.pp), len(layers))


def train(cfg: Config, stream=sys.stderr, on_rows: Optional[Callable[[list[dict]], None]] = None,
          placement=None) -> Result:
    """Run training to ``train.steps`` on the current (or an embedded) Ray cluster.

    ``on_rows`` receives every batch of new metric rows as they arrive (Tune reports from it).
    ``placement=(placement_group, first_bundle)`` runs the workers in bundles first_bundle.. of an
    existing placement group (a Tune trial's) instead of reserving one. SIGINT or SIGTERM (when
    called from the main thread) stop the run at the next step boundary after a checkpoint; the
    Result's ``stopped`` names the signal. A second signal aborts at once.
    """
    auto_layout = None
    if cfg.parallel.auto:
        prepare(cfg)  # bad input fails before any probe starts
        ensure_ray()
        from raytrain.autolayout import choose_layout

        cfg, auto_layout = choose_layout(cfg, _layer_count(cfg), stream)
    cfg, data_path, num_samples, stages, resume = prepare(cfg)
    run_dir = os.path.join(os.path.abspath(os.path.expanduser(cfg.run.dir)), cfg.run.name)
    held = Lease(cfg.checkpoint.dir, run_dir).acquire()  # a busy directory is a ValueError: exit 2
    try:
        ensure_ray()
        reporter = RunReporter(run_dir, cfg.train.steps, cfg.layout(), stream)
        stream.write(f"[raytrain] {cfg.layout()}, {len(stages)} stage(s) {[f'{s[0]}-{s[-1]}' for s in stages]}, "
                     f"global batch {cfg.train.global_batch}, {num_samples} samples; run dir {run_dir}\n")
        with StopOnSignal(stream) as stop:
            summary, restarts = _run_coordinators(cfg, (data_path, num_samples, stages, resume), placement,
                                                  reporter, on_rows, stop)
    finally:
        held.release()
    steps = list({r["step"]: r for r in reporter.steps}.values())  # a restart re-runs steps after its checkpoint
    timed = [r for r in steps[1:] if "step_s" in r]  # the first step pays for warm-up
    samples_per_s = len(timed) * cfg.train.global_batch / sum(r["step_s"] for r in timed) if timed else 0.0
    return Result(
        steps=summary["steps"], final_loss=steps[-1]["loss"] if steps else float("nan"),
        samples_per_s=samples_per_s, checkpoint=summary["checkpoint"], run_dir=run_dir, layout=cfg.layout(),
        metrics=steps, events=reporter.events, worker_pids=summary["worker_pids"], final_pids=summary["final_pids"],
        committed_steps=summary["committed_steps"], failures=summary["failures"], recovery_s=summary["recovery_s"],
        coordinator_restarts=restarts, auto_layout=auto_layout, stopped=summary["stopped"],
        skipped_steps=[s + 1 for s in summary["skipped_steps"]], state_digests=summary["digests"],
    )


def _run_coordinators(cfg: Config, plan: tuple, placement, reporter: RunReporter, on_rows, stop) -> tuple[dict, int]:
    """Start a coordinator and drive it to the end, restarting it from the last checkpoint when it
    is lost; returns its summary and the number of restarts. Placement groups it reserved are
    removed, and every row received is written, however it ends."""
    data_path, num_samples, stages, resume = plan
    rendezvous, groups = RendezvousStore(), []
    try:
        pg, first_bundle = placement if placement is not None else (reserve(cfg), 0)
        groups += [pg] if placement is None else []
        extra = (cfg.elastic.max_dp or cfg.parallel.dp) - cfg.parallel.dp if placement is None else 0
        growth = [request(cfg, 1) for _ in range(extra)]  # granted whenever capacity appears
        groups += growth
        # The driver built the built-in corpus in its own cache; workers on other machines get its bytes.
        corpus = [ray.put(Path(data_path).read_bytes())] if cfg.data.path is None else None
        here = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        for restarts in range(cfg.elastic.coordinator_restarts + 1):
            # On the driver's node: losing a worker node never takes the coordinator (or its store) with it.
            coordinator = ray.remote(Coordinator).options(
                num_cpus=0, max_concurrency=4, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            ).remote(
                cfg.to_dict(), data_path, num_samples, stages, pg, first_bundle, resume, extra_placements=tuple(growth),
                corpus=corpus)
            try:
                store = rendezvous.address(host, namespace=f"coordinator{restarts}")
                return _drive(coordinator, store, reporter, on_rows, stop), restarts
            except ray.exceptions.RayError as e:
                if not _coordinator_lost(e) or restarts == cfg.elastic.coordinator_restarts:
                    reporter.add([{"event": "failed", "error": str(getattr(e, "cause", e)).splitlines()[0][:500]}])
                    raise getattr(e, "cause", e) if isinstance(e, ray.exceptions.RayTaskError) else e from None
                resume = checkpoint.latest(cfg.checkpoint.dir) or resume
                reporter.add([{"event": "coordinator_restarted", "resume_from": resume, "restarts": restarts + 1,
                               "reason": f"coordinator lost: {str(e).splitlines()[0][:200]}"}])
            finally:
                _stop(coordinator)
    finally:
        for group in groups:
            remove_placement_group(group)
        rendezvous.close()
        reporter.finish()


def _coordinator_lost(error: Exception) -> bool:
    """Whether the coordinator actor (or a worker in a place it does not repair) was lost, which a
    restart from the last checkpoint fixes, rather than an error the coordinator raised on purpose."""
    if isinstance(error, ray.exceptions.RayTaskError):  # raised in the coordinator: restart only for a lost worker
        return isinstance(getattr(error, "cause", None), (ray.exceptions.RayActorError, WorkersLost))
    return isinstance(error, ray.exceptions.RayActorError)


def _drive(coordinator, store, reporter: RunReporter, on_rows, stop) -> dict:
    """Run the coordinator to completion, forwarding its metric rows as they come (also the rows
    it produced before it failed) and a stop request when a signal arrived."""

    def collect(timeout=None):
        rows = ray.get(coordinator.poll.remote(), timeout=timeout)
        reporter.add(rows)
        if on_rows is not None and rows:
            on_rows(rows)

    run_ref = coordinator.run.remote(store)
    asked_to_stop = False
    try:
        while not ray.wait([run_ref], timeout=POLL_INTERVAL_S)[0]:
            if stop.reason is not None and not asked_to_stop:
                coordinator.request_stop.remote(stop.reason)
                asked_to_stop = True
            collect()
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
