"""cluster.yaml is valid for Ray's cluster launcher and does not expose the dashboard."""

import json
import os
from pathlib import Path

import jsonschema
import ray.autoscaler
import yaml

REPO = Path(__file__).resolve().parents[1]


def _config():
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_matches_rays_schema():
    schema_path = os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    jsonschema.validate(_config(), schema)


def test_cluster_yaml_keeps_dashboard_private_and_auth_on():
    cfg = _config()
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "RAY_AUTH_MODE=token" in head
    assert all("RAY_AUTH_MODE=token" in c for c in cfg["worker_start_ray_commands"] if "ray start" in c)
    assert cfg["available_node_types"]["gpu_worker"]["max_workers"] >= 1
    assert any("raytrain" in c for c in cfg["setup_commands"])
