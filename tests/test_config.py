"""Bad input fails before any actor starts, with a message that names the key or file and the fix."""

import ast
import os
import re
import subprocess
from pathlib import Path
import sys

import pytest
import yaml

from raytrain.config import RENAMED_KEYS, all_keys, config_from_dict, load_config, parse_override
from raytrain.driver.prepare import prepare


def _rejected(overrides, tmp_path) -> ValueError:
    """The error bad input raises before any actor starts: from the config itself, or from the checks of
    this machine's files and modules (raytrain.driver.prepare.prepare)."""
    with pytest.raises(ValueError) as err:
        prepare(load_config(None, [f"run.dir={tmp_path}", *overrides]))
    return err.value


def test_split_backwards_compose_with_sharded_stages():
    # ShardedGrads reduces a chunk after its last weight half (tests/test_pipeline.py proves the math)
    for keys in (["parallel.split_backward=true"],
                 ["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.microbatches=4"],
                 ["parallel.schedule=dualpipev", "parallel.virtual_stages=2", "parallel.microbatches=4"]):
        cfg = load_config(None, ["parallel.fsdp=2", "parallel.pp=2", *keys])
        assert cfg.parallel.fsdp == 2


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
        (["parallel.fsdp=3"], ["train.global_batch=8", "parallel.dp x parallel.fsdp=3", "multiple of 3"]),
        (["parallel.fsdp=2", "parallel.dp=2", "parallel.microbatches=4"],
         ["parallel.microbatches=4", "per-replica batch 2", "parallel.fsdp"]),
        (["parallel.fsdp=1024", "train.global_batch=1024"], ["parallel.fsdp=1024", "rows", "parallel.fsdp <= 512"]),
        (["parallel.tp=3", "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=3", "model.n_head=4", "divisor of 4"]),
        (["parallel.tp=2", "resources.placement_strategy=STRICT_SPREAD"],
         ["resources.placement_strategy='STRICT_SPREAD'", "each tp group on one node"]),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=15",
          "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=2", "model.seq_len=15", "use a tp that divides it, or sequence_parallel=false"]),
        (["parallel.sequence_parallel=true"], ["parallel.sequence_parallel=true", "set parallel.tp > 1"]),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "model.hf=/nonexistent", "model.seq_len=15",
          "resources.placement_strategy=STRICT_PACK"], ["parallel.tp=2", "model.seq_len=15", "sequence_parallel=false"]),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "resources.placement_strategy=STRICT_PACK",
          "model.factory=tests.factories:planned_mlp"],
         ["parallel.tp=2", "no layer declares sequence_* entries"]),
        (["parallel.tp=2", "parallel.sequence_parallel=true",
          "model.factory=tests.factories:sequence_parallel_block_after_a_plain_embedding",
          "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=2", "layer 1 takes the tokens split, but the layers before it do not split them"]),
        (["parallel.tp=2", "model.factory=tests.factories:one_row_head", "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=2", "model.factory='tests.factories:one_row_head'", "no layer declares a tensor-parallel plan",
          "Declare tp_plan on its layers", "use parallel.fsdp"]),
        (["parallel.tp=2", "model.factory=tests.factories:plan_names_a_norm", "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=2", "layer 1's tp_plan['norm'] names no nn.Linear"]),
        (["parallel.tp=3", "model.factory=tests.factories:planned_mlp", "resources.placement_strategy=STRICT_PACK"],
         ["parallel.tp=3", "layer 1's tp_plan['up']: up.out_features=512 does not split into 2 part(s) of tp=3"]),
        (["parallel.fsdp=2", "parallel.dp=1", "elastic.max_dp=5"], ["elastic.max_dp=5", "parallel.fsdp=2"]),
        (["parallel.virtual_stages=2"], ["parallel.virtual_stages=2", "parallel.pp > 1"]),
        (["parallel.pp=2", "parallel.virtual_stages=2"], ["parallel.virtual_stages=2", "schedule=1f1b",
                                                            "interleaved_1f1b, zbv or dualpipev"]),
        (["parallel.pp=2", "parallel.schedule=interleaved_1f1b"], ["parallel.virtual_stages=1", ">= 2 chunks"]),
        (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=3"],
         ["parallel.virtual_stages=3", "exactly 2 chunks"]),
        (["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "parallel.microbatches=1"],
         ["parallel.microbatches=1", "rounds of parallel.pp=2", "multiple of 2"]),
        (["parallel.pp=4", "parallel.schedule=zbv", "parallel.virtual_stages=2"],
         ["parallel.pp=4", "x parallel.virtual_stages=2 chunks exceeds the 6 layers", "parallel.virtual_stages"]),
        (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.split_points=[2]"],
         ["parallel.split_points", "x virtual_stages=2 needs 3"]),
        (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "train.activation_checkpointing=true"],
         ["train.activation_checkpointing", "zbv splits backwards"]),
        (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "train.compile=true"],
         ["train.compile", "compiled layers", "zbv splits backwards"]),
        (["parallel.pp=2", "parallel.split_backward=true", "train.compile=true"],
         ["train.compile", "turn off parallel.split_backward"]),
        (["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.virtual_stages=1"],
         ["parallel.virtual_stages=1", "dualpipev puts exactly 2 chunks"]),
        (["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.virtual_stages=2", "parallel.microbatches=2"],
         ["parallel.microbatches=2", "at least 2 x parallel.pp = 4", "parallel.schedule=zbv"]),
        (["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.virtual_stages=2", "parallel.microbatches=4",
          "train.activation_checkpointing=true"], ["train.activation_checkpointing", "dualpipev splits backwards"]),
        (["model.vocab_size=128"], ["model.vocab_size=128", "built-in corpus", "bytes", ">= 256", "data.path"]),
        (["data.max_bytes=100", "model.seq_len=64", "train.global_batch=8"],
         ["data.max_bytes=100", "train.global_batch=8", "model.seq_len + 1", ">= 520"]),
    ],
)
def test_bad_input_names_key_and_fix(overrides, must_mention, tmp_path):
    error = _rejected(overrides, tmp_path)
    for text in must_mention:
        assert text in str(error), f"{text!r} missing from: {error}"


