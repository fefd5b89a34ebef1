"""Ray Tune sweeps over layouts: trials report, ASHA stops, infeasible layouts never launch (stopping and
resuming a sweep from the CLI: tests/test_sweep_resume.py)."""

import os
import time

import pytest
import yaml

from raytrain import tune as rt_tune

BASE = {
    "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16},
    "train": {"steps": 6, "global_batch": 8, "lr": 1.0e-2, "seed": 3},
    "run": {"trace_steps": 0},
    "checkpoint": {"every": 3},
}


@pytest.fixture
def base(data_cache):
    return {**BASE, "data": {"cache_dir": data_cache, "max_bytes": 200000}}


def test_sweep_over_three_layouts_reports_every_trial(ray_session, base, tmp_path):
    sweep = rt_tune.SweepConfig(
        base=base, storage_path=str(tmp_path),
        space={"layouts": [{"parallel.dp": 2}, {"parallel.pp": 2, "parallel.microbatches": 2},
                           {"parallel.tp": 2, "resources.placement_strategy": "STRICT_PACK"}]},
    )
    grid = rt_tune.run_sweep(sweep)
    rows = rt_tune.summarize(grid, sweep)
    assert sorted(r.layout for r in rows) == ["dp=1 pp=2 m=2 1f1b", "dp=1 tp=2 pp=1 m=1", "dp=2 pp=1 m=1"]
    assert all(r.status == "finished" and r.steps == 6 and r.samples_per_s > 0 for r in rows)
    # same seed, data and global batch: every layout ends at the same loss
    assert max(r.loss for r in rows) == pytest.approx(min(r.loss for r in rows), rel=1e-5)
    # ranked by throughput, best first
    assert [r.samples_per_s for r in rows] == sorted((r.samples_per_s for r in rows), reverse=True)
    # every step was reported, with checkpoints attached as tune.Checkpoint
    for result in grid:
        assert list(result.metrics_dataframe["step"]) == [1, 2, 3, 4, 5, 6]
        assert result.checkpoint is not None and os.path.exists(os.path.join(result.checkpoint.path, "manifest.json"))
    csv_path, png_path = rt_tune.write_reports(grid, rows, str(tmp_path / "report"))
    assert len(open(csv_path).read().strip().splitlines()) == 4 and os.path.getsize(png_path) > 0


def test_asha_stops_a_bad_trial_early(ray_session, base, tmp_path):
    base = {**base, "train": {**base["train"], "steps": 8}}
    sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), scheduler="asha", grace_period=2,
                                metric="loss", mode="min", space={"train.lr": [1.0e-2, 1.0e-7]})
    rows = {r.params["train.lr"]: r for r in rt_tune.summarize(rt_tune.run_sweep(sweep), sweep)}
    assert rows[1.0e-2].status == "finished" and rows[1.0e-2].steps == 8
    assert rows[1.0e-7].status == "stopped early" and rows[1.0e-7].steps < 8


def test_infeasible_layouts_are_rejected_before_launch(ray_session, base, tmp_path):
    sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path / "never"),
                                space={"layouts": [{"parallel.dp": 1}, {"parallel.dp": 8}, {"parallel.pp": 9}]})
    with pytest.raises(ValueError) as err:
        rt_tune.run_sweep(sweep)
    message = str(err.value)
    assert "dp=8 pp=1 m=1: needs 8 CPU (8 workers), the cluster has 4" in message
    assert "pp=9" in message and "layers" in message
    assert "dp=1" not in message.replace("dp=1 ", "")  # the feasible layout is not blamed
    assert not os.path.exists(tmp_path / "never")  # nothing was launched


def test_a_sweep_with_standby_workers_is_refused_before_any_trial(base, tmp_path):
    sweep = rt_tune.SweepConfig(base={**base, "elastic": {"standby": 1}}, storage_path=str(tmp_path),
                                space={"layouts": [{"parallel.dp": 1}]})
    with pytest.raises(ValueError, match="elastic.standby=1: a trial runs in the resources Tune reserved.*drop "
                                         "elastic.standby from sweeps"):
        rt_tune.check_layouts(sweep, {"CPU": 2.0})


