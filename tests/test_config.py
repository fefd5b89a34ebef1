"""Bad input fails before any actor starts, with a message that names the key or file and the fix."""

import os
import subprocess
from pathlib import Path
import sys

import pytest

from raytrain.config import all_keys, load_config, parse_override


@pytest.mark.parametrize(
    "overrides, must_mention",
    [
        (["parallel.dp=0"], ["parallel.dp", ">= 1"]),
        (["train.lrr=0.1"], ["train.lrr", "did you mean 'train.lr'"]),
        (["paralel.dp=2"], ["paralel.dp", "parallel.dp"]),
        (["train.global_batch=7", "parallel.dp=2"], ["train.global_batch=7", "parallel.dp=2", "multiple of 2"]),
        (["data.path=/nonexistent/tokens.parquet"], ["data.path", "/nonexistent/tokens.parquet"]),
        (["parallel.pp=9"], ["parallel.pp=9", "layers"]),
        (["parallel.schedule=zigzag"], ["parallel.schedule", "gpipe", "1f1b"]),
        (["parallel.dp=two"], ["parallel.dp", "integer"]),
        (["parallel.microbatches=3", "train.global_batch=8"], ["parallel.microbatches=3", "divisor"]),
        (["parallel.pp=2", "parallel.split_points=[1, 2]"], ["parallel.split_points", "needs 1"]),
        (["parallel.pp=2", "parallel.split_points=[7]"], ["parallel.split_points", "out of range"]),
        (["model.d_model=30", "model.n_head=4"], ["model.d_model", "model.n_head"]),
        (["model.factory=no_such_module:build"], ["model.factory", "no_such_module"]),
        (["elastic.min_dp=3", "parallel.dp=2"], ["elastic.min_dp=3", "1..parallel.dp=2"]),
        (["elastic.max_dp=1", "parallel.dp=2"], ["elastic.max_dp=1", "parallel.dp=2", ">= 2"]),
        (["resources.placement_strategy=spread"], ["resources.placement_strategy", "STRICT_SPREAD"]),
        (["elastic.faults=['1:0@3:sideways']"], ["elastic.faults", "phase must be one of"]),
        (["resources.bf16=true"], ["resources.bf16", "use_gpu"]),
        (["model.vocab_size=128"], ["model.vocab_size=128", "built-in corpus", "bytes", ">= 256", "data.path"]),
    ],
)
def test_bad_input_names_key_and_fix(overrides, must_mention):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


def test_overrides_are_typed_and_applied_in_order():
    cfg = load_config(None, ["train.lr=1e-3", "parallel.dp=2", "parallel.dp=4", "train.global_batch=16",
                             "resources.use_gpu=false", "checkpoint.dir=s3://bucket/run"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.parallel.dp == 4 and cfg.checkpoint.dir == "s3://bucket/run"
    assert parse_override("parallel.split_points=[2, 4]") == ("parallel.split_points", [2, 4])
    with pytest.raises(ValueError, match="key=value"):
        parse_override("parallel.dp")


def test_yaml_file_errors_name_the_file_or_key(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3, gloabl_batch: 8}\n")
    with pytest.raises(ValueError, match="train.gloabl_batch.*train.global_batch"):
        load_config(str(bad))


def test_public_keys_exist():
    keys = set(all_keys())
    for key in ["model.n_layer", "model.d_model", "model.n_head", "model.seq_len", "model.vocab_size",
                "model.factory", "train.steps", "train.global_batch", "train.lr", "train.seed", "train.grad_clip",
                "parallel.dp", "parallel.pp", "parallel.microbatches", "parallel.schedule", "checkpoint.dir",
                "checkpoint.every", "elastic.min_dp", "elastic.max_dp", "resources.use_gpu"]:
        assert key in keys


def test_cli_rejects_bad_input_before_starting_ray(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "train", "--config", str(Path(__file__).parents[1] / "experiments/configs/tiny.yaml"),
         "--set", "train.global_batch=15"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "train.global_batch=15" in proc.stderr and "parallel.dp=2" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


FACTORY_IMPORTING_TORCH = '''
import torch.nn as nn  # a torch submodule first: the import order that raced the driver's torch preload
import torch


def build(model_cfg):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(model_cfg.vocab_size, 8), nn.Linear(8, model_cfg.vocab_size))
'''


def test_cli_imports_a_factory_that_imports_torch_at_its_top(tmp_path):
    # The driver imports torch.distributed in a background thread; importing the user's module at the
    # same time used to crash every time with 'cannot initialize type "RpcBackendOptions"'.
    (tmp_path / "torch_at_top.py").write_text(FACTORY_IMPORTING_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "train", "--config", str(Path(__file__).parents[1] / "experiments/configs/tiny.yaml"),
         "--set", "model.factory=torch_at_top:build", "--set", "checkpoint.resume=/nonexistent/dir"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    # The factory was imported and built; the run then stops at the (later) resume check, before Ray starts.
    assert proc.returncode == 2, proc.stderr
    assert "config error: checkpoint.resume='/nonexistent/dir'" in proc.stderr
    assert "RpcBackendOptions" not in proc.stderr and "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
