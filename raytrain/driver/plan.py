"""``prepare(config) -> PreparedRun``: everything that can fail on bad input, done on the driver before any
actor starts, and what the run then needs, as one frozen value (raytrain.config.prepared).

The config's own checks are pure (every node builds a Config); the checks here read the driver's
machine: the data (raytrain.driver.data_check), the model, built once (raytrain.driver.model_check), the
checkpoint directory and the checkpoint to resume from. With parallel.auto the layout is chosen between
the two, on the same checked data and model.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional

from raytrain import checkpoint, data
from raytrain.config import Config
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts, PreparedRun
from raytrain.data import shards
from raytrain.driver.connect import run_root
from raytrain.driver.data_check import check_data, split_held_out
from raytrain.driver.loggers import check_loggers
from raytrain.driver.model_check import (build_model_once, check_model_takes_samples, model_facts, needs_build,
                                         plan_layout)
from raytrain.models.layers import FACTORY_RETURNS
from raytrain.models.user_code import API_MODEL, import_user_module, register_api_model

ChooseLayout = Callable[[Config, ModelFacts, list], Config]
"""(config, the model's facts, its layers) -> the config with the layout parallel.auto chose."""


def prepare(cfg: Config, choose_layout: Optional[ChooseLayout] = None, dataset: Any = None,
            eval_dataset: Any = None, model: Optional[Callable] = None) -> PreparedRun:
    """Check ``cfg`` against this machine and plan the run; a ValueError naming the key when it cannot run.
    With parallel.auto, ``choose_layout`` picks the layout once the data and the model are checked.
    ``dataset``, ``eval_dataset``: the Python API's data objects (a map-style torch Dataset or a Ray
    Dataset); ``model``: its model function (model.factory's contract)."""
    cfg, model_code = _with_api_model(cfg, model)
    check_inputs(cfg)
    if cfg.model.hf is not None:
        from raytrain.models.hf_plan import resolve_cut, with_hf_architecture

        cfg = resolve_cut(with_hf_architecture(cfg))
    checked = check_data(cfg, dataset, eval_dataset)
    num_samples, held_out = split_held_out(cfg, checked.source)
    spec = build_model_once(cfg) if needs_build(cfg) else None  # the one build of the model on the driver
    layers = None if spec is None else spec.layers
    facts = model_facts(cfg, layers)
    if cfg.parallel.auto:
        assert choose_layout is not None, "parallel.auto needs a layout chooser (raytrain.train passes one)"
        cfg = choose_layout(cfg, facts, layers)
    if cfg.model.hf is not None:
        from raytrain.models.hf_plan import check_tensor_parallel

        check_tensor_parallel(cfg, layers)
    layout = plan_layout(cfg, layers, checked.example)
    if cfg.model.factory is not None:
        check_model_takes_samples(cfg, layers, spec.loss_fn, checked.example(), layout, checked.target_range)
    cfg, resume = _name_run(cfg, layout)
    return PreparedRun(cfg=cfg, layout=layout, source=checked.source, num_samples=num_samples, model=facts,
                       resume=resume, held_out=held_out, model_code=model_code)


def _with_api_model(cfg: Config, model: Optional[Callable]) -> tuple[Config, Optional[bytes]]:
    """``cfg`` building the Python API's ``model`` function (registered in this process; pickled for the
    workers), or as it is when there is none."""
    if model is None:
        return cfg, None
    if cfg.model.factory is not None or cfg.model.hf is not None:
        raise ValueError("raytrain.train(model=...) and model.factory / model.hf both name the model: drop one")
    if not callable(model):
        raise ValueError(f"raytrain.train(model=...) is {type(model).__name__}; give a function of the model config "
                         f"returning {FACTORY_RETURNS}")
    from ray import cloudpickle

    try:
        code = cloudpickle.dumps(model)
    except Exception as e:  # noqa: BLE001 -- the workers cannot have it
        raise ValueError(f"raytrain.train(model=...) cannot be pickled for the workers: {type(e).__name__}: {e}") from e
    register_api_model(model)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, factory=API_MODEL)), code


def _name_run(cfg: Config, layout: Layout) -> tuple[Config, Optional[str]]:
    """``cfg`` with run.dir, run.name and checkpoint.dir filled in (a new run directory claimed), and the
    checkpoint to resume from, checked."""
    root = run_root(cfg.run.dir)  # under ~/raytrain in a Ray job: the job's working dir is temporary
    run_name = cfg.run.name or _new_run_name(root, layout)
    ckpt_dir = cfg.checkpoint.dir or os.path.join(root, run_name, "checkpoints")
    try:
        resume = _resume_source(cfg, root, ckpt_dir)
        _check_checkpoint_dir(ckpt_dir)
    except ValueError:
        if cfg.run.name is None:  # the run that claimed this directory never starts: leave nothing behind
            remove_if_empty(os.path.join(root, run_name))
        raise
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=root, name=run_name),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=ckpt_dir),
    )
    return cfg, resume