def test_each_infeasible_layout_is_named_by_its_label(base, tmp_path):
    sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), space={"layouts": [
        {"parallel.dp": 1}, {"parallel.dp": 2, "parallel.fsdp": 2}, {"parallel.pp": 9}, {"parallel.dp": 0},
        {"parallel.tp": 3, "resources.placement_strategy": "STRICT_PACK"}]})
    with pytest.raises(ValueError) as err:
        rt_tune.check_layouts(sweep, {"CPU": 2.0})
    message = str(err.value)
    assert "dp=2 fsdp=2 pp=1 m=1: needs 4 CPU (4 workers), the cluster has 2" in message
    assert "dp=1 tp=3 pp=1 m=1: " in message  # the 2 heads do not split 3 ways (and 3 workers do not fit)
    assert "dp=1 pp=9 m=1 1f1b: parallel.pp=9" in message and "dp=0 pp=1 m=1: parallel.dp=0: use >= 1" in message
    assert "dp=1 pp=1" not in message  # the feasible layout is not blamed


def test_sweep_config_errors_name_the_key(tmp_path, base):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**base, "space": {"train.lrr": [0.1]}}))
    with pytest.raises(ValueError, match="train.lrr.*did you mean 'train.lr'"):
        rt_tune.load_sweep_config(str(path))
    path.write_text(yaml.safe_dump({**base, "space": {"train.lr": [0.1]}, "sweep": {"schedular": "asha"}}))
    with pytest.raises(ValueError, match="sweep.schedular"):
        rt_tune.load_sweep_config(str(path))
    path.write_text(yaml.safe_dump({**base, "space": {"train.lr": [0.1]}}))
    with pytest.raises(ValueError, match="unknown sweep setting 'sweep.shceduler'"):  # given with --set
        rt_tune.load_sweep_config(str(path), ["sweep.shceduler=asha"])


def test_a_sweep_reads_the_renamed_wait_keys_under_their_old_names(tmp_path, base):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**base, "resources": {"wait_s": 30}, "space": {"elastic.wait_s": [5, 10]}}))
    with pytest.warns(DeprecationWarning, match="resources.wait_s is deprecated"):
        sweep = rt_tune.load_sweep_config(str(path))
    with pytest.warns(DeprecationWarning) as caught:
        cfg = rt_tune.trial_config(sweep.base, {"elastic.wait_s": 10})
    assert sorted(str(w.message).split()[2] for w in caught) == ["elastic.wait_s", "resources.wait_s"]
    assert cfg.resources.placement_wait_s == 30 and cfg.elastic.capacity_wait_s == 10


def test_pbt_clones_the_better_trial_and_mutates_its_lr(ray_session, base, tmp_path):
    # synch: both trials pause at each checkpoint (every 3 steps) until both reach it, then the
    # worse one restarts from a copy of the better one's checkpoint with a perturbed lr.
    base = {**base, "train": {**base["train"], "steps": 6}, "checkpoint": {"every": 3}}
    sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), name="pbt", scheduler="pbt",
                                quantile_fraction=0.5, synch=True, metric="loss", mode="min", max_concurrent_trials=2,
                                space={"train.lr": [1.0e-2, 1.0e-7]})
    grid = rt_tune.run_sweep(sweep)
    rows = rt_tune.summarize(grid, sweep)
    table = rt_tune.format_table(rows)
    assert all(r.status == "finished" and r.steps == 6 for r in rows), table
    exploits = (tmp_path / "pbt" / "pbt_global.txt").read_text().strip().splitlines()
    assert exploits, "PBT never cloned a trial"
    # The lr=1e-7 trial (barely learning, loss ~5.7 at step 3) became a clone of the lr=1e-2 one
    # with a perturbed lr, and went on learning from the clone's parameters.
    assert all(r.params["train.lr"] != 1.0e-7 for r in rows), table
    assert max(r.loss for r in rows) < 4.5, table


def test_pbt_needs_checkpoints(base, tmp_path):
    base = {**base, "checkpoint": {"every": 0}}
    with pytest.raises(ValueError, match="sweep.scheduler=pbt needs checkpoint.every > 0"):
        rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), scheduler="pbt", space={"train.lr": [0.1]})


