"""train.compile: each layer compiled (nn.Module.compile) where the stage builds it, in every layout; the
compiled math of a layout equals the compiled math of one process, and stays within rounding of eager; the
compile time is start-up badput; a CPU run without a C++ compiler is refused before any actor starts."""

import json
from pathlib import Path

import pytest

from raytrain import checkpoint, train
from raytrain.driver.prepare import prepare
from tests.helpers import assert_same_params, reference_state


@pytest.mark.ray
def test_compiled_dp2_and_pp2_equal_a_compiled_process_and_eager_within_rounding(ray_session, make_config):
    # Every worker runs micro-batches of 4 samples, so the three runs share one compiled graph per layer kind.
    runs = {}
    for layout in (["parallel.microbatches=2"], ["parallel.dp=2"], ["parallel.pp=2", "parallel.microbatches=2"]):
        cfg = make_config("train.compile=true", "checkpoint.every=5", *layout)
        result = train(cfg)
        runs[" ".join(layout)] = checkpoint.load_state_dict(result.checkpoint)
        rows = [json.loads(line) for line in Path(result.run_dir, "metrics.jsonl").read_text().splitlines()]
        first_step = next(r for r in rows if r.get("step") == 1 and "loss" in r)
        assert first_step["compile_s"] > 0, "the first step compiled nothing"
        assert result.goodput["badput_s"]["start_up"] >= first_step["compile_s"]  # compiling is start-up, not work
    one_process = runs.pop("parallel.microbatches=2")
    for layout, state in runs.items():
        assert_same_params(state, one_process, rtol=1e-5)
    eager = reference_state(make_config())
    assert_same_params(one_process, eager, rtol=1e-4)


def test_a_cpu_run_without_a_cxx_compiler_is_refused_naming_the_key_and_the_fix(make_config, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=r"train.compile=true.*C\+\+ compiler.*apt-get install g\+\+.*train.compile=false"):
        prepare(make_config("train.compile=true"))
    monkeypatch.setenv("CXX", "/opt/nowhere/g++")  # $CXX named: that one is looked for
    with pytest.raises(ValueError, match="/opt/nowhere/g"):
        prepare(make_config("train.compile=true"))
