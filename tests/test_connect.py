"""How the CLI finds Ray: an embedded Ray when RAY_ADDRESS is unset (whatever an old cluster left in
Ray's temp dir), and a clear, bounded failure when RAY_ADDRESS names no reachable cluster.

Each test runs ``python -m raytrain`` as a user would, in a subprocess with its own RAY_TMPDIR
(Ray's ``ray_current_cluster`` file lies there) and its own network namespace: ``RAY_ADDRESS=auto``
joins any one Ray that runs on the machine (another user's too), which a private network keeps out
of reach. Whatever a test started is killed by pid afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raytrain.driver import reaper
from tests.private_cluster import kill_all_using, pids_using, unshare_works

REPO = Path(__file__).resolve().parents[1]

UNREACHABLE_EXIT_S = 30.0
"""The bound on a run given an unreachable RAY_ADDRESS: it fails within this, Python's start-up included."""

EMBEDDED_RUN_TIMEOUT_S = 150.0
"""A 2-step dp=1 run on an embedded Ray: about 15 s on a busy 2-core machine."""

SHORT_CONNECT_TIMEOUT_S = "3"
"""raytrain's bound on ray.init for a port that accepts but never answers as Ray (default 60 s)."""

UNANSWERED_ADDRESS = "127.0.0.1:6553"
"""A RAY_ADDRESS no Ray cluster answers at: in a test's private network nothing listens there unless the test
says so."""

NOT_RAY_LISTENER = (
    f"{sys.executable} -c 'import socket, time; s = socket.socket(); s.bind((\"0.0.0.0\", 6553)); "
    "s.listen(16); time.sleep(600)' >/dev/null 2>&1 & "
    "for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/6553) 2>/dev/null && break; sleep 0.1; done; ")
"""Shell commands that leave a port accepting connections (the kernel queues them) that never speaks Ray."""

needs_netns = pytest.mark.skipif(not unshare_works(), reason="needs `unshare -n` (root or user namespaces)")


