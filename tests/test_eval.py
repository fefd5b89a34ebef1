"""The held-out loss (eval.every): the same value in every layout as in one plain process, of rows
never trained on, in every place a person or a sweep reads it; bad input refused before any actor
starts; a worker lost during an evaluation repaired like one lost during a step."""

import io
import json
import math
import os

import numpy as np
import pytest
import torch

from raytrain import checkpoint, data, train
from raytrain.api import prepare
from raytrain.config.mesh import Mesh
from raytrain.config.prepared import Slot
from raytrain.control.coordinator import Coordinator
from raytrain.control.crew import Reservation
from raytrain.control.steps import eval_due, may_send_ahead
from raytrain.driver.rendezvous import RendezvousStore
from raytrain.pipeline import checker, schedule
from raytrain.pipeline.actions import FORWARD, RECV_F, SEND_F, Action, Placement
from raytrain.testing.reference import reference_eval_loss, train_reference
from raytrain.worker.phases import PhaseHook
from raytrain.worker.stage import Stage
from tests.forked_stages import held_out_losses, run_stages
from tests.helpers import (FakeWorkerGroup, fake_prepared, assert_replicas_identical, assert_same_params, chain, fake_config,
                           fake_eval_loss, reference_state)

EVAL = ("train.steps=4", "eval.every=2", "eval.batches=2", "data.eval_fraction=0.05")
"""Evaluations after steps 2 and 4, each over 2 x train.global_batch=8 held-out rows."""


def reference_eval_losses(cfg, steps=(2, 4)) -> list[float]:
    """The held-out loss of the single-process reference after each of ``steps``."""
    return [reference_eval_loss(cfg, train_reference(cfg, k)[0]) for k in steps]


