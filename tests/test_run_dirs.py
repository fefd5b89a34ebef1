"""Each run gets a run directory of its own, even two runs started in the same second."""

import threading
import time

import pytest

from raytrain.api import prepare
from raytrain.config.layout import Layout
from raytrain.config.mesh import Mesh
from raytrain.driver.prepare import _new_run_name


def test_runs_prepared_in_the_same_second_get_their_own_directories(make_config, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000-")  # the same second for every run
    cfg = make_config("parallel.dp=2")
    dirs = [prepare(cfg).run_dir for _ in range(3)]
    assert len(set(dirs)) == 3, dirs


def test_concurrent_runs_never_share_a_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000-")
    layout = Layout(mesh=Mesh(dp=2))
    names, start = [], threading.Barrier(8)

    def claim():
        start.wait()
        names.append(_new_run_name(str(tmp_path), layout))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(names) == 8 and len(set(names)) == 8, names
    assert all((tmp_path / n).is_dir() for n in names)


def test_a_run_refused_in_prepare_leaves_no_run_directory(make_config, tmp_path):
    cfg = make_config(f"checkpoint.resume={tmp_path / 'no-such-checkpoint'}")
    with pytest.raises(ValueError, match="checkpoint.resume"):
        prepare(cfg)
    runs = tmp_path / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []
