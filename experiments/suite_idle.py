"""Where the test suite's time goes: a pytest plugin that records, per test, its wall seconds and the CPU
seconds the whole machine left idle meanwhile (from /proc/stat), and prints the totals, the busiest test
files and the tests that waited most.

The suite is over its 15-minute budget on two cores: this tells waiting (a timeout a test sits out, a
process it waits to start) from work (worker processes starting: about 3 s of CPU each, importing torch
and the torch._dynamo that torch.optim imports).

    PYTHONPATH=experiments python -m pytest -n 0 -m ray -p suite_idle    # writes suite_idle.json here too
"""

from __future__ import annotations

import collections
import glob
import json
import os
import time

TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
_started: dict[str, tuple[float, float]] = {}
_rows: list[dict] = []


def _idle_s() -> float:
    """The machine's idle CPU seconds so far (idle and iowait, every core)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (values[3] + values[4]) / TICK


def _ray_workers_started() -> int:
    """How many Ray worker processes the local Ray sessions have started (each writes a log of its own): every
    dated session directory's, since an embedded Ray a test starts moves ``session_latest`` off the session's
    own Ray."""
    root = os.environ.get("RAY_TMPDIR", "/tmp/ray")
    return len(glob.glob(os.path.join(root, "session_2*", "logs", "python-core-worker-*.log")))


def pytest_runtest_setup(item) -> None:
    _started[item.nodeid] = (time.monotonic(), _idle_s(), _ray_workers_started())


def pytest_runtest_logfinish(nodeid, location) -> None:
    if nodeid in _started:
        t0, idle0, workers0 = _started.pop(nodeid)
        wall = time.monotonic() - t0
        idle = _idle_s() - idle0
        _rows.append({"test": nodeid, "wall_s": round(wall, 2), "idle_core_s": round(idle, 2),
                      "busy_core_s": round(CORES * wall - idle, 2),
                      "ray_workers_started": max(0, _ray_workers_started() - workers0)})


def pytest_terminal_summary(terminalreporter) -> None:
    if not _rows:
        return
    write = terminalreporter.write_line
    wall = sum(r["wall_s"] for r in _rows)
    idle = sum(r["idle_core_s"] for r in _rows)
    write(f"suite_idle: {len(_rows)} tests, {wall:.0f} s of wall, {idle:.0f} of {CORES * wall:.0f} core-seconds idle "
          f"({idle / (CORES * wall):.0%}); busy {CORES * wall - idle:.0f} core-s = {(CORES * wall - idle) / CORES:.0f} s "
          f"on {CORES} cores if perfectly packed; {sum(r['ray_workers_started'] for r in _rows)} Ray worker "
          f"processes started")
    files = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
    for r in _rows:
        entry = files[r["test"].split("::")[0]]
        entry[0] += r["busy_core_s"]
        entry[1] += r["wall_s"]
        entry[2] += 1
        entry[3] += r["ray_workers_started"]
    write("busiest files (busy core-s, wall s, tests, Ray worker processes started):")
    for name, (busy, w, n, workers) in sorted(files.items(), key=lambda item: -item[1][0])[:16]:
        write(f"  {busy:6.0f} {w:6.0f} {n:3d} {workers:4d}  {name}")
    write("tests that waited most (idle core-s / wall s):")
    for r in sorted(_rows, key=lambda r: -r["idle_core_s"])[:12]:
        write(f"  {r['idle_core_s']:6.1f} / {r['wall_s']:6.1f}  {r['test']}")
    with open("suite_idle.json", "w") as f:
        json.dump(_rows, f, indent=0)
