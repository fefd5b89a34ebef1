"""`ray job submit` against a real (private, local) cluster with token authentication on."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.private_cluster import _pids_naming, private_ray_head

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 240


def test_job_submit_runs_training_and_ends_with_summary_json(tmp_path, data_cache):
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with private_ray_head(num_cpus=2) as (url, env):
        # Without --no-wait, `ray job submit` follows the job to its end: one CLI process instead of
        # a `ray job status` process every few seconds (each costs a Ray import on these 2 cores).
        submit = subprocess.run(
            [ray_bin, "job", "submit", "--address", url, "--working-dir", str(REPO), "--",
             sys.executable, "-m", "raytrain", "train", "--config", "experiments/configs/tiny.yaml",
             "--set", "train.steps=4", "--set", f"run.dir={tmp_path / 'runs'}",
             "--set", f"data.cache_dir={data_cache}", "--set", "data.max_bytes=200000"],
            env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
        )
        # It streams the job's logs and ends with the job's final status; a failed job exits non-zero.
        output = submit.stdout + submit.stderr
        assert submit.returncode == 0 and re.search(r"Job 'raysubmit_\w+' succeeded", output), output[-3000:]
        summary = json.loads(next(line for line in reversed(submit.stdout.splitlines()) if line.startswith("{")))
        assert summary["steps"] == 4 and summary["layout"] == "dp=2 pp=1 m=1"
        assert os.path.exists(os.path.join(summary["checkpoint"], "manifest.json"))
        # without the token the job API refuses
        no_token = dict(env, RAY_AUTH_TOKEN="not-the-token")
        denied = subprocess.run([ray_bin, "job", "list", "--address", url], env=no_token,
                                capture_output=True, text=True, timeout=60)
        assert denied.returncode != 0
    assert not _pids_naming("rtjob-"), "processes of the private cluster are still running"
