"""SIGTERM / Ctrl-C stop a run at a step boundary after a checkpoint, the same signal twice within a second
is one request, a later one aborts naming the last checkpoint, the summary is the last line of stdout, and a
killed driver leaves nothing behind."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raytrain import checkpoint
from raytrain.driver.signals import (SAME_SIGNAL_WINDOW_S, STILL_STOPPING_S, Aborted, StillStopping, StopOnSignal,
                                     Verdict, judge)
from tests.helpers import pid_alive

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120
GROUP_STOP_S = 10
"""From a SIGTERM to the whole process group to the exit: 2 s here; ray.shutdown on the dead embedded Ray
would add 10 s, or block 60 s and exit 1."""
LATER_S = 1.5
"""A second signal this long after the first: a person who means to abort."""
NO_RAY = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
"""The environment of a CLI that starts an embedded Ray."""


def _start_cli(ray_cluster, tmp_path, data_cache, *extra, env=None, wrapper=()):
    """``python -m raytrain train`` of a run that never ends by itself, in a session of its own, on
    ``ray_cluster`` (or with ``env``, the environment as given: RAY_ADDRESS unset, an embedded Ray), run
    by the command ``wrapper`` (``timeout ...``) when given."""
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.address) if env is None else env
    cmd = [*wrapper, sys.executable, "-m", "raytrain", "train", "--config", "experiments/configs/tiny.yaml",
           "--set", "train.steps=100000", "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.trace_steps=0",
           "--set", f"data.cache_dir={data_cache}", "--set", "data.max_bytes=200000", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def _wait_for_training(tmp_path, proc, steps: int = 3) -> list[int]:
    """Block until the run has committed ``steps`` steps; returns its workers' pids."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        for metrics in (tmp_path / "runs").glob("*/metrics.jsonl"):
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            started = [r for r in rows if r.get("event") == "started"]
            if started and sum("loss" in r and "event" not in r for r in rows) >= steps:
                return started[0]["pids"]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the run did not train {steps} steps: {proc.communicate()[1][-3000:]}")


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "a worker outlived the stopped run"


def _summary(out: str) -> dict:
    """The JSON summary, the last line of the CLI's stdout."""
    return json.loads(out.strip().splitlines()[-1])


# --- the verdict on each signal, without Ray ------------------------------------------------------


def test_the_same_signal_within_the_window_is_one_request_and_any_other_aborts():
    term, int_ = signal.SIGTERM, signal.SIGINT
    assert judge(None, term, 100.0) is Verdict.STOP
    assert judge((term, 100.0), term, 100.000004) is Verdict.SAME  # timeout: the child, then its group
    assert judge((term, 100.0), term, 100.0 + SAME_SIGNAL_WINDOW_S - 0.01) is Verdict.SAME
    assert judge((term, 100.0), term, 100.0 + SAME_SIGNAL_WINDOW_S) is Verdict.ABORT
    assert judge((term, 100.0), term, 100.0 + LATER_S) is Verdict.ABORT
    assert judge((term, 100.0), int_, 100.000004) is Verdict.ABORT  # another signal is no repeat


def test_two_signals_microseconds_apart_are_one_stop_and_one_a_moment_later_aborts():
    stream = io.StringIO()
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal(stream) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while "the same stop request" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader thread notes the second delivery
        assert stop.reason == "SIGTERM" and stop.aborted is None, stream.getvalue()
        assert stream.getvalue().count("SIGTERM: stopping at the next step boundary") == 1
        assert re.search(r"SIGTERM again 0\.\d+ s later: the same stop request", stream.getvalue())  # < 1 s, however busy
        time.sleep(LATER_S)
        with pytest.raises(Aborted) as aborted:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, at once
        assert aborted.value.reason == "SIGTERM" and stop.aborted == "SIGTERM"
        reader = stop._reader
    assert signal.getsignal(signal.SIGTERM) is before
    assert not reader.is_alive(), "the reader thread outlived its StopOnSignal"


def test_a_stop_that_waits_long_for_its_step_boundary_says_what_it_waits_for():
    # a frozen worker holds the step the stop waits for: every STILL_STOPPING_S without a step ending, one line
    now, stream = [100.0], io.StringIO()
    still = StillStopping("SIGTERM", 60, stream, clock=lambda: now[0])
    still.check(7)
    now[0] += STILL_STOPPING_S - 1
    still.check(7)
    assert stream.getvalue() == ""
    now[0] += 1
    still.check(7)
    assert stream.getvalue() == ("[raytrain] SIGTERM: still stopping after 15 s: step 8 has not ended; a worker silent "
                                 "for elastic.detect_timeout_s=60 s is declared hung and the run then stops at the "
                                 "step boundary; send SIGTERM again to abort now\n")
    now[0] += 5
    still.check(8)  # a step ended: the wait starts again, and nothing is said
    now[0] += STILL_STOPPING_S - 1
    still.check(8)
    assert stream.getvalue().count("still stopping") == 1