def _check_checkpoint_dir(ckpt_dir: str) -> None:
    try:
        checkpoint.check_writable(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.dir={ckpt_dir!r}: {e}; point checkpoint.dir at a writable directory or a "
                         f"pyarrow.fs URI (s3://, gs://, hdfs://) whose credentials this machine has") from e


def remove_if_empty(run_dir: str) -> None:
    """Remove a run directory that holds nothing but an empty checkpoints directory."""
    for path in (os.path.join(run_dir, "checkpoints"), run_dir):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:
            return  # not empty: keep it


def check_inputs(cfg: Config) -> None:
    """What the config names on this machine: data.path's entries name files, data.cache_dir takes files,
    model.factory imports and has its function (what it returns is checked when plan_layout builds it)."""
    if cfg.data.path is not None:
        shards.resolve(cfg.data.path, "data.path")  # every entry names a file: listings only, nothing read
    if cfg.model.hf is not None and not os.path.isdir(os.path.expanduser(cfg.model.hf)):
        raise ValueError(f"model.hf={cfg.model.hf!r}: no such directory; point it at a local Hugging Face model "
                         "directory (config.json, and *.safetensors for pretrained weights)")
    if cfg.data.eval_path is not None:
        shards.resolve(cfg.data.eval_path, "data.eval_path")
    data.check_cache_dir(cfg.data.cache_dir)
    check_loggers(cfg.run.loggers)
    if cfg.model.factory is None:
        return
    module_name, _, fn_name = cfg.model.factory.partition(":")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise ValueError(f"model.factory={cfg.model.factory!r}: cannot import module {module_name!r} ({e})") from e
    if not callable(getattr(module, fn_name, None)):
        raise ValueError(f"model.factory={cfg.model.factory!r}: module {module_name!r} has no function {fn_name!r}")


def _new_run_name(root: str, layout: Layout) -> str:
    """A timestamp and the layout, with a suffix when a run of the same second already has it.

    The directory is created here with ``os.mkdir``, which fails for all but one of two runs that
    pick the same name at once: each run gets a directory of its own, never a shared one.
    """
    os.makedirs(root, exist_ok=True)
    base = time.strftime("%Y%m%d-%H%M%S-") + layout.label.replace(" ", "_").replace("=", "")
    name, n = base, 1
    while True:
        try:
            os.mkdir(os.path.join(root, name))
            return name
        except FileExistsError:
            n += 1
            name = f"{base}-{n}"


def _resume_source(cfg: Config, root: str, ckpt_dir: str) -> Optional[str]:
    """The checkpoint ``checkpoint.resume`` names, checked; None when not resuming. Checked whole here (every
    file's size and sha256, each a weights-only torch file), so a damaged one fails before any actor starts.

    ``latest`` means checkpoint.dir's latest when checkpoint.dir is set; else the checkpoint published
    last by any run under run.dir (each run has its own default checkpoint directory).
    """
    if cfg.checkpoint.resume is None:
        return None
    where = cfg.checkpoint.resume
    if where == "latest":
        where = ckpt_dir if cfg.checkpoint.dir or cfg.run.name else _newest_run_checkpoint(root) or ckpt_dir
    import_user_module("torch")  # verify loads torch: after the driver's background import of it, never beside it
    try:
        resume = checkpoint.resolve(where)
        manifest = checkpoint.verify(resume)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}; point it at another step_NNNNNNNN "
                         f"directory or a checkpoint.dir that holds one, or drop it to start afresh") from e
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume!r} ({resume}) is at step {manifest['step']}, not before "
            f"train.steps={cfg.train.steps}; raise train.steps to train further"
        )
    return resume


def _newest_run_checkpoint(root: str) -> Optional[str]:
    """The checkpoint published last under ``<root>/*/checkpoints`` (by its manifest's time)."""
    newest, newest_time = None, -1.0
    for run in os.scandir(root) if os.path.isdir(root) else []:
        found = checkpoint.latest(os.path.join(run.path, "checkpoints")) if run.is_dir() else None
        if found is not None:
            published = os.path.getmtime(os.path.join(found, checkpoint.MANIFEST))
            if published > newest_time:
                newest, newest_time = found, published
    return newest