def evaluated(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


# --- schedules and rules (no processes) -------------------------------------------------------------


@pytest.mark.parametrize("pp, m", [(1, 1), (2, 2), (4, 3)])
def test_the_evaluation_schedule_is_forwards_only_and_cannot_deadlock(pp, m):
    forward = schedule.forward_only(pp, m)
    checker.simulate(forward)  # raises ScheduleError on a deadlock or an unmatched message
    assert {a.kind for acts in forward for a in acts} <= {FORWARD, SEND_F, RECV_F}
    assert [[a.mb for a in acts if a.kind is FORWARD] for acts in forward] == [list(range(m))] * pp


@pytest.mark.parametrize("placement", [Placement(2, 2), Placement(3, 3), Placement(2, 2, v_shape=True),
                                       Placement(4, 2, v_shape=True)], ids=repr)
def test_the_evaluation_schedule_of_chunked_workers_runs_every_chunk_once_per_micro_batch(placement):
    forward = schedule.forward_only(placement.workers, 3, placement)
    checker.simulate(forward, placement=placement)
    for worker, acts in enumerate(forward):
        forwards = [(a.chunk, a.mb) for a in acts if a.kind is FORWARD]
        assert sorted(forwards) == [(c, mb) for c in range(placement.chunks) for mb in range(3)]
        local = [a for a in acts if a.kind in (SEND_F, RECV_F) and placement.is_local(worker, a.chunk, a.kind.peer)]
        assert not local  # a hand-off between chunks of one worker is no message
    # chunk by chunk, so the micro-batches pipeline: faster than each micro-batch through every stage in turn
    finish, _, _ = checker.simulate(forward, placement=placement)
    def in_stage_order(worker):
        return sorted(range(placement.chunks), key=lambda c: placement.stage(worker, c))

    one_at_a_time = schedule.lower(placement, [[Action(FORWARD, mb, c) for mb in range(3) for c in in_stage_order(w)]
                                               for w in range(placement.workers)])
    assert finish < checker.simulate(one_at_a_time, placement=placement)[0]
    assert finish <= 3 * placement.chunks + placement.num_stages - 1  # every worker busy once the first arrives


def test_evaluations_fall_every_eval_every_steps_and_at_the_end_and_no_step_is_sent_across_one():
    assert [c for c in range(11) if eval_due(c, steps=10, eval_every=4)] == [4, 8, 10]
    assert not any(eval_due(c, steps=10, eval_every=0) for c in range(11))
    assert may_send_ahead(3, steps=10, checkpoint_every=0, membership_changing=False, eval_every=4)
    assert not may_send_ahead(4, steps=10, checkpoint_every=0, membership_changing=False, eval_every=4)
    assert may_send_ahead(4, steps=10, checkpoint_every=0, membership_changing=False)  # eval off


# --- bad input ----------------------------------------------------------------------------------


def _tokens(path, rows: int, width: int = 17) -> str:
    data.write_token_parquet(str(path), np.random.default_rng(0).integers(0, 256, size=(rows, width)))
    return str(path)


@pytest.mark.parametrize("overrides, must_mention", [
    (["eval.every=2"], ["eval.every=2", "data.eval_fraction", "data.eval_path", "eval.every=0"]),
    (["data.eval_fraction=0.1", "data.eval_path=held.parquet"], ["data.eval_fraction=0.1", "data.eval_path", "not both"]),
    # the built-in corpus of the small config: 200000 // 17 = 11764 rows, 0.001 of them is 11
    (["eval.every=2", "data.eval_fraction=0.001", "eval.batches=4"],
     ["data.eval_fraction=0.001", "last 11 of the 11764 rows", "eval.batches=4", "train.global_batch=8", "32",
      "refuses", ">= 0.00272"]),
])
def test_bad_held_out_settings_are_refused_naming_the_keys(make_config, overrides, must_mention):
    with pytest.raises(ValueError) as err:
        prepare(make_config(*overrides))
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


def test_a_bad_eval_path_is_checked_like_data_path(make_config, tmp_path):
    few = _tokens(tmp_path / "few.parquet", rows=10)
    with pytest.raises(ValueError, match=r"data.eval_path='.*few.parquet' has 10 rows.*eval.batches=2 x "
                                         r"train.global_batch=8 = 16"):
        prepare(make_config("eval.every=2", "eval.batches=2", f"data.eval_path={few}"))
    short = _tokens(tmp_path / "short.parquet", rows=20, width=5)
    with pytest.raises(ValueError, match=r"data.eval_path='.*short.parquet': rows .* model.seq_len \+ 1 = 17"):
        prepare(make_config("eval.every=2", f"data.eval_path={short}"))


def test_holding_out_too_many_rows_leaves_too_few_to_train_on(make_config, tmp_path):
    path = _tokens(tmp_path / "forty.parquet", rows=40)
    with pytest.raises(ValueError, match="data.eval_fraction=0.9 holds out the last 36 of the 40 rows, leaving 4 "
                                         "to train on, fewer than train.global_batch=8"):
        prepare(make_config(f"data.path={path}", "data.eval_fraction=0.9"))


def test_the_held_out_rows_are_the_last_and_the_sample_order_never_reaches_them(make_config, tmp_path):
    path = _tokens(tmp_path / "hundred.parquet", rows=100)
    prepared = prepare(make_config(f"data.path={path}", "data.eval_fraction=0.25", "eval.every=2", "eval.batches=3"))
    assert (prepared.num_samples, prepared.held_out) == (75, 25)
    consumed = data.sample_ids(prepared.cfg.train.seed, prepared.num_samples, 0, 3 * 100)
    assert set(consumed) == set(range(75))
    assert data.held_out_source(prepared.cfg, prepared.source, prepared.num_samples) == (prepared.source.train, 75)
    assert data.held_out_ids(75, 1, 8, 4, 8) == [87, 88, 89, 90]  # batch 1, the second replica's half


# --- the coordinator, with fake workers ---------------------------------------------------------


def fake_run(tmp_path, *overrides, dp=2):
    cfg = fake_config(tmp_path, f"parallel.dp={dp}", "data.eval_fraction=0.1", *overrides)
    group = FakeWorkerGroup(1, initial=dp)
    coordinator = Coordinator(fake_prepared(cfg), Reservation(None), worker_group=group)
    summary = coordinator.run(store=None)
    return coordinator, group, summary, coordinator.poll()


def test_the_coordinator_evaluates_the_committed_state_and_holds_the_row_for_it(tmp_path):
    coordinator, _, summary, rows = fake_run(tmp_path, "eval.every=4", "checkpoint.every=2")
    assert evaluated(rows) == {4: fake_eval_loss(chain(range(4))), 6: fake_eval_loss(chain(range(6)))}
    by_step = {r["step"]: r for r in rows if "event" not in r}
    assert by_step[4]["eval_rows"] == 8 and by_step[4]["checkpoint"].endswith("step_00000004")
    assert summary.committed_steps == list(range(6)) and summary.failures == 0


def test_a_worker_lost_during_an_evaluation_is_repaired_and_the_evaluation_run_again(tmp_path):
    coordinator, group, summary, rows = fake_run(tmp_path, "eval.every=2", "elastic.faults=['1:0@4:eval']")
    repair = [r for r in rows if r.get("event") == "repair"]
    assert [(r["during"], r["step"]) for r in repair] == [("eval", 4)] and summary.failures == 1
    assert evaluated(rows) == {s: fake_eval_loss(chain(range(s))) for s in (2, 4, 6)}
    assert group.spawned == 3 and summary.committed_steps == list(range(6))
    assert {m.handle.committed for m in coordinator.membership.members()} == {6}


def test_a_rolled_forward_step_gets_its_evaluation(tmp_path):
    _, _, summary, rows = fake_run(tmp_path, "eval.every=2", "train.global_batch=6",
                                   "elastic.faults=['0:0@3:optimizer']", dp=3)
    rolled = [r for r in rows if r.get("rolled_forward") is True and "event" not in r]
    assert [r["step"] for r in rolled] == [4] and rolled[0]["eval_loss"] == fake_eval_loss(chain(range(4)))
    assert evaluated(rows) == {s: fake_eval_loss(chain(range(s))) for s in (2, 4, 6)}


# --- one Stage in this process ------------------------------------------------------------------


class Recorder(PhaseHook):
    def __init__(self):
        self.calls = []

    def __call__(self, phase, step, file=None):
        self.calls.append((phase, step))


def test_an_evaluation_changes_no_training_state(make_config):
    threads = torch.get_num_threads()
    prepared = prepare(make_config(*EVAL))
    recorder = Recorder()
    stage = Stage(prepared.worker_spec(), Slot(0), make_hook=lambda specs, replica, stage_index, shard: recorder)
    rendezvous = RendezvousStore()
    try:
        stage.join(0, Mesh(), [8], rendezvous.address("127.0.0.1", "eval-state"), generation=0, faults=[])
        assert stage.run_step(0).ok
        digest, grads, rng = stage.state_digest(), [b.clone() for b in stage.grads.buffers], torch.get_rng_state()
        recorder.calls.clear()
        result = stage.evaluate()
        assert stage.state_digest() == digest and torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(a, b) for a, b in zip(stage.grads.buffers, grads))
        assert stage.executor.module.training and stage.committed == 1 and stage.prepared is None
        assert recorder.calls == [("eval", 1)]  # no phase of a training step: no step fault fires
        model, _ = train_reference(prepared.cfg, 1)
        assert result.ok and result.rows == 16
        assert result.loss_sum / result.rows == pytest.approx(reference_eval_loss(prepared.cfg, model), rel=1e-5)
    finally:
        stage.shutdown()
        rendezvous.close()
        torch.set_num_threads(threads)