_REPORTING = textwrap.dedent("""
    import os, signal, sys
    from raytrain.driver.signals import Aborted, ProcessSignals
    signals = ProcessSignals().__enter__()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except Aborted as e:
        print("aborted by", e.reason, flush=True)
    signals.ended()
    os.kill(os.getpid(), signal.SIGTERM)
    print("the summary line", flush=True)
    signals.reported(143)
    print("never printed", flush=True)
""")


def test_the_cli_process_aborts_before_its_run_ends_and_exits_once_its_summary_is_out():
    proc = subprocess.run([sys.executable, "-c", _REPORTING], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.splitlines() == ["aborted by SIGTERM", "the summary line"], proc.stdout


_NOISY_COMMAND = textwrap.dedent("""
    import os, subprocess, sys
    import raytrain.__main__ as entry

    def noisy_main(out, signals):  # prints as Ray Tune's tables, a C library and a child process do
        print("+--------+ a Tune trial table on sys.stdout +--------+", flush=True)
        os.write(1, b"a C library writing to fd 1\\n")
        subprocess.run(["echo", "a child process inheriting fd 1"], check=True)
        print('{"result": "line"}', file=out, flush=True)
        return 0

    entry.main = noisy_main
    sys.argv = ["raytrain", "train"]
    entry.run()
""")


def test_the_cli_process_keeps_its_stdout_for_the_result_line_whatever_else_prints():
    """The summary is stdout's one line however the run prints (parallel.auto's Tune tables, Ray's warnings,
    a model's prints, processes it starts): the rest goes to stderr (raytrain.__main__)."""
    proc = subprocess.run([sys.executable, "-c", _NOISY_COMMAND], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == '{"result": "line"}\n'
    for line in ["a Tune trial table", "a C library writing to fd 1", "a child process inheriting fd 1"]:
        assert line in proc.stderr


# --- the CLI on Ray ---------------------------------------------------------------------------------


def test_a_stop_signal_stops_at_a_step_boundary_with_a_checkpoint(ray_cluster, tmp_path, data_cache):
    """Ctrl-C (SIGINT) to the CLI on a running cluster; SIGTERM takes the same handler (``judge``), proven end
    to end on an embedded Ray by the process-group test below."""
    sig = signal.SIGINT
    proc = _start_cli(ray_cluster, tmp_path, data_cache)
    try:
        workers = _wait_for_training(tmp_path, proc)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 30
    assert proc.returncode == 128 + sig, err[-3000:]
    summary = _summary(out)
    assert summary["stopped"] == sig.name and 3 <= summary["steps"] < 100000
    assert checkpoint.read_manifest(summary["checkpoint"])["step"] == summary["steps"]
    checkpoint.load_shards(summary["checkpoint"])
    assert f"{sig.name}: stopping at the next step boundary" in err and "Traceback" not in err
    _assert_gone(workers)


def test_a_stop_signal_while_a_worker_is_frozen_says_what_it_waits_for_then_stops_once_it_is_found(
        ray_cluster, tmp_path, data_cache):
    """SIGTERM while a worker is frozen (SIGSTOP, the ``pause`` fault in step 10) holds the stop short of
    its step boundary: the CLI says so every STILL_STOPPING_S, and once the frozen worker is found hung
    (elastic.detect_timeout_s) the run stops at a boundary with a checkpoint, the summary and exit 143."""
    detect_s = STILL_STOPPING_S + 3
    proc = _start_cli(ray_cluster, tmp_path, data_cache, "--set", "elastic.faults=['0:0@9:pause']",
                      "--set", f"elastic.detect_timeout_s={detect_s}")
    try:
        workers = _wait_for_training(tmp_path, proc, steps=9)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=detect_s + 60)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert proc.returncode == 143, err[-3000:]
    assert STILL_STOPPING_S <= took < detect_s + 30, (took, err[-3000:])
    assert "SIGTERM: still stopping after 15 s: step 10 has not ended" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    summary = _summary(out)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] >= 9
    assert checkpoint.read_manifest(summary["checkpoint"])["step"] == summary["steps"]
    checkpoint.load_shards(summary["checkpoint"])
    _assert_gone(workers)  # the frozen one too: killed when found hung


