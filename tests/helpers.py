"""Test helpers: a fake worker group that runs the coordinator's state machine without processes.

``FakeWorkerGroup`` implements the worker protocol (``raytrain.control.protocol.WorkerGroup``). Its workers keep a
stand-in for their state: the chain of the steps they applied (``value``), which only equals the
fault-free chain if every step was applied exactly once, in order. Faults use the same
``replica:stage@step:phase`` spec as real workers (``elastic.faults``); a step's fate is decided for
all of its workers at once, as the real collectives would: a worker lost before the vote fails
the step everywhere, one lost after it leaves the others committed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from raytrain import checkpoint
from raytrain.config.faults import Fault
from raytrain.control.membership import Member
from raytrain.control.protocol import Outcome, StepFailed, WorkerGroup, WorkersLost, lost_members
from raytrain.reports import BackgroundSave, DrainNotice, EvalReport, JoinReport, ShardReport, StepReport

# Logical CPU slots for the session's Ray: dp=4 and dp=2 x pp=2 need 4 workers of 1 slot each.
# Each worker runs one torch thread, so 4 slots on 2 cores oversubscribe time, never correctness.
TEST_RAY_CPUS = 4

MODULUS = 1_000_000_007


def chain(steps: range, start: int = 0) -> int:
    """The value a worker holds after applying ``steps`` in order (from ``start``)."""
    value = start
    for s in steps:
        value = (value * 31 + s + 1) % MODULUS
    return value


def fake_eval_loss(value: int) -> float:
    """The held-out loss a fake worker reports when its state is ``value``."""
    return (value % 1000) / 100


@dataclass
class FakeWorker:
    stage: int
    pid: int
    alive: bool = True
    started: bool = True
    committed: int = 0
    prepared: Optional[int] = None
    value: int = 0
    rank: Optional[int] = None
    replica: Optional[int] = None
    joined: bool = False
    faults: list = field(default_factory=list)
    share: int = 0  # rows of each global batch its replica takes (set by join)
    writing: Optional[tuple] = None  # a background save: (ckpt_dir, value, committed) it is writing
    saved: Optional[BackgroundSave] = None
    draining: Optional[DrainNotice] = None  # a ``sigterm`` fault's notice: the worker finishes its step
    drain_boundary: Optional[int] = None  # a step its vote said not to run in this generation
    start_at: Optional[int] = None  # not started yet: up once the group has sent this many steps

    def fault(self, step: int, phase: str) -> bool:
        return any((f.replica, f.stage, f.step, f.phase) == (self.replica, self.stage, step, phase)
                   for f in map(Fault.parse, self.faults))


class FakeReply:
    """A reply of a call whose outcome is collected later: decided when first collected."""

    def __init__(self, resolve):
        self._resolve, self._done, self._outcome = resolve, False, None

    def outcome(self, member: Member) -> Outcome:
        if not self._done:
            self._outcome, self._done = self._resolve(member), True
        return self._outcome


class FakeWorkerGroup(WorkerGroup):
    """In-process workers; ``capacity`` bounds how many replacements can start (None: unbounded),
    ``nonfinite_steps`` are steps whose loss is NaN, ``init_error`` makes every worker's start fail."""

    def __init__(self, pp: int, initial: int, capacity: Optional[int] = None, nonfinite_steps=(),
                 init_error: Optional[str] = None, hangs_in: Optional[str] = None, oom_in: Optional[str] = None,
                 oom_times: int = 1, notice_s: float = 30.0, elsewhere_delay: int = 0):
        """``hangs_in``: the first call of that protocol method (on any worker) never answers, as a hung
        process would: the caller sees it silent. ``oom_in``: in the first ``oom_times`` calls of that method,
        Ray's memory monitor kills the worker (as do ``oom`` faults in a step). ``notice_s``: the time a
        ``sigterm`` fault's notice gives (elastic.drain_grace_s). ``elsewhere_delay``: a worker started by
        ``spawn_elsewhere`` is up once that many more steps were sent."""
        self.pp, self.initial, self.capacity, self.hangs_in, self.oom_in = pp, initial, capacity, hangs_in, oom_in
        self.oom_left, self.notice_s, self.elsewhere_delay = oom_times, notice_s, elsewhere_delay
        self.nonfinite_steps, self.init_error = set(nonfinite_steps), init_error
        self.workers: list[FakeWorker] = []
        self.granted_tokens: set = set()
        self.spawned = 0
        self.elsewhere = 0  # workers started by spawn_elsewhere
        self.closed = False
        self.cancelled = 0  # spawn_elsewhere workers cancelled
        self.holds: list[tuple[int, bool]] = []  # (step, hold) of every send_step

    # --- starting and ending workers ----------------------------------------------------------

    def spawn(self, stage: int, placement, bundle: int, shard: int = 0, tp: int = 0) -> Member:
        self.spawned += 1
        worker = FakeWorker(stage, pid=10_000 + self.spawned)
        replacements = sum(1 for w in self.workers[self.initial:] if w.started)
        worker.started = self.spawned <= self.initial or self.capacity is None or replacements < self.capacity
        self.workers.append(worker)
        return Member(worker, stage, placement, bundle, ready=worker, shard=shard, tp=tp, beat_id=self.spawned)

    def spawn_elsewhere(self, stage: int, shard: int = 0, tp: int = 0) -> Member:
        self.elsewhere += 1
        member = self.spawn(stage, FakePlacement(f"elsewhere-{self.elsewhere}"), 0, shard=shard, tp=tp)
        if member.handle.started and self.elsewhere_delay:  # it starts once that many more steps were sent
            member.handle.started, member.handle.start_at = False, len(self.holds) + self.elsewhere_delay
        return member

    def cancel_elsewhere(self, member: Member) -> None:
        self.kill(member)
        if isinstance(member.placement, FakePlacement) and member.placement.name.startswith("elsewhere"):
            self.cancelled += 1

    def close(self) -> None:
        self.closed = True

    def started(self, members: list[Member], timeout: float) -> list[Member]:
        for m in members:
            if m.handle.start_at is not None and len(self.holds) >= m.handle.start_at:
                m.handle.started = True
        return [m for m in members if m.handle.started]

    def pid(self, member: Member, timeout: float) -> Optional[int]:
        if self.init_error:
            raise StepFailed(f"a worker of stage {member.stage} failed to start: ValueError: {self.init_error}")
        return member.handle.pid if member.handle.alive else None

    def granted(self, requests: list, timeout: float) -> list:
        return [(pg, r) for pg, r in requests if r in self.granted_tokens]

    def kill(self, member: Member) -> None:
        member.handle.alive = False

    def kill_hung(self, member: Member) -> None:
        self.kill(member)

    # --- calls every member answers before the caller goes on ---------------------------------

    def join(self, ranked: list[tuple[int, Member]], mesh, shares: list[int], store, generation: int,
             faults: list[str]) -> list[JoinReport]:
        calls = {id(m): rank for rank, m in ranked}
        return self._answers("join", [m for _, m in ranked],
                             lambda m, w: self._join(w, calls[id(m)], mesh, shares, generation, faults))

    def sync_state(self, sources: list[tuple[Member, int]]) -> list[int]:
        ranks = {id(m): src for m, src in sources}
        return self._answers("sync_state", [m for m, _ in sources], lambda m, w: self._sync_state(w, ranks[id(m)]))

    def skip_step(self, members: list[Member], step: int) -> list[int]:
        return self._answers("skip_step", members, lambda m, w: self._skip_step(w, step))

    def evaluate(self, members: list[Member], timeout: float) -> list[EvalReport]:
        return self._answers("evaluate", members, lambda m, w: self._evaluate(w))

    def save(self, members: list[Member], ckpt_dir: str) -> list[ShardReport]:
        return self._answers("save", members, lambda m, w: self._save(w, ckpt_dir))

    def start_save(self, members: list[Member], ckpt_dir: str) -> list[float]:
        return self._answers("start_save", members, lambda m, w: self._start_save(w, ckpt_dir))

    def finish_save(self, members: list[Member]) -> list[Optional[BackgroundSave]]:
        return self._answers("finish_save", members, lambda m, w: self._finish_write(w))

    def load(self, members: list[Member], ckpt_dir: str) -> None:
        self._answers("load", members, lambda m, w: self._load(w, ckpt_dir))

    def state_digest(self, members: list[Member]) -> list[str]:
        return self._answers("state_digest", members, lambda m, w: f"{w.value}@{w.committed}")

    def _answers(self, method: str, members: list[Member], act) -> list:
        outcomes = [self._outcome(method, m, act) for m in members]
        dead = lost_members(self, outcomes)  # as RayWorkerGroup: the silent are killed too
        if dead:
            raise WorkersLost(dead)
        return [o.value for o in outcomes]

    # --- calls whose replies are collected later ----------------------------------------------

    def send_step(self, members: list[Member], step: int, trace: bool, hold: bool = False) -> list:
        self.holds.append((step, hold))
        batch = {"hold": hold}
        return [FakeReply(lambda m, b=batch: self._step_outcome(m, members, step, b)) for _ in members]

    def send_commit_prepared(self, members: list[Member], step: int) -> list:
        return [FakeReply(lambda m: self._outcome("send_commit_prepared", m, lambda _, w: self._commit_prepared(w, step)))
                for _ in members]

    def send_leave(self, members: list[Member]) -> None:
        for m in members:
            m.handle.joined = False

    def collect(self, members: list[Member], replies: list, timeout: float, settle_s=None) -> list[Outcome]:
        return [reply.outcome(m) for m, reply in zip(members, replies)]

    # --- worker behaviour -----------------------------------------------------------------------

    def _outcome(self, method: str, member: Member, act) -> Outcome:
        """``act(member, worker)``'s value as the member's outcome: dead, silent (``hangs_in``) or answered."""
        w = member.handle
        if not w.alive:
            return Outcome(member, dead=True)
        if method == self.hangs_in:
            self.hangs_in = None
            return Outcome(member, silent=True)
        if method == self.oom_in:
            self.oom_left -= 1
            if self.oom_left == 0:
                self.oom_in = None
            return self._killed_for_memory(member)
        try:
            return Outcome(member, act(member, w))
        except _Died:
            return Outcome(member, dead=True)

    def _killed_for_memory(self, member: Member) -> Outcome:
        """Ray's memory monitor kills the member: its call fails with the OutOfMemoryError Ray raises, which
        the real classification (raytrain.control.workergroup.memory_loss) turns into the member's ``oom``."""
        from raytrain.control.workergroup import memory_loss

        member.handle.alive = False
        member.oom = memory_loss(ray_out_of_memory_error(member.handle.pid), member)
        return Outcome(member, dead=True)

    def _join(self, w: FakeWorker, rank: int, mesh, shares: list[int], generation: int, faults: list[str]) -> JoinReport:
        w.rank, (w.replica, _), w.faults, w.joined = rank, mesh.coords(rank), list(faults), True
        w.drain_boundary = None
        w.share = shares[w.replica]
        if generation > 0 and w.fault(w.committed, "join"):
            w.alive = False
            raise _Died()
        return JoinReport(rank=rank, committed=w.committed, pid=w.pid)

    def _commit_prepared(self, w: FakeWorker, step: int) -> int:
        if w.prepared == step and w.committed == step:
            w.value, w.committed, w.prepared = chain(range(step, step + 1), w.value), step + 1, None
        return w.committed

    def _skip_step(self, w: FakeWorker, step: int) -> int:
        w.committed, w.prepared = step + 1, None
        return w.committed

    def _sync_state(self, w: FakeWorker, src_rank: int) -> int:
        source = next(o for o in self.workers if o.alive and o.joined and o.rank == src_rank)
        w.value, w.committed, w.prepared = source.value, source.committed, None
        return w.committed

    def _evaluate(self, w: FakeWorker) -> EvalReport:
        """A held-out loss that is a function of the steps the worker applied (``fake_eval_loss``), so
        that an evaluation of any other state shows; summed over its replica's rows, as a last stage does."""
        if w.fault(w.committed, "eval"):
            w.alive = False
            raise _Died()
        report = EvalReport(rank=w.rank, step=w.committed, ok=True)
        if w.stage == self.pp - 1:
            report.loss_sum, report.rows = w.share * fake_eval_loss(w.value), w.share
        return report

    def _save(self, w: FakeWorker, ckpt_dir: str) -> ShardReport:
        if w.fault(w.committed, "checkpoint"):
            checkpoint.write_bytes(f"{ckpt_dir}/stage-{w.stage}.json", b"half")
            w.alive = False
            raise _Died()
        data = json.dumps({"value": w.value}).encode()
        checkpoint.write_bytes(f"{ckpt_dir}/stage-{w.stage}.json", data)
        return ShardReport(entry={"file": f"stage-{w.stage}.json", "bytes": len(data)}, finite=True)

    def _start_save(self, w: FakeWorker, ckpt_dir: str) -> float:
        """Snapshot: the write happens during the worker's next step (or when it is waited for)."""
        w.writing, w.saved = (ckpt_dir, w.value, w.committed), None
        return 0.0

    def _finish_write(self, w: FakeWorker) -> Optional[BackgroundSave]:
        """Write the snapshot taken by ``_start_save``, as the real worker's thread does; its fault kills it."""
        if w.writing is not None:
            ckpt_dir, value, committed = w.writing
            w.writing = None
            if w.fault(committed, "checkpoint"):
                checkpoint.write_bytes(f"{ckpt_dir}/stage-{w.stage}.json", b"half")
                w.alive = False
                raise _Died()
            data = json.dumps({"value": value}).encode()
            checkpoint.write_bytes(f"{ckpt_dir}/stage-{w.stage}.json", data)
            w.saved = BackgroundSave(ckpt_dir, ShardReport(entry={"file": f"stage-{w.stage}.json", "bytes": len(data)},
                                                           finite=True))
        return w.saved

    def _load(self, w: FakeWorker, ckpt_dir: str) -> None:
        w.value = json.loads(checkpoint.read_bytes(f"{ckpt_dir}/stage-{w.stage}.json"))["value"]
        w.committed, w.prepared = checkpoint.read_manifest(ckpt_dir)["step"], None

    def _step_outcome(self, member: Member, members: list[Member], step: int, batch: dict) -> Outcome:
        """One member's outcome of ``step``; the fate of the whole step is decided on first use."""
        if "fate" not in batch:
            batch["fate"] = self._step_fate(members, step, batch["hold"])
        return batch["fate"][id(member)]

    def _step_fate(self, members: list[Member], step: int, hold: bool) -> dict:
        for m in members:  # a background save's write ends while the step runs (or kills its writer)
            if m.handle.alive:
                try:
                    self._finish_write(m.handle)
                except _Died:
                    pass
        live = [m for m in members if m.handle.alive]
        runnable = [m for m in live if m.handle.joined and m.handle.committed == step]
        for m in runnable:
            if m.handle.fault(step, "sigterm") and m.handle.draining is None:
                m.handle.draining = DrainNotice("SIGTERM", time.time(), time.time() + self.notice_s)
        if runnable and all(m.handle.drain_boundary == step for m in runnable):  # the vote before said so
            return {id(m): Outcome(m, dead=True) if not m.handle.alive else
                    Outcome(m, self._report(m.handle, step, ok=False, drain_skipped=True)) for m in members}
        leaving = not hold and any(m.handle.draining is not None for m in runnable)  # counted in the step's vote
        dying = {id(m): phase for m in runnable for phase in ("forward", "backward", "allreduce", "optimizer", "oom")
                 if m.handle.fault(step, phase)}
        broken = len(runnable) < len(members)  # a peer was already gone: the collective fails
        before_vote = broken or any(p != "optimizer" for p in dying.values())
        fate = {}
        for m in members:
            w = m.handle
            if dying.get(id(m)) == "oom":
                fate[id(m)] = self._killed_for_memory(m)
            elif not w.alive or id(m) in dying:
                w.alive = False
                fate[id(m)] = Outcome(m, dead=True)
            elif m not in runnable or before_vote:
                w.joined = w.joined and m not in runnable
                fate[id(m)] = Outcome(m, self._report(w, step, ok=False))
            elif step in self.nonfinite_steps:
                fate[id(m)] = Outcome(m, self._report(w, step, ok=False, nonfinite=True))
            else:
                w.prepared = step
                self._commit_prepared(w, step)
                w.drain_boundary = step + 1 if leaving else None
                fate[id(m)] = Outcome(m, self._report(w, step, ok=True, drain_after=leaving))
        return fate

    def _report(self, w: FakeWorker, step: int, ok: bool, nonfinite: bool = False, drain_after: bool = False,
                drain_skipped: bool = False) -> StepReport:
        report = StepReport(rank=w.rank, step=step, ok=ok, committed=w.committed, prepared=w.prepared,
                            error="" if ok else "a peer was lost", nonfinite=nonfinite, busy_s=0.001, wall_s=0.001,
                            pipeline_s=0.001, peak_live=1, grad_norm=float("nan") if nonfinite else 1.0,
                            peak_mem_mb=1.0, saved=w.saved, draining=w.draining, drain_after=drain_after,
                            drain_skipped=drain_skipped)
        if w.stage == self.pp - 1:
            report.loss_sum = float("nan") if nonfinite else 1.0
        return report


