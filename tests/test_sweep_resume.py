"""Stopping and resuming a sweep from the CLI, as a user does: ``python -m raytrain sweep`` in a
subprocess run from its own working directory (relative paths are relative to it), with RAY_ADDRESS
unset, so that it starts and stops an embedded Ray of its own.

Each subprocess has a private RAY_TMPDIR; afterwards no process that used it may be left (the CLI's
embedded Ray stops with it), and whatever is left is killed by pid. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from ray.tune import Tuner

from raytrain import tune as rt_tune
from tests.private_cluster import kill_all_using, pids_using

pytestmark = pytest.mark.ray  # every test runs the CLI on a Ray

REPO = Path(__file__).resolve().parents[1]

SWEEP_TIMEOUT_S = 300.0
"""One tiny CLI sweep on a busy 2-core machine: Ray's start (~20 s) and 15 s or so per trial."""

STOP_TIMEOUT_S = 90.0
"""From the signal to the CLI's exit: Tune stops the running trial and saves its state."""

GROUP_STOP_S = 30.0
"""From a SIGTERM to the CLI's whole process group to its exit (Ray's clean-up would block 60 s)."""

ABORT_TIMEOUT_S = 45.0
"""From a second SIGINT to the CLI's exit (the CLI bounds its own teardown to 20 s)."""

RAY_EXIT_S = 20.0
"""How long the embedded Ray's processes may outlive the CLI."""

RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) ")
"""Ray's own log lines as an embedded Ray starts (token authentication, "Started a local Ray instance")."""

BASE = {
    "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16},
    "train": {"steps": 4, "global_batch": 8, "lr": 1.0e-2, "seed": 3},
    "run": {"trace_steps": 0},
    "checkpoint": {"every": 2},
}


class Cli:
    """``python -m raytrain sweep ARGS`` run from ``cwd``; its stdout and stderr read as one stream of
    lines by a thread, so that a test can wait for a line with a bound."""

    def __init__(self, args: list[str], cwd: Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "raytrain", "sweep", *args], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate, timeout_s: float) -> str:
        """The first new line for which ``predicate`` holds; fails the test at EOF or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no such line within {timeout_s:g}s; output:\n{self.text[-4000:]}")
            if line is None:
                pytest.fail(f"the sweep exited ({self.proc.wait()}) before that line; output:\n{self.text[-4000:]}")
            self.lines.append(line)
            if predicate(line):
                return line

    def finish(self, timeout_s: float) -> int:
        """The exit code, once the CLI has exited and its output is read; fails the test after ``timeout_s``."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the sweep was still running after {timeout_s:g}s; output:\n{self.text[-4000:]}")
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def summary(self) -> dict:
        """The JSON line the CLI prints last on stdout."""
        return json.loads([line for line in self.lines if line.startswith("{")][-1])


@pytest.fixture
def env():
    """The CLI's environment: no RAY_ADDRESS, a private RAY_TMPDIR; afterwards nothing that used it is left."""
    ray_tmp = tempfile.mkdtemp(prefix="rtsw-", dir="/tmp")  # short: Ray's socket paths have a length limit
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environ.update(RAY_TMPDIR=ray_tmp, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        yield environ
    finally:
        deadline = time.monotonic() + RAY_EXIT_S
        while pids_using(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        outlived = pids_using(ray_tmp)
        left = kill_all_using(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not left, f"processes survived SIGKILL: {left}"
        assert not outlived, f"the CLI's embedded Ray outlived it by {RAY_EXIT_S:g}s: {outlived}"


def write_sweep(tmp_path: Path, data_cache: str, seeds: list[int], name: str) -> Path:
    """A sweep over ``train.seed`` whose experiment lies under the relative storage path ``sweeps``."""
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**BASE, "data": {"cache_dir": data_cache, "max_bytes": 200000},
                                    "space": {"train.seed": seeds},
                                    "sweep": {"storage_path": "sweeps", "name": name}}))
    return path


def finished_trial_ids(cli: Cli) -> list[str]:
    """The trials the CLI's progress lines said finished (``[raytrain] trial ID finished: ...``)."""
    return [line.split()[2] for line in cli.lines if line.startswith("[raytrain] trial ") and " finished:" in line]