def test_a_killed_driver_takes_its_workers_along(ray_cluster, tmp_path, data_cache):
    proc = _start_cli(ray_cluster, tmp_path, data_cache)
    try:
        workers = _wait_for_training(tmp_path, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in workers), "a worker outlived its killed driver by 30 s"


def _expire(proc) -> None:
    """Make the ``timeout`` running ``proc`` act as when its duration runs out: coreutils timeout takes a
    SIGALRM as its own alarm (it then signals the child, then its process group)."""
    os.kill(proc.pid, signal.SIGALRM)


@pytest.mark.ray
def test_sigterm_to_the_process_group_of_an_embedded_ray_run_stops_it_at_a_step_boundary(tmp_path, data_cache):
    """``timeout -s TERM`` signals the driver and then its whole process group (two SIGTERMs, often
    microseconds apart: ``kill -TERM -PGID``, Kubernetes and Slurm send the second alone), with the
    embedded Ray started beside it and no checkpoint.every: the run still stops at a step boundary after a
    checkpoint, and its summary is the one line of stdout. ``timeout --preserve-status`` passes on the
    driver's 143 (without it, timeout exits 124). experiments/stress_signals.py repeats it, and the group
    signal alone, 20 times."""
    wrapper = ("timeout", "--preserve-status", "-s", "TERM", "600")
    proc = _start_cli(None, tmp_path, data_cache, "--set", "checkpoint.every=0", env=NO_RAY, wrapper=wrapper)
    try:
        workers = _wait_for_training(tmp_path, proc)
        sent = time.monotonic()
        _expire(proc)
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, f"{err[-3000:]}\nstdout: {out[-1000:]}\n{_driver_core_log(proc.pid)}"
    assert took < GROUP_STOP_S, f"{took:.1f} s from the signal to the exit\n{err[-3000:]}"
    assert len(out.splitlines()) == 1, out  # Ray's own output went to stderr
    summary = _summary(out)
    assert summary["stopped"] == "SIGTERM" and 3 <= summary["steps"] < 100000
    manifest = checkpoint.read_manifest(summary["checkpoint"])
    assert manifest["step"] == summary["steps"]
    assert [s for s, _ in checkpoint.list_checkpoints(os.path.dirname(summary["checkpoint"]))] == [summary["steps"]]
    assert "SIGTERM: stopping at the next step boundary" in err
    assert "aborted" not in err and "Traceback" not in err, err[-3000:]
    _assert_gone(workers)


def _driver_core_log(pid: int) -> str:
    """The end of Ray's own log of the driver process ``pid`` (its core worker): where a driver that
    Ray's C++ ended (an exit without a Python traceback) says why."""
    logs = sorted(Path("/tmp/ray").glob(f"session_*/logs/python-core-driver-*_{pid}.log"))
    return f"{logs[-1]}:\n{logs[-1].read_text(errors='replace')[-3000:]}" if logs else "no core-driver log"


def test_a_signal_repeated_a_moment_later_aborts_with_a_summary_naming_the_last_checkpoint(
        ray_cluster, tmp_path, data_cache):
    """A worker frozen in step 10 (the ``pause`` fault) holds the stop short of its step boundary, so the
    second signal, 1.5 s after the first, finds the run still stopping: it aborts at once, and stdout's last
    line still says so and names the last checkpoint committed (step 8's). SIGINT here (a person's second
    Ctrl-C); SIGTERM takes the same path (``judge`` above)."""
    sig = signal.SIGINT
    proc = _start_cli(ray_cluster, tmp_path, data_cache, "--set", "checkpoint.every=2",
                      "--set", "elastic.faults=['0:0@9:pause']")
    try:
        workers = _wait_for_training(tmp_path, proc, steps=9)
        proc.send_signal(sig)
        time.sleep(LATER_S)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 40
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"raytrain: aborted by {sig.name}" in err.strip().splitlines()[-1]
    summary = _summary(out)
    ckpt_dir = str(next((tmp_path / "runs").glob("*/checkpoints")))
    assert summary["aborted"] is True and summary["stopped"] == sig.name
    assert summary["checkpoint"] == checkpoint.latest(ckpt_dir) and summary["steps"] == 8
    assert checkpoint.read_manifest(summary["checkpoint"])["step"] == 8
    for _, uri in checkpoint.list_checkpoints(ckpt_dir):  # the abort never leaves a half-published checkpoint
        checkpoint.load_shards(uri)
    _assert_gone(workers)
