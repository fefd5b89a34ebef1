"""A checkpoint directory has an owner: a run prunes only its own lineage's checkpoints."""

import dataclasses
import os
from pathlib import Path

import torch

from raytrain import checkpoint
from raytrain.api import prepare
from raytrain.config.mesh import Mesh
from raytrain.control.saving import save_checkpoint
from raytrain.driver import run as driver_run
from raytrain.reports import ShardReport


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