def test_a_sweep_ranks_trials_by_their_held_out_loss(ray_session, base, tmp_path):
    base = {**base, "train": {**base["train"], "steps": 4}, "eval": {"every": 2, "batches": 2},
            "data": {**base["data"], "eval_fraction": 0.05}}
    sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), metric="eval_loss", mode="min",
                                space={"train.lr": [1.0e-7, 1.0e-2]})
    grid = rt_tune.run_sweep(sweep)
    rows = rt_tune.summarize(grid, sweep)
    assert [r.params["train.lr"] for r in rows] == [1.0e-2, 1.0e-7], rt_tune.format_table(rows)  # learning lowers it
    assert rows[0].eval_loss < rows[1].eval_loss
    assert grid.get_best_result().config["train.lr"] == 1.0e-2  # Tune itself selects on it
    for result in grid:
        frame = result.metrics_dataframe  # every step reports the latest value, and the step it is of
        assert list(frame["eval_step"]) == [0, 2, 2, 4] and frame["eval_loss"].iloc[0] != frame["eval_loss"].iloc[0]
        assert result.metrics["eval_loss"] == pytest.approx(rows[0].eval_loss if result.config["train.lr"] == 1.0e-2
                                                            else rows[1].eval_loss)


def test_ranking_by_eval_loss_needs_evaluations(base, tmp_path):
    with pytest.raises(ValueError, match="sweep.metric=eval_loss needs eval.every > 0"):
        rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), metric="eval_loss", mode="min",
                            space={"train.lr": [0.1]})


class _Trial:
    def __init__(self, status):
        self.status = status


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_stall_watch_stops_a_sweep_only_after_its_wait_with_no_trial_running():
    from raytrain.tune.stall import StallWatch, StopWhenStalled, take_verdict

    clock = _Clock()
    watch = StallWatch(10.0, clock=clock)
    stopper = StopWhenStalled(watch)
    watch.on_step_end(0, [_Trial("RUNNING"), _Trial("PENDING")])  # one runs: the other waits its turn
    clock.now = 50.0
    watch.on_step_end(1, [_Trial("RUNNING"), _Trial("PENDING")])
    assert not stopper.stop_all()
    watch.on_step_end(2, [_Trial("TERMINATED"), _Trial("PENDING")])  # the wait starts here
    clock.now = 59.0
    watch.on_step_end(3, [_Trial("TERMINATED"), _Trial("PENDING")])
    assert not stopper.stop_all()
    clock.now = 60.0
    watch.on_step_end(4, [_Trial("TERMINATED"), _Trial("PENDING")])
    assert stopper.stop_all() and "no room for a waiting trial's workers" in watch.stalled
    assert "1 pending, 1 terminated" in take_verdict() and take_verdict() is None
    # synchronous PBT with an errored trial: the paused one would wait for it forever
    watch = StallWatch(10.0, clock=clock)
    watch.on_step_end(5, [_Trial("ERROR"), _Trial("PAUSED")])
    clock.now = 70.0
    watch.on_step_end(6, [_Trial("ERROR"), _Trial("PAUSED")])
    assert "sweep.synch" in watch.stalled and "error.txt" in take_verdict()
    # everything done, or nothing waiting: never a stall
    watch = StallWatch(10.0, clock=clock)
    for clock.now in (100.0, 200.0):
        watch.on_step_end(7, [_Trial("TERMINATED"), _Trial("ERROR")])
    assert watch.stalled is None


def test_a_sweep_whose_trials_cannot_get_resources_stops_after_its_bound(ray_session, base, tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    from raytrain.driver.placement import ResourcesUnavailable
    from raytrain.tune.stall import SweepStalled
    from tests.helpers import TEST_RAY_CPUS

    hog = placement_group([{"CPU": TEST_RAY_CPUS}])  # another job holds every CPU of the cluster
    assert hog.wait(timeout_seconds=30)
    try:
        sweep = rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), name="starved", resources_wait_s=3,
                                    space={"train.lr": [1.0e-2]})
        started = time.monotonic()
        with pytest.raises(SweepStalled, match=r"for 3 s \(sweep.resources_wait_s\) no trial could run "
                                                       r"\(1 pending\); the cluster has no room"):
            rt_tune.run_sweep(sweep)
        assert time.monotonic() - started < 60
        assert issubclass(SweepStalled, ResourcesUnavailable)  # the CLI's exit 3
    finally:
        remove_placement_group(hog)
    assert rt_tune.trial_statuses(str(tmp_path / "starved"))  # Tune saved its state: --resume continues it


def test_a_sweep_bound_must_be_positive(base, tmp_path):
    with pytest.raises(ValueError, match="sweep.resources_wait_s=0: use a number of seconds > 0"):
        rt_tune.SweepConfig(base=base, storage_path=str(tmp_path), resources_wait_s=0, space={"train.lr": [0.1]})
