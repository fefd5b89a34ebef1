"""One Ray instance for the whole test session; small models; every wait bounded."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain.config import load_config

# Logical CPU slots for the session's Ray: dp=4 and dp=2 x pp=2 need 4 workers of 1 slot each.
# Each worker runs one torch thread, so 4 slots on 2 cores oversubscribe time, never correctness.
TEST_RAY_CPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=TEST_RAY_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture
def make_config(tmp_path, data_cache):
    """A small GPT on a small slice of the built-in corpus; keyword args are --set overrides."""

    def make(*overrides: str, **kw):
        base = [
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
            "train.steps=5", "train.global_batch=8", "train.lr=1e-2", "train.seed=3",
            f"data.cache_dir={data_cache}", "data.max_bytes=200000",
            f"run.dir={tmp_path / 'runs'}", "run.trace_steps=1", "resources.wait_s=20",
            "resources.step_timeout_s=60",
        ]
        return load_config(None, base + list(overrides))

    return make


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of two tensors (0 for identical)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def assert_same_params(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Every parameter present in both and equal to ``rtol`` relative (norm-wise per tensor)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    worst = max(((relative_error(got[k], want[k]), k) for k in want))
    assert worst[0] <= rtol, f"parameter {worst[1]} differs by {worst[0]:.2e} relative (> {rtol})"


def reference_state(cfg, steps=None) -> dict:
    from raytrain.reference import train_reference

    model, _ = train_reference(cfg, steps)
    return {k: v.detach() for k, v in model.state_dict().items()}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