def test_config_checks_touch_no_disk_and_import_nothing():
    # Every node builds the Config (the coordinator, each worker, each Tune trial): what only the
    # driver's machine can answer is checked once, by prepare.
    cfg = load_config(None, ["data.path=/nonexistent/tokens.parquet", "model.factory=no_such_module:build"])
    assert cfg.data.path == "/nonexistent/tokens.parquet" and cfg.model.factory == "no_such_module:build"


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
         "--set", "train.global_batch=15", "--set", "elastic.wait_s=5"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "train.global_batch=15" in proc.stderr and "parallel.dp=2" in proc.stderr
    # A renamed key is said on one line, before the error, though Python hides a library's DeprecationWarning.
    lines = proc.stderr.splitlines()
    said = ("raytrain: DeprecationWarning: config key elastic.wait_s is deprecated: it is renamed "
            "elastic.capacity_wait_s; write that instead")
    assert said in lines and lines[lines.index(said) + 1].startswith("raytrain: config error:"), proc.stderr
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
    # same time must not race it (the race crashes with 'cannot initialize type "RpcBackendOptions"').
    (tmp_path / "torch_at_top.py").write_text(FACTORY_IMPORTING_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    tiny = str(Path(__file__).parents[1] / "experiments/configs/tiny.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "train", "--config", tiny,
         "--set", "model.factory=torch_at_top:build", "--set", "checkpoint.resume=/nonexistent/dir"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    # The factory was imported and built; the run then stops at the (later) resume check, before Ray starts.
    assert proc.returncode == 2, proc.stderr
    assert "config error: checkpoint.resume='/nonexistent/dir'" in proc.stderr
    assert "RpcBackendOptions" not in proc.stderr and "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


# --- every key has a checked type and range: one bad value per key ---------------------------------

BAD_VALUE_PER_KEY = [  # (override, a fragment of the fix the message must give besides the key)
    ("model.n_layer=0", ">= 1"),
    ("model.d_model=0", ">= 1"),
    ("model.n_head=0", ">= 1"),
    ("model.seq_len=0", ">= 1"),
    ("model.vocab_size=0", ">= 1"),
    ("model.factory=my_models.build", "package.module:function"),
    ("model.hf=' '", "directory path"),
    ("model.hf_cut=halves", "auto, layers, whole"),
    ("model.trust_remote_code=maybe", "true or false"),
    ("train.steps=0", ">= 1"),
    ("train.global_batch=0", ">= 1"),
    ("train.lr=-1", ">= 0"),
    ("train.weight_decay=-0.1", ">= 0"),
    ("train.adam_eps=0", "AdamW needs > 0"),
    ("train.fused_optimizer=maybe", "true or false"),
    ("train.seed=-1", "0..2**32-1"),
    ("train.grad_clip=-1", ">= 0"),
    ("train.skip_nonfinite=-1", ">= 0"),
    ("train.lr_schedule=step", "cosine"),
    ("train.warmup_steps=-1", ">= 0"),
    ("train.min_lr=1", "0..train.lr"),
    ("train.activation_checkpointing=maybe", "true or false"),
    ("train.compile=sometimes", "true or false"),
    ("parallel.dp=0", ">= 1"),
    ("parallel.fsdp=0", ">= 1"),
    ("parallel.tp=0", ">= 1"),
    ("parallel.pp=0", ">= 1"),
    ("parallel.microbatches=0", ">= 1"),
    ("parallel.schedule=zigzag", "gpipe"),
    ("parallel.virtual_stages=0", ">= 1"),
    ("parallel.split_backward=maybe", "true or false"),
    ("parallel.sequence_parallel=maybe", "true or false"),
    ("parallel.split_points=[a]", "list of integers"),
    ("parallel.balance=weights", "params"),
    ("parallel.auto=maybe", "true or false"),
    ("parallel.auto_steps=1", ">= 2"),
    ("parallel.auto_max_workers=0", ">= 1"),
    ("parallel.auto_microbatches=[0, 2]", "integers >= 1"),
    ("parallel.auto_schedules=[zigzag]", "1f1b"),
    ("data.path=/nonexistent/tokens.parquet", "no such file"),
    ("data.column=''", "name the token column"),
    ("data.cache_dir=''", "a directory"),
    ("data.max_bytes=0", ">= 1"),
    ("data.text_column=''", "name the text column"),
    ("data.tokenizer=''", "holding tokenizer.json"),
    ("data.eval_fraction=1", "a fraction in [0, 1)"),
    ("model.options=[1, 2]", "a mapping of names"),
    ("data.eval_path=/nonexistent/heldout.parquet", "no such file"),
    ("data.builtin=mnist", "stdlib, digits"),
    ("data.inputs=[]", "list of numeric column names"),
    ("data.targets=label", "come together"),
    ("data.transform=not-a-module", "package.module:function"),
    ("data.factory=nope", "package.module:function"),
    ("data.new_epoch_on_change=maybe", "true or false"),
    ("data.order_origin=[1]", "leave it unset"),
    ("checkpoint.dir=''", "a directory or URI"),
    ("checkpoint.every=-1", ">= 0"),
    ("checkpoint.resume=''", "latest"),
    ("checkpoint.keep=0", ">= 1"),
    ("checkpoint.async_save=maybe", "true or false"),
    ("checkpoint.lineage=''", "leave it unset"),
    ("elastic.min_dp=0", ">= 1"),
    ("elastic.max_dp=0", ">= 1"),
    ("elastic.grow_poll_s=0", "> 0"),
    ("elastic.drain_grace_s=0", "> 0"),
    ("elastic.standby=-1", ">= 0"),
    ("elastic.replace_at_notice=3", "true or false"),
    ("elastic.detect_timeout_s=-5", "> 0"),
    ("elastic.capacity_wait_s=0", "> 0"),
    ("elastic.max_failures=-1", ">= 0"),
    ("elastic.coordinator_restarts=-1", ">= 0"),
    ("elastic.faults=['1:0@3:sideways']", "phase must be one of"),
    ("resources.use_gpu=maybe", "true or false"),
    ("resources.cpus_per_worker=0", ">= 1"),
    ("resources.bf16=maybe", "true or false"),
    ("resources.placement_wait_s=0", "> 0"),
    ("resources.step_timeout_s=0", "> 0"),
    ("resources.placement_strategy=spread", "STRICT_SPREAD"),
    ("resources.check_memory=maybe", "true or false"),
    ("eval.every=-1", ">= 0"),
    ("eval.batches=0", ">= 1"),
    ("eval.metrics=[f1]", "accuracy, top5, mse, mae"),
    ("run.dir=''", "a directory"),
    ("run.name=exp/1", "without '/'"),
    ("run.trace_steps=-1", ">= 0"),
    ("run.loggers=['wandb']", "tensorboard, mlflow"),
    ("run.record_samples=maybe", "true or false"),
]

NO_BAD_VALUE = {}  # key -> why no value of the right type is wrong (none so far: keep it that way)


@pytest.mark.parametrize("override, fix", BAD_VALUE_PER_KEY, ids=[o.partition("=")[0] for o, _ in BAD_VALUE_PER_KEY])
def test_every_key_rejects_a_bad_value_by_name(override, fix, tmp_path):
    key = override.partition("=")[0]
    error = _rejected([override], tmp_path)
    assert key in str(error) and fix in str(error), str(error)


def test_every_key_has_a_bad_value_in_the_table():
    # A new config key must come with its validation and a row above (or a reason in NO_BAD_VALUE).
    covered = [o.partition("=")[0] for o, _ in BAD_VALUE_PER_KEY]
    assert len(covered) == len(set(covered)), "one row per key"
    missing = set(all_keys()) - set(covered) - set(NO_BAD_VALUE)
    assert not missing, f"keys without a bad-value row in BAD_VALUE_PER_KEY: {sorted(missing)}"
    assert not (set(covered) | set(NO_BAD_VALUE)) - set(all_keys()), "rows for keys that no longer exist"
    assert all(NO_BAD_VALUE.values()), "each exception needs its reason"


CHECKED_MODULES = ["raytrain/config/schema.py", "raytrain/config/layout.py"]
"""Where the config's checks live: every one raises through raytrain.config.errors.require."""


@pytest.mark.parametrize("module", CHECKED_MODULES)
def test_every_config_check_raises_through_the_one_helper(module):
    tree = ast.parse((Path(__file__).parents[1] / module).read_text())
    raises = [f"{module}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Raise)]
    assert not raises, f"raise the one form, require(ok, key, value, fix), instead: {raises}"


ONE_FORM = re.compile(r"^(?P<key>[a-z_]+\.[a-z0-9_]+)=\S.*?: \S")
"""``key=value: fix``, the form of raytrain.config.errors.config_error."""


@pytest.mark.parametrize("overrides", [[o] for o, _ in BAD_VALUE_PER_KEY] + [
    ["model.d_model=30", "model.n_head=4"], ["parallel.pp=2", "parallel.split_points=[1, 2]"],
    ["parallel.pp=3", "parallel.split_points=[2, 2]"], ["parallel.auto=true", "parallel.split_points=[]"],
    ["parallel.pp=9"], ["parallel.pp=2", "parallel.split_points=[7]"], ["train.global_batch=7", "parallel.dp=2"],
    ["parallel.fsdp=3"], ["parallel.microbatches=3"], ["parallel.auto=true", "elastic.min_dp=1"],
    ["elastic.min_dp=3", "parallel.dp=2"], ["elastic.max_dp=1", "parallel.dp=2"],
    ["elastic.max_dp=5", "parallel.fsdp=2"], ["model.vocab_size=128"], ["data.max_bytes=100"], ["eval.every=2"],
    ["parallel.fsdp=1024", "train.global_batch=1024"], ["elastic.faults=['x']"],
    ["train.activation_checkpointing=true", "parallel.split_backward=true"],
], ids=lambda overrides: " ".join(overrides))
def test_every_rejected_value_is_named_in_the_one_form(overrides):
    try:
        load_config(None, overrides)
    except ValueError as e:
        found = ONE_FORM.match(str(e))
        assert found and found["key"] in all_keys(), f"not 'key=value: fix': {e}"
    else:  # only this machine's checks (raytrain.driver.prepare.prepare) can refuse it: held-out rows may come
        # from a dataset the Python API or data.factory passes, which only prepare sees
        assert overrides[0].split("=")[0] in ("data.path", "data.eval_path", "model.factory", "eval.every"), overrides


def _float_keys() -> list[str]:
    import dataclasses
    import typing

    from raytrain.config import Config

    sections = typing.get_type_hints(Config)
    return [f"{s}.{name}" for s, cls in sections.items()
            for name, hint in typing.get_type_hints(cls).items() if hint in (float, typing.Optional[float])
            and name in {f.name for f in dataclasses.fields(cls)}]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "1e999", "1" + "0" * 400])
def test_float_keys_must_be_finite(value):
    # A YAML .nan or .inf passed every '<= 0' check and reached AdamW or a timer inside the workers.
    keys = _float_keys()
    assert "train.lr" in keys and "elastic.capacity_wait_s" in keys
    for key in keys:
        with pytest.raises(ValueError, match=f"{key}.*finite"):
            load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("text, key, line", [
    ("train:\n  steps: 3\nmodel:\n  n_layer: 2\ntrain:\n  lr: 0.1\n", "train", 5),
    ("train:\n  steps: 3\n  steps: 4\n", "steps", 3),
])
def test_a_key_given_twice_in_a_config_file_is_an_error_naming_it_and_its_line(tmp_path, text, key, line):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"twice.yaml.* line {line}, .*key '{key}' appears twice"):
        load_config(str(path))