RAY_OOM_MESSAGE = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.7, "
    "ID: 92edc4e97e4dac3cee61126133ee7ab6d0a2ee73803623d24a02979d) was 22.81GB used / 23.50GB limit (0.970638)\n"
    "OOM kill reason: memory usage exceeded the memory usage threshold\n"
    "Killed workers: (task=StageWorker.save, pid={pid}, actual memory used=6.93GB, worker ID=39416ad9)\n"
    "Top 10 memory users: PID\tMEM(GB)\tCOMMAND\n{pid}\t6.93\tray::StageWorker.save\n"
    "Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/"
    "ray-observability/user-guides/debug-apps/debug-memory.html. To adjust the kill threshold, set the "
    "environment variable `RAY_memory_usage_threshold` when starting Ray.")
"""The message of the OutOfMemoryError Ray 2.60 raises for a call of an actor its memory monitor killed
(the raylet's format: ``%d worker(s) were killed ... was %sGB used / %sGB limit (%f)``)."""


def ray_out_of_memory_error(pid: int):
    import ray

    return ray.exceptions.OutOfMemoryError(RAY_OOM_MESSAGE.format(pid=pid))


class _Died(Exception):
    """A fake worker died in the middle of a call."""


class FakePlacement:
    """A placement group whose ``ready()`` token the test grants with ``group.granted_tokens.add``."""

    def __init__(self, name: str):
        self.name = name

    def ready(self) -> Any:
        return self.name