# --- real runs on Ray actors --------------------------------------------------------------------

# An evaluation runs the forward-only schedule whatever parallel.schedule trains (worker/generation.py):
# gpipe here; the default 1f1b trains dp2xpp2-m2 here and the pp=2 runs of the eval_path and kill tests.
LAYOUTS = {
    "dp1": [],
    "dp2": ["parallel.dp=2"],
    "pp2-gpipe-m2": ["parallel.pp=2", "parallel.schedule=gpipe", "parallel.microbatches=2"],
    "dp2xpp2-m2": ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "fsdp2": ["parallel.fsdp=2"],
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
                "resources.placement_strategy=STRICT_PACK"],
    # two chunks per worker in a V: worker 0 holds the first and the last stage, so it reports the loss
    "pp2-zbv-m2": ["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=2"],
}
ON_ACTORS = ("dp1", "dp2xpp2-m2")
"""Layouts evaluated on actors, through the coordinator to the summary and the progress line (the others
in forked stages)."""


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in ON_ACTORS])
def test_eval_loss_is_the_same_in_every_layout(make_config, layout, tmp_path):
    """The stages run in forked processes (tests/forked_stages.py): the code a StageWorker hosts."""
    cfg = make_config(*EVAL, *LAYOUTS[layout])
    out_dir = str(tmp_path / "stages")
    run_stages(cfg, out_dir, evaluate_after=(2, 4))
    held_out = held_out_losses(out_dir)
    assert list(held_out) == [2, 4] and all(rows == 16 for _, rows in held_out.values())
    assert [loss for loss, _ in held_out.values()] == pytest.approx(reference_eval_losses(cfg), rel=1e-5)