def test_a_sweep_stopped_by_sigterm_to_its_group_exits_143_and_prints_the_command_that_finishes_it(
        env, data_cache, tmp_path):
    """A SIGTERM to the CLI's whole process group (``timeout``, ``kill -TERM -PGID``, Kubernetes): the
    embedded Ray's processes are in a session of their own, so the driver alone gets it (Ray's own SIGTERM
    handler there would abort the process) and Tune stops the sweep so that it can resume. The printed
    command finishes the sweep, run as printed but for its --resume path given relative to the working
    directory: Tune reads a relative path as a URI without a scheme; the CLI hands it an absolute one, the
    very path the printed command names. (SIGINT's exit 130 is proven by the second-SIGINT test below.)"""
    write_sweep(tmp_path, data_cache, [1, 2], "cut")
    cli = Cli(["--config", "sweep.yaml"], tmp_path, env)
    try:
        cli.wait_for(lambda line: line.startswith("[raytrain] trial ") and " finished:" in line, SWEEP_TIMEOUT_S)
        os.killpg(cli.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        rc = cli.finish(STOP_TIMEOUT_S)
    finally:
        cli.kill()
    done = finished_trial_ids(cli)
    assert rc == 143 and len(done) == 1, cli.text[-4000:]
    assert time.monotonic() - sent < GROUP_STOP_S, cli.text[-4000:]
    assert Tuner.can_restore(str(tmp_path / "sweeps" / "cut"))
    summary = cli.summary()
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM" and summary["best"] is None
    assert (summary["trials"], summary["finished"]) == (2, 1)
    said = [line for line in cli.lines if line.startswith("[raytrain] sweep stopped by SIGTERM: 1 of 2 trials finished")]
    assert said and all(trial in said[0] for trial in done), cli.text[-4000:]
    assert any(line.startswith("[raytrain] not finished: ") for line in cli.lines), cli.text[-4000:]
    hint = [line for line in cli.lines if line.startswith("[raytrain] continue it with: ")]
    command = hint[-1].split(": ", 1)[1].strip()
    assert command == summary["resume"]
    assert command.startswith(f"python -m raytrain sweep --config {tmp_path / 'sweep.yaml'} ")
    assert command.endswith(f"--resume {tmp_path / 'sweeps' / 'cut'}")

    argv = shlex.split(command)
    assert argv[0] == "python" and argv[-2:] == ["--resume", str(tmp_path / "sweeps" / "cut")]
    # the printed command, with this interpreter as its python and the path relative to the cwd
    resumed = Cli([*argv[4:-1], "sweeps/cut"], tmp_path, env)
    assert resumed.finish(SWEEP_TIMEOUT_S) == 0, resumed.text[-4000:]
    summary = resumed.summary()
    assert summary["experiment"] == str(tmp_path / "sweeps" / "cut")
    assert (summary["trials"], summary["finished"], summary["interrupted"]) == (2, 2, False)
    assert summary["best"] is not None
    assert "Traceback" not in resumed.text and "empty scheme" not in resumed.text
    # the trials that had finished were not run again
    assert set(finished_trial_ids(resumed)).isdisjoint(done), resumed.text[-4000:]


def test_a_second_sigint_aborts_the_sweep_at_once_without_a_traceback(env, data_cache, tmp_path):
    write_sweep(tmp_path, data_cache, [1, 2, 3], "abort")
    cli = Cli(["--config", "sweep.yaml"], tmp_path, env)
    try:
        cli.wait_for(lambda line: line.startswith("[raytrain] trial ") and " finished:" in line, SWEEP_TIMEOUT_S)
        cli.proc.send_signal(signal.SIGINT)
        cli.wait_for(lambda line: line.startswith("[raytrain] SIGINT: stopping the sweep"), STOP_TIMEOUT_S)
        cli.proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        rc = cli.finish(ABORT_TIMEOUT_S)
    finally:
        cli.kill()
    assert rc == 130, cli.text[-4000:]
    assert time.monotonic() - second < ABORT_TIMEOUT_S
    after = cli.text.split("[raytrain] SIGINT: stopping the sweep", 1)[1]
    assert "Traceback" not in after and "KeyboardInterrupt" not in after, after[-4000:]
    # Either the second signal cut Tune's stop short (one line), or Tune had already stopped and
    # the report was finished: either way the resume command is printed.
    assert "aborted by a second SIGINT" in after or '"interrupted": true' in after, after[-4000:]
    assert "continue it with: python -m raytrain sweep --config " in after, after[-4000:]


@pytest.mark.parametrize("case", ["empty", "missing", "storage_root", "damaged"])
def test_resume_of_a_directory_without_a_sweep_is_one_line_with_exit_2(case, env, data_cache, tmp_path):
    write_sweep(tmp_path, data_cache, [1], "never")
    target = {"storage_root": "root"}.get(case, case)
    if case in ("empty", "damaged"):
        (tmp_path / case).mkdir()
    if case == "damaged":  # a tuner.pkl that does not unpickle: refused before Ray starts, too
        (tmp_path / case / "tuner.pkl").write_bytes(b"not a pickle")
    if case == "storage_root":  # the storage path, not the experiment in it
        (tmp_path / "root" / "sweep-1").mkdir(parents=True)
        (tmp_path / "root" / "sweep-1" / "tuner.pkl").write_bytes(b"")
    cli = Cli(["--config", "sweep.yaml", "--resume", target], tmp_path, env)
    assert cli.finish(120) == 2, cli.text[-4000:]
    lines = [line for line in cli.lines if line.strip() and not RAY_LOG_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("raytrain: "), cli.text[-4000:]
    assert len(cli.lines) == 1, "Ray started before the path was checked"
    assert f"--resume {target}: {tmp_path / target} " in lines[0]
    if case == "storage_root":
        assert "pass one of them, e.g. root/sweep-1" in lines[0]
    elif case == "damaged":
        assert "holds a sweep Tune cannot restore" in lines[0] and "start it again without --resume" in lines[0]
    else:
        assert "pass the 'experiment' directory a sweep printed" in lines[0]


def test_resume_paths_are_made_absolute_and_uris_kept():
    assert rt_tune.experiment_dir("~/sweeps/a") == os.path.join(os.path.expanduser("~"), "sweeps", "a")
    assert rt_tune.experiment_dir("sweeps/a") == os.path.join(os.getcwd(), "sweeps", "a")
    assert rt_tune.experiment_dir("s3://bucket/sweeps/a") == "s3://bucket/sweeps/a"