def fake_config(tmp_path, *overrides: str):
    from raytrain.config import load_config

    cfg = load_config(None, ["train.global_batch=8", "train.steps=6", f"checkpoint.dir={tmp_path / 'ckpt'}",
                             "elastic.capacity_wait_s=0.2", "run.trace_steps=0", *overrides])
    os.makedirs(cfg.checkpoint.dir, exist_ok=True)
    return cfg


def fake_prepared(cfg, pp: int = 1, resume=None, num_samples: int = 1000):
    """A PreparedRun for a coordinator over fake workers: one layer per stage, samples that nothing reads."""
    import dataclasses

    from raytrain.config.prepared import ModelFacts, PreparedRun
    from raytrain.data.samples import DataSource, SampleSpec
    from raytrain.data.shards import one_file

    layout = dataclasses.replace(cfg.layout().for_model(pp, "fake"), cuts=tuple(range(1, pp)))
    source = DataSource(one_file("unused", num_samples), SampleSpec.tokens(cfg.model.seq_len))
    return PreparedRun(cfg=cfg, layout=layout, source=source, num_samples=num_samples,
                       model=ModelFacts((1,) * pp, 1), resume=resume)


# --- real runs: holding workers at a step, comparing replicas -------------------------------------


def assert_replicas_identical(result, replicas: int) -> None:
    """Every replica of every stage (of every shard of it) ends with the same parameters and
    optimizer state (the digests ``run.record_samples`` collects), and there are ``replicas`` of each."""
    by_stage: dict[str, list[str]] = {}
    for slot, digest in result.state_digests.items():
        by_stage.setdefault(slot.split(":", 1)[1], []).append(digest)
    assert by_stage, "no digests: set run.record_samples=true"
    for stage, digests in by_stage.items():
        assert len(digests) == replicas and len(set(digests)) == 1, f"stage {stage}: {digests}"


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, as a ``pause`` fault leaves it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