def _config_from(values: dict, source: str, tmp_path):
    """A Config from flat ``values`` given as a YAML file, as --set overrides, or as a Python dict."""
    nested: dict = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    if source == "yaml":
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(nested))
        return load_config(str(path))
    if source == "override":
        return load_config(None, [f"{key}={value}" for key, value in values.items()])
    return config_from_dict(nested)


SOURCES = ["yaml", "override", "dict"]
RENAMES = [("resources.wait_s", "resources.placement_wait_s"), ("elastic.wait_s", "elastic.capacity_wait_s")]


def test_the_renamed_keys_are_the_wait_keys():
    assert RENAMED_KEYS == dict(RENAMES)
    assert not set(RENAMED_KEYS) & set(all_keys()) and set(RENAMED_KEYS.values()) <= set(all_keys())


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("old, new", RENAMES)
def test_an_old_key_name_still_works_with_a_deprecation_warning(old, new, source, tmp_path):
    with pytest.warns(DeprecationWarning) as caught:
        cfg = _config_from({old: 7.5}, source, tmp_path)
    section, _, name = new.partition(".")
    assert getattr(getattr(cfg, section), name) == 7.5
    assert [str(w.message) for w in caught] == [
        f"config key {old} is deprecated: it is renamed {new}; write that instead"]
    assert caught[0].filename == __file__  # it points at the caller's line, outside raytrain.config
    assert name in cfg.to_dict()[section] and old.partition(".")[2] not in cfg.to_dict()[section]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("old, new", RENAMES)
def test_a_key_given_under_its_old_and_new_names_is_an_error_naming_both(old, new, source, tmp_path):
    with pytest.raises(ValueError, match=rf"^{re.escape(old)}=5: renamed {re.escape(new)}, which is given too: "
                                         rf"keep only {re.escape(new)}$"):
        _config_from({old: 5, new: 6}, source, tmp_path)


def test_the_checkpoint_module_is_reachable_from_a_bare_import():
    code = "import raytrain; print(callable(raytrain.checkpoint.load_state_dict))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_a_target_column_among_several_inputs_is_refused_but_one_column_as_both_is_an_autoencoders():
    with pytest.raises(ValueError, match=r"data.inputs=\['a', 'y'\]: it lists the data.targets column 'y'"):
        load_config(None, ["data.inputs=[a, y]", "data.targets=y"])
    assert load_config(None, ["data.inputs=x", "data.targets=x"]).data.inputs == "x"
    with_transform = load_config(None, ["data.inputs=[a, y]", "data.targets=y", "data.transform=pkg.mod:fn"])
    assert with_transform.data.inputs == ["a", "y"]  # the transform decides what the model sees
