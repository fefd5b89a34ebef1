"""The README's local-cluster commands, run as written on a fresh machine (a fresh HOME with no Ray
token, a private network namespace, so ``ray start --head`` uses its default ports): the cluster
has token authentication on, ``ray job submit`` trains and ends with the summary JSON, the run
directory outlives the job, and a request without the token is refused."""

import json
import os
import re
from pathlib import Path

import pytest

from tests.private_cluster import pids_using, private_machine, unshare_works

pytestmark = pytest.mark.ray  # ray start, ray job submit

REPO = Path(__file__).resolve().parents[1]

README_MARKER = "<!-- tests/test_job_submit.py runs this block as written -->"

STEP_TIMEOUT_S = {"ray start": 90, "ray job submit": 180}
"""Bounds on the slow README steps (a head starts in ~15 s, the job takes ~60 s on 2 busy cores)."""

OTHER_STEP_TIMEOUT_S = 30

DASHBOARD_URL = "http://127.0.0.1:8265"
"""``ray start --head``'s default dashboard (and job API) address: the network namespace is private."""

NO_TOKEN_REQUEST = f"""python -c '
import urllib.error, urllib.request
try:
    urllib.request.urlopen("{DASHBOARD_URL}/api/jobs/", timeout=10)
    print("status 200")
except urllib.error.HTTPError as e:
    print("status", e.code)
'"""


def readme_commands() -> list[str]:
    """The commands of the README block under README_MARKER (continuation lines joined, comments dropped)."""
    text = (REPO / "README.md").read_text()
    assert text.count(README_MARKER) == 1, f"README.md must hold the line {README_MARKER!r} once"
    block = re.match(r"\s*```bash\n(.*?)\n```", text.split(README_MARKER, 1)[1], re.S)
    assert block, f"a ```bash block must follow {README_MARKER!r} in README.md"
    commands, pending = [], ""
    for line in block.group(1).splitlines():
        if line.rstrip().endswith("\\"):
            pending += line + "\n"
            continue
        command, pending = pending + line, ""
        if command.strip() and not command.lstrip().startswith("#"):
            commands.append(command.strip())
    return commands


def with_test_overrides(command: str, data_cache: str) -> str:
    """The README's job command plus --set overrides that only make it small: 4 steps on a slice of the
    corpus cached by the session. run.dir stays unset: where a job's runs go is under test."""
    assert "#" not in command, "overrides are appended: keep comments off the `ray job submit` line"
    return command + f" --set train.steps=4 --set data.max_bytes=200000 --set data.cache_dir={data_cache}"


def step_timeout_s(command: str) -> float:
    return next((t for prefix, t in STEP_TIMEOUT_S.items() if command.startswith(prefix)), OTHER_STEP_TIMEOUT_S)


def summary_of(output: str) -> dict:
    """The job's last line that is a JSON object: the CLI's summary."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no summary JSON in the job's output:\n{output[-3000:]}")


@pytest.mark.skipif(not unshare_works(), reason="needs `unshare -n` (root or user namespaces) for a private network")
@pytest.mark.timeout(sum(STEP_TIMEOUT_S.values()) + 6 * OTHER_STEP_TIMEOUT_S + 60)
def test_readme_cluster_commands_run_as_written_with_token_auth(data_cache):
    commands = readme_commands()
    submits = [c for c in commands if c.startswith("ray job submit")]
    assert len(submits) == 1 and any(c.startswith("ray start --head") for c in commands), commands
    with private_machine(str(REPO)) as (shell, home, ray_tmp):
        for command in commands:
            run = with_test_overrides(command, data_cache) if command in submits else command
            rc, out = shell.run(run, step_timeout_s(command))
            assert rc == 0, f"README command `{command}` exited with {rc}:\n{out[-3000:]}"
            if command in submits:
                job = out  # `ray job submit` follows the job to its end, streaming its output
        assert re.search(r"Job 'raysubmit_\w+' succeeded", job, re.I), job[-3000:]
        summary = summary_of(job)
        assert summary["steps"] == 4 and summary["layout"] == "dp=2 pp=1 m=1", summary
        assert os.path.exists(os.path.join(summary["checkpoint"], "manifest.json"))
        # The run directory is durable, named in the job's output, and not in Ray's working-dir copy.
        run_dir = summary["run_dir"]
        assert run_dir.startswith(os.path.join(home, "raytrain", "runs") + os.sep), run_dir
        assert not run_dir.startswith(ray_tmp) and f"run dir {run_dir}" in job
        assert os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
        # `ray status` works in the same shell, and a request without the token, or with a wrong one, is refused.
        rc, out = shell.run("ray status", OTHER_STEP_TIMEOUT_S)
        assert rc == 0 and "Resources" in out, out[-3000:]
        rc, out = shell.run(NO_TOKEN_REQUEST, OTHER_STEP_TIMEOUT_S)
        assert rc == 0 and out.strip().endswith("status 401"), out
        rc, out = shell.run(f"RAY_AUTH_TOKEN=not-the-token ray job list --address {DASHBOARD_URL}",
                            OTHER_STEP_TIMEOUT_S)
        assert rc != 0 and "Invalid authentication token" in out, out[-3000:]
    assert not pids_using(home, ray_tmp), "processes of the private cluster are still running"
