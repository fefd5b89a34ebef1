"""A checkpoint directory has an owner: a run prunes only its own lineage's checkpoints, a fresh run is
refused beside another run's, ``latest`` resumes only a checkpoint of the same experiment, and a resume
into another model is refused by name, all before any actor starts."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.api import prepare
from raytrain.checkpoint.experiment import experiment_difference, model_difference
from raytrain.config import load_config
from raytrain.config.mesh import Mesh
from raytrain.control.saving import save_checkpoint
from raytrain.driver import run as driver_run
from raytrain.reports import ShardReport

REPO = Path(__file__).resolve().parents[1]


def _publish(base: str, step: int, lineage=None, config=None) -> str:
    """A checkpoint of ``step`` under ``base`` as a run of ``lineage`` (and ``config``, a Config) writes one."""
    d = checkpoint.new_step_dir(base, step, lineage)
    entry = checkpoint.save_shard(d, 0, {"model": {"0.w": torch.full((4,), float(step))}, "optim": {}})
    manifest = {"step": step, "shards": [entry]}
    if lineage is not None:
        manifest["lineage"] = lineage
    if config is not None:
        manifest["config"] = config.to_dict()
    checkpoint.publish(d, manifest)
    return d


def _steps(base: str, lineage) -> list[int]:
    return [p.step for p in checkpoint.list_published(base) if p.lineage == lineage]


def _files(base: str) -> dict[str, str]:
    """Every file under ``base`` by relative path, with its sha256."""
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(base).rglob("*") if p.is_file()}


# --- pruning: only this run's lineage ---------------------------------------------------------------


def test_pruning_deletes_only_its_own_lineages_checkpoints_and_unfinished_saves(tmp_path):
    base = str(tmp_path)
    for step in (1, 2, 3):
        _publish(base, step, "theirs")
    _publish(base, 4)  # written before lineages: nobody's
    theirs_unfinished = checkpoint.new_step_dir(base, 9, "theirs")  # their save in flight (no manifest)
    for step in (5, 6, 7):
        _publish(base, step, "mine")
    mine_unfinished = checkpoint.new_step_dir(base, 8, "mine")
    checkpoint.prune(base, keep=2, lineage="mine")
    assert _steps(base, "mine") == [6, 7]
    assert _steps(base, "theirs") == [1, 2, 3] and _steps(base, None) == [4]
    assert os.path.isdir(theirs_unfinished) and not os.path.exists(mine_unfinished)


def test_a_runs_saves_record_its_lineage_and_prune_none_of_another_runs(make_config, tmp_path):
    base = str(tmp_path / "ckpts")
    for step in (1, 2, 3):
        _publish(base, step, "theirs")
    cfg = make_config(f"checkpoint.dir={base}", "checkpoint.keep=2")
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, lineage="mine"))

    class OneSaver:  # the worker group's save, in this process
        def save(self, members, ckpt_dir):
            return [ShardReport(checkpoint.save_shard(ckpt_dir, 0, {"model": {"0.w": torch.ones(4)}, "optim": {}}),
                                finite=True)]

    saved = [save_checkpoint(OneSaver(), [None], step, cfg, Mesh(), [[[0]]]) for step in (4, 5, 6)]
    assert _steps(base, "mine") == [5, 6] and _steps(base, "theirs") == [1, 2, 3]
    for d in saved[1:]:
        assert checkpoint.read_manifest(d)["lineage"] == "mine"
        assert (Path(d) / checkpoint.LINEAGE_FILE).read_text() == "mine"


# --- which lineage a run continues -------------------------------------------------------------------


def test_a_resume_of_a_lineages_newest_checkpoint_continues_it_and_of_an_older_one_forks(tmp_path):
    base = str(tmp_path)
    older, newest = _publish(base, 2, "chain"), _publish(base, 4, "chain")
    _publish(base, 6, "another")  # published last in the directory, of another lineage
    legacy = _publish(str(tmp_path / "old"), 2)
    assert checkpoint.continued_lineage(newest) == "chain"
    assert checkpoint.continued_lineage(older) is None
    assert checkpoint.continued_lineage(legacy) is None


def test_prepare_gives_a_fresh_run_a_lineage_of_its_own_and_a_resume_its_chains(make_config, tmp_path):
    base = str(tmp_path / "ckpts")
    fresh = [prepare(make_config()).cfg.checkpoint.lineage for _ in range(2)]
    assert all(fresh) and fresh[0] != fresh[1]
    _publish(base, 2, "chain", make_config())
    newest = _publish(base, 4, "chain", make_config())
    resumed = prepare(make_config(f"checkpoint.dir={base}", "checkpoint.resume=latest"))
    assert resumed.resume == newest and resumed.cfg.checkpoint.lineage == "chain"
    forked = prepare(make_config(f"checkpoint.dir={base}", f"checkpoint.resume={checkpoint.step_dir(base, 2)}"))
    assert forked.cfg.checkpoint.lineage not in (None, "chain")


def test_the_last_committed_checkpoint_of_a_forked_run_is_its_own_not_the_newer_one_beside_it(make_config, tmp_path):
    base = str(tmp_path / "ckpts")
    start = _publish(base, 2, "chain")
    _publish(base, 4, "chain")
    cfg = make_config(f"checkpoint.dir={base}")
    fork = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, lineage="fork"))
    assert driver_run._last_committed(fork, start) == start  # not step 4: a restart or an abort names this
    own = _publish(base, 3, "fork")
    assert driver_run._last_committed(fork, start) == own


# --- a fresh run beside another run's checkpoints ----------------------------------------------------


def test_a_fresh_run_into_a_checkpoint_dir_holding_another_runs_checkpoints_is_refused(make_config, tmp_path):
    base = str(tmp_path / "ckpts")
    newest = _publish(base, 3, "theirs", make_config())
    before = _files(base)
    with pytest.raises(ValueError, match=r"checkpoint.dir='.*ckpts' holds 1 checkpoint\(s\) of another run") as e:
        prepare(make_config(f"checkpoint.dir={base}"))
    assert newest in str(e.value) and "checkpoint.keep=3" in str(e.value)
    assert "checkpoint.resume=latest" in str(e.value) and "a new checkpoint.dir" in str(e.value)
    assert _files(base) == before
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []  # no run dir left
    elsewhere = _publish(str(tmp_path / "other"), 2)
    with pytest.raises(ValueError, match="holds 1 checkpoint"):  # resuming a checkpoint not among them
        prepare(make_config(f"checkpoint.dir={base}", f"checkpoint.resume={elsewhere}"))
    assert prepare(make_config(f"checkpoint.dir={base}", "checkpoint.resume=latest")).resume == newest
    assert prepare(make_config(f"checkpoint.dir={base}", f"checkpoint.resume={newest}")).resume == newest


def test_a_fresh_run_reusing_a_run_name_is_refused_naming_it(make_config, tmp_path):
    _publish(str(tmp_path / "runs" / "exp" / "checkpoints"), 3, "theirs")
    with pytest.raises(ValueError, match=r"\(run.name='exp''s default\) holds .*a new checkpoint.dir \(or run.name\)"):
        prepare(make_config("run.name=exp"))


# --- latest: the same experiment only ----------------------------------------------------------------


def _run_checkpoint(tmp_path, run: str, step: int, config, published_at: float) -> str:
    """A checkpoint of ``config``'s experiment in run directory ``run`` under the test's run.dir."""
    d = _publish(str(tmp_path / "runs" / run / "checkpoints"), step, run, config)
    os.utime(os.path.join(d, checkpoint.MANIFEST), (published_at, published_at))
    return d


def test_latest_under_a_shared_run_dir_resumes_the_newest_checkpoint_of_this_experiment(make_config, tmp_path):
    ours = _run_checkpoint(tmp_path, "ours", 2, make_config(), 1_000_000)
    _run_checkpoint(tmp_path, "wider", 3, make_config("model.d_model=64"), 2_000_000)
    _run_checkpoint(tmp_path, "other-data", 4, make_config("data.max_bytes=150000"), 3_000_000)
    assert prepare(make_config("checkpoint.resume=latest")).resume == ours
    os.utime(os.path.join(ours, checkpoint.MANIFEST), (4_000_000, 4_000_000))
    assert prepare(make_config("checkpoint.resume=latest", "model.d_model=64")).resume.endswith(
        "wider/checkpoints/step_00000003")


def test_latest_says_why_no_checkpoint_under_run_dir_is_of_this_experiment(make_config, tmp_path):
    _run_checkpoint(tmp_path, "wider", 3, make_config("model.d_model=64"), 1_000_000)
    _run_checkpoint(tmp_path, "other-data", 4, make_config("data.max_bytes=150000"), 2_000_000)
    with pytest.raises(ValueError) as e:
        prepare(make_config("checkpoint.resume=latest"))
    message = str(e.value)
    assert message.startswith("checkpoint.resume='latest': no checkpoint under run.dir=") and "\n" not in message
    assert "other-data/checkpoints/step_00000004 has data.max_bytes=150000 (this run: 200000)" in message
    assert "wider/checkpoints/step_00000003 has model.d_model=64 (this run: 32)" in message
    assert "checkpoint.resume=<its path>" in message
    assert message.index("other-data") < message.index("wider")  # the newest first


def test_latest_of_a_checkpoint_dir_whose_newest_is_another_experiment_is_refused_naming_the_key(make_config, tmp_path):
    base = str(tmp_path / "ckpts")
    _publish(base, 3, "theirs", make_config())
    with pytest.raises(ValueError, match=r"checkpoint.dir='.*ckpts'.*data.max_bytes=200000 \(this run: 150000\)"):
        prepare(make_config(f"checkpoint.dir={base}", "checkpoint.resume=latest", "data.max_bytes=150000"))


# --- a resume into another model ----------------------------------------------------------------------


@pytest.mark.parametrize("changed, named", [("model.d_model=64", "model.d_model=32 (this run: 64)"),
                                            ("model.n_layer=3", "model.n_layer=2 (this run: 3)"),
                                            ("model.seq_len=32", "model.seq_len=16 (this run: 32)")])
def test_a_resume_into_another_model_shape_is_refused_naming_the_key(make_config, tmp_path, changed, named):
    d = _publish(str(tmp_path / "ckpts"), 3, "theirs", make_config())
    with pytest.raises(ValueError) as e:
        prepare(make_config(f"checkpoint.resume={d}", changed))
    assert f"checkpoint.resume='{d}' ({d}) holds another model: {named}" in str(e.value)
    assert f"set {named.split(' ')[0]}, or drop checkpoint.resume" in str(e.value)
    # training settings and the layout may change on a resume
    assert prepare(make_config(f"checkpoint.resume={d}", "train.lr=1e-3", "parallel.dp=2")).resume == d


def test_a_resume_with_another_global_batch_is_refused_since_it_would_skip_or_repeat_samples(make_config, tmp_path):
    d = _publish(str(tmp_path / "ckpts"), 3, "theirs", make_config())  # train.global_batch=8
    with pytest.raises(ValueError, match=r"was trained with train.global_batch=8, this run asks for 16: .* would "
                                         r"skip or repeat samples of the epoch; set train.global_batch=8"):
        prepare(make_config(f"checkpoint.resume={d}", "train.global_batch=16"))


def test_which_model_and_data_a_recorded_config_names():
    cfg = load_config(None, ["model.d_model=32", "model.n_head=2"])
    same = cfg.to_dict()
    assert model_difference(cfg, same) is None and experiment_difference(cfg, same) is None
    factory = load_config(None, ["model.d_model=32", "model.n_head=2", "model.factory=tests.factories:planned_mlp"]).to_dict()
    assert str(model_difference(cfg, factory)) == "model.factory='tests.factories:planned_mlp' (this run: None)"
    assert model_difference(cfg, None) is None and model_difference(cfg, {"step": 3}) is None  # nothing to compare
    assert experiment_difference(cfg, None) == "no config recorded (written by hand, not by a raytrain run)"
    moved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf="/models/here"))
    there = {**same, "model": {**same["model"], "hf": "/models/there"}}
    assert model_difference(moved, there) is None  # a Hugging Face directory may move
    assert str(model_difference(moved, same)) == "model.hf=None (this run: '/models/here')"
    other_rows = {**same, "data": {**same["data"], "eval_fraction": 0.1}}
    assert experiment_difference(cfg, other_rows) == "data.eval_fraction=0.1 (this run: 0.0)"


# --- end to end ---------------------------------------------------------------------------------------


def test_a_fresh_run_beside_an_older_runs_checkpoints_is_refused_and_they_are_untouched(ray_session, make_config,
                                                                                         tmp_path, data_cache):
    base = str(tmp_path / "ckpts")
    older = train(make_config("train.steps=4", "checkpoint.every=2", f"checkpoint.dir={base}"))
    lineage = checkpoint.read_manifest(older.checkpoint)["lineage"]
    assert lineage and _steps(base, lineage) == [2, 4]
    before = _files(base)
    sets = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "train.steps=30",
            "train.global_batch=8", f"data.cache_dir={data_cache}", "data.max_bytes=200000",
            f"run.dir={tmp_path / 'fresh'}", f"checkpoint.dir={base}", "checkpoint.keep=1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raytrain", "train", *[a for s in sets for a in ("--set", s)]],
                          cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint.dir={base!r} holds 2 checkpoint(s) of another run" in lines[0]
    assert "checkpoint.resume=latest" in lines[0] and "a new checkpoint.dir" in lines[0]
    assert proc.stdout == ""
    assert _files(base) == before
    assert json.loads((Path(older.checkpoint) / checkpoint.MANIFEST).read_text())["step"] == 4