@pytest.mark.parametrize("layout", ON_ACTORS)
def test_eval_loss_on_actors_is_the_reference_and_is_reported_everywhere(ray_session, make_config, layout):
    cfg = make_config(*EVAL, *LAYOUTS[layout])
    out = io.StringIO()
    result = train(cfg, stream=out)
    want = reference_eval_losses(cfg)
    assert list(evaluated(result.metrics)) == [2, 4]
    assert list(evaluated(result.metrics).values()) == pytest.approx(want, rel=1e-5)
    assert all(r["eval_rows"] == 16 for r in result.metrics if "eval_loss" in r)
    # the summary, the progress line and metrics.jsonl say the same
    assert result.eval_loss == result.summary()["eval_loss"] == evaluated(result.metrics)[4]
    assert f"step 4/4 | loss {result.final_loss:.4f} | eval_loss {result.eval_loss:.4f} |" in out.getvalue()
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        written = [json.loads(line) for line in f]
    assert evaluated(written) == evaluated(result.metrics)
    assert os.path.getsize(os.path.join(result.run_dir, "loss.png")) > 0


def test_held_out_rows_are_never_trained_on(ray_session, make_config, tmp_path):
    # 75 training rows and 25 held out; 10 steps of 8 consume the whole first epoch and start the next.
    path = _tokens(tmp_path / "hundred.parquet", rows=100)
    cfg = make_config(f"data.path={path}", "data.eval_fraction=0.25", "eval.every=5", "eval.batches=3",
                      "train.steps=10", "parallel.dp=2", "run.record_samples=true")
    result = train(cfg)
    consumed = [i for r in result.metrics for i in r["sample_ids"]]
    assert len(consumed) == 80 and sorted(consumed[:75]) == list(range(75)) and max(consumed) < 75
    assert list(evaluated(result.metrics).values()) == pytest.approx(reference_eval_losses(cfg, (5, 10)), rel=1e-5)


def test_eval_path_holds_the_rows_of_a_separate_file(ray_session, make_config, tmp_path):
    held = _tokens(tmp_path / "held.parquet", rows=20)
    cfg = make_config("train.steps=2", "eval.every=2", "eval.batches=2", f"data.eval_path={held}",
                      "parallel.pp=2", "parallel.microbatches=2")
    prepared = prepare(cfg)
    assert prepared.held_out == 20 and prepared.num_samples == 200000 // 17  # every row of the corpus is trained on
    result = train(cfg)
    assert result.eval_loss == pytest.approx(reference_eval_losses(cfg, (2,))[0], rel=1e-5)
    assert math.isfinite(result.eval_loss)


def test_a_worker_killed_during_an_evaluation_is_replaced_and_the_evaluation_run_again(ray_session, make_config):
    # Replica 1's stage 0 dies as the evaluation after step 2 starts; its stage 1, waiting for an
    # activation from it, fails its receive and leaves its groups. The repair replaces the dead worker,
    # and the evaluation runs again on the re-formed groups: the same value as without the loss.
    cfg = make_config(*EVAL, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2",
                      "elastic.faults=['1:0@2:eval']", "elastic.detect_timeout_s=20", "run.record_samples=true")
    result = train(cfg)
    repair = [e for e in result.events if e["event"] == "repair"]
    assert [(e["during"], e["step"]) for e in repair] == [("eval", 2)] and result.failures == 1
    killed = result.worker_pids[2]  # rank 2: replica 1, stage 0
    assert killed not in result.final_pids and set(result.worker_pids) - {killed} <= set(result.final_pids)
    assert result.committed_steps == [0, 1, 2, 3]
    assert list(evaluated(result.metrics).values()) == pytest.approx(reference_eval_losses(cfg), rel=1e-5)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    assert_replicas_identical(result, replicas=2)


def test_rows_held_out_for_no_evaluation_are_named_in_a_warning(make_config):
    with pytest.warns(UserWarning, match=r"data.eval_fraction=0.1 holds out \d+ rows that eval.every=0 never evaluates"):
        prepare(make_config("data.eval_fraction=0.1"))