@pytest.fixture
def ray_tmpdir():
    """A private RAY_TMPDIR; afterwards no process that used it is left."""
    path = tempfile.mkdtemp(prefix="rtconn-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        yield path
    finally:
        left = kill_all_using(path)
        shutil.rmtree(path, ignore_errors=True)
        assert not left, f"processes survived SIGKILL: {left}"


def stale_current_cluster(ray_tmpdir: str) -> None:
    """Write what a killed `ray start` leaves behind: ray_current_cluster naming an address nobody listens on."""
    os.makedirs(os.path.join(ray_tmpdir, "ray"), exist_ok=True)
    Path(ray_tmpdir, "ray", "ray_current_cluster").write_text(UNANSWERED_ADDRESS)


def run_cli(env: dict, overrides: list[str], timeout_s: float, command: str = "train",
            config: str = "experiments/configs/tiny.yaml", first: str = "") -> tuple[int, str, str, float]:
    """``python -m raytrain <command> --config <config> --set ...`` in a new network namespace (after
    the shell commands ``first``); (exit code, stdout, stderr, seconds). Fails the test, after killing
    the run's process group, if it takes over ``timeout_s``."""
    cli = [sys.executable, "-m", "raytrain", command, "--config", config]
    for o in overrides:
        cli += ["--set", o]
    cmd = ["unshare", "-n", "bash", "-c", f'ip link set lo up || exit 99; {first}exec "$@"', "bash", *cli]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cli)}` was still running after {timeout_s:g}s; stderr:\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - start


def cli_env(ray_tmpdir: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, **extra)
    return env


def small_run(data_cache: str, run_dir) -> list[str]:
    return ["train.steps=2", "parallel.dp=1", "data.max_bytes=200000", f"data.cache_dir={data_cache}",
            f"run.dir={run_dir}", "run.trace_steps=0"]


@needs_netns
def test_unset_ray_address_starts_an_embedded_ray_despite_a_stale_current_cluster(ray_tmpdir, data_cache, tmp_path):
    stale_current_cluster(ray_tmpdir)
    rc, out, err, _ = run_cli(cli_env(ray_tmpdir), small_run(data_cache, tmp_path / "runs"),
                              EMBEDDED_RUN_TIMEOUT_S)
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["layout"] == "dp=1 pp=1 m=1"
    assert 0 < summary["goodput"] < 1 and summary["badput_s"]["start_up"] > 0
    assert "[raytrain] goodput " in err
    # The embedded Ray stops with the CLI: nothing that used this RAY_TMPDIR outlives it.
    deadline = time.monotonic() + 10
    while pids_using(ray_tmpdir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not pids_using(ray_tmpdir), "the embedded Ray's processes outlived the CLI"


@needs_netns
@pytest.mark.parametrize("case", ["nothing_listens", "not_ray", "auto_finds_a_stale_cluster"])
def test_an_unreachable_ray_address_fails_fast_with_exit_3_naming_the_fix(case, ray_tmpdir, data_cache, tmp_path):
    """Ray itself retries such an address for minutes, printing only C++ warnings."""
    address, extra, first = UNANSWERED_ADDRESS, {}, ""
    if case == "not_ray":
        extra["RAYTRAIN_CONNECT_TIMEOUT_S"] = SHORT_CONNECT_TIMEOUT_S
        first = NOT_RAY_LISTENER
    elif case == "auto_finds_a_stale_cluster":  # auto follows ray_current_cluster, here left by a killed cluster
        stale_current_cluster(ray_tmpdir)
        address = "auto"
    rc, _, err, seconds = run_cli(cli_env(ray_tmpdir, RAY_ADDRESS=address, **extra),
                                  small_run(data_cache, tmp_path / "runs"), UNREACHABLE_EXIT_S + 30, first=first)
    assert rc == 3, err[-3000:]
    assert seconds < UNREACHABLE_EXIT_S, f"took {seconds:.1f}s"
    said = [line for line in err.splitlines() if line.startswith("raytrain: ")]
    assert said and f"RAY_ADDRESS={address}" in said[-1] and "unset RAY_ADDRESS" in said[-1], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@needs_netns
def test_a_sweep_with_an_unreachable_ray_address_fails_fast_with_exit_3(ray_tmpdir, tmp_path):
    rc, _, err, seconds = run_cli(cli_env(ray_tmpdir, RAY_ADDRESS=UNANSWERED_ADDRESS), [f"sweep.storage_path={tmp_path}"],
                                  UNREACHABLE_EXIT_S + 30, command="sweep",
                                  config="experiments/configs/sweep_tiny.yaml")
    assert rc == 3 and seconds < UNREACHABLE_EXIT_S, (seconds, err[-3000:])
    assert f"raytrain: RAY_ADDRESS={UNANSWERED_ADDRESS}: no Ray cluster answers" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_ray_job_puts_a_relative_run_dir_under_home_raytrain(monkeypatch, tmp_path):
    """A job's working directory is Ray's temporary copy; absolute and ~ paths are the user's choice."""
    from raytrain.driver.connect import JOB_DRIVER_ENV, run_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(JOB_DRIVER_ENV, raising=False)
    assert run_root("runs") == os.path.abspath("runs")
    monkeypatch.setenv(JOB_DRIVER_ENV, "{}")
    assert run_root("runs") == str(tmp_path / "raytrain" / "runs")
    assert run_root("/data/runs") == "/data/runs" and run_root("~/elsewhere") == str(tmp_path / "elsewhere")


@needs_netns
def test_a_sigkilled_driver_leaves_no_process_of_its_embedded_ray(ray_tmpdir, data_cache, tmp_path):
    """Ray's agents alone outlived a SIGKILLed driver by over a minute; raytrain.driver.reaper ends them."""
    cli = [sys.executable, "-m", "raytrain", "train", "--config", "experiments/configs/tiny.yaml"]
    for o in small_run(data_cache, tmp_path / "runs") + ["train.steps=100000"]:
        cli += ["--set", o]
    cmd = ["unshare", "-n", "bash", "-c", 'ip link set lo up || exit 99; exec "$@"', "bash", *cli]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(ray_tmpdir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + EMBEDDED_RUN_TIMEOUT_S
        while not list((tmp_path / "runs").glob("*/checkpoints")) or not _trained(tmp_path / "runs"):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.3)
        ray_processes = reaper.descendants(proc.pid)  # Ray's servers, its agents, the workers
        assert len(ray_processes) > 3, ray_processes
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _still_running(ray_processes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _still_running(ray_processes), "processes of the embedded Ray outlived the killed driver by 30 s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _still_running(processes: dict[int, str]) -> list[str]:
    left = []
    for pid, started in processes.items():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == started:
                left.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:60])
    return left


def _trained(runs) -> bool:
    rows = [line for f in runs.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    return sum('"loss"' in line for line in rows) >= 3


def test_a_clean_up_call_is_given_up_once_the_embedded_rays_gcs_stops_answering(monkeypatch):
    # A signal to the whole process group ends the embedded Ray's GCS at any moment; a Ray call made just
    # before then blocks a minute (then Ray exits the process with code 1): the driver gives it up instead
    from raytrain.driver import connect

    answers = iter([True, True, False])  # the GCS answers the first probes, then no more
    monkeypatch.setattr(connect, "embedded", lambda: True)
    monkeypatch.setattr(connect, "cluster_reachable", lambda: next(answers))
    blocked = threading.Event()
    started = time.monotonic()
    assert connect.while_reachable(blocked.wait, 60.0) is False  # a call that would block for a minute
    assert time.monotonic() - started < 5
    blocked.set()  # let the given-up call's thread end

    monkeypatch.setattr(connect, "cluster_reachable", lambda: True)  # an answering GCS: the call's outcome
    assert connect.while_reachable(lambda: None) is True
    with pytest.raises(KeyError):
        connect.while_reachable({}.__getitem__, "missing")

    monkeypatch.setattr(connect, "cluster_reachable", lambda: False)  # already gone: not even started
    calls = []
    assert connect.while_reachable(calls.append, 1) is False and calls == []