class WhenPaused:
    """Runs ``acts[i](paused_pids, started_row)`` in a thread at the i-th time ``count`` of the run's
    workers are stopped by ``pause`` faults (and the driver has received the rows up to
    ``after_step``); each act must resume them. After the last act it keeps resuming any worker
    paused later (a restarted run reaches the same pause again) until the run ends. Feed it the
    run's rows (``on_rows``)."""

    def __init__(self, count: int, *acts, after_step: int = 0, timeout_s: float = 120.0):
        self.count, self.acts, self.after_step, self.timeout_s = count, list(acts), after_step, timeout_s
        self.started: dict = {}
        self.last_step = 0
        self.done_acts = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @property
    def acted(self) -> bool:
        return self.done_acts == len(self.acts)

    def on_rows(self, rows: list[dict]) -> None:
        for row in rows:
            if row.get("event") == "started" and not self.started:
                self.started.update(row)
            if "event" not in row:
                self.last_step = max(self.last_step, row.get("step", 0))

    def __enter__(self) -> "WhenPaused":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.wait(0.05) and time.monotonic() < deadline:
            paused = sorted(p for p in stage_worker_pids() if stopped(p))
            ready = self.started and self.last_step >= self.after_step  # the driver has every row so far
            if not self.acted and len(paused) >= self.count and ready:
                self.acts[self.done_acts](paused, self.started)
                self.done_acts += 1
            elif self.acted:
                for pid in paused:
                    os.kill(pid, signal.SIGCONT)


# --- comparing parameters; finding worker processes -----------------------------------------------

# Long runs at lr 1e-2 drift from the single-process reference by float rounding alone (a different
# summation order per layout, amplified over hundreds of Adam steps: 0.5 relative after 1500 steps
# of a fault-free dp=2 run). At lr 1e-3 the drift stays under 1e-6, so long runs use it and every
# run is still held to 1e-5.
LONG_RUN_LR = "train.lr=1e-3"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of two tensors (0 for identical)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def assert_same_params(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Every parameter present in both and equal to ``rtol`` relative (norm-wise per tensor)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    worst = max(((relative_error(got[k], want[k]), k) for k in want))
    assert worst[0] <= rtol, f"parameter {worst[1]} differs by {worst[0]:.2e} relative (> {rtol})"


def reference_state(cfg, steps=None) -> dict:
    from raytrain.testing.reference import train_reference

    from raytrain.models.layers import persistent_buffer_names

    model, _ = train_reference(cfg, steps)
    params = {k: v.detach() for k, v in model.named_parameters()}  # a tied parameter once, as checkpoints hold it
    names = persistent_buffer_names(list(model), range(len(model)))  # buffers that are state, as checkpoints hold them
    return {**params, **{n: b.detach() for n, b in zip(names, model.buffers()) if n is not None}}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stage_worker_pids() -> set[int]:
    """Pids of the processes that host a raytrain StageWorker actor of this test session's Ray."""
    return set(_stage_worker_titles())


def _stage_worker_titles() -> dict[int, str]:
    """Title of every StageWorker process descended from this one (the session's Ray runs under
    it: other test sessions on a shared machine have workers of their own)."""
    titles, parents = {}, _parents()
    for pid in parents:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::StageWorker") and _descends_from_us(pid, parents):
            titles[pid] = title
    return titles


def _parents() -> dict[int, int]:
    parents = {}
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _descends_from_us(pid: int, parents: dict[int, int]) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        pid = parents.get(pid, 0)
    return False


def hold_at_the_notice_until_its_replacement_starts(seen: dict) -> Callable[[list[dict]], None]:
    """An ``on_rows`` callback: at the ``notice`` event (a worker told to leave trains on while its
    replacement starts), pause rank 0's worker (not the one told, in the tests that use it) until that
    replacement has started (its pid goes in ``seen["new"]``), so that a run of tiny steps cannot end
    before a fresh process has imported torch."""
    def on_rows(rows: list[dict]) -> None:
        for row in rows:
            if row.get("event") == "started":
                seen["first"], seen["known"] = row["pids"][:1], stage_worker_pids()
            if row.get("event") == "notice" and "new" not in seen:
                seen["new"] = hold_until_a_new_worker_starts(seen["first"], seen["known"])
    return on_rows


def hold_until_a_new_worker_starts(running: list[int], known: set[int], timeout_s: float = 120.0) -> int:
    """Pause the ``running`` workers (SIGSTOP) until a StageWorker not in ``known`` has started, and
    return its pid. A run never waits for a joining worker, so with tiny test steps it could end
    before a fresh process has imported torch; this makes a grow test independent of that race.
    Ray retitles an actor's process from ``ray::StageWorker.__init__`` once the constructor returned."""
    for pid in running:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            started = [p for p, t in _stage_worker_titles().items() if p not in known and not t.endswith("__init__")]
            if started:
                return started[0]
            time.sleep(0.2)
        raise AssertionError(f"no new StageWorker actor finished starting within {timeout_s} s")
    finally:
        for pid in running:
            os.kill(pid, signal.SIGCONT)
