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
import shutil
import time
from typing import Any, Callable, Optional

from raytrain import checkpoint, data
from raytrain.checkpoint.experiment import experiment_difference, model_difference
from raytrain.config import Config
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts, PreparedRun
from raytrain.data import identity, shards
from raytrain.driver.connect import run_root
from raytrain.driver.data_check import check_data, check_metrics, split_held_out
from raytrain.driver.loggers import check_loggers
from raytrain.driver.model_check import (build_model_once, check_model_takes_samples, check_ties, model_facts,
                                         needs_build, model_layout)
from raytrain.models.layers import FACTORY_RETURNS
from raytrain.models.user_code import API_MODEL, import_user_module, register_api_model

ChooseLayout = Callable[[Config, ModelFacts, list], Config]
"""(config, the model's facts, its layers) -> the config with the layout parallel.auto chose."""


def prepare(cfg: Config, choose_layout: Optional[ChooseLayout] = None, dataset: Any = None,
            eval_dataset: Any = None, model: Optional[Callable] = None) -> PreparedRun:
    """Check ``cfg`` against this machine and prepare the run; a ValueError naming the key when it cannot run.
    With parallel.auto, ``choose_layout`` picks the layout once the data and the model are checked.
    ``dataset``, ``eval_dataset``: the Python API's data objects (a map-style torch Dataset or a Ray
    Dataset); ``model``: its model function (model.factory's contract)."""
    cfg, model_code = _with_api_model(cfg, model)
    check_inputs(cfg)
    if cfg.model.hf is not None:
        from raytrain.models.hf_prepare import resolve_cut, with_hf_architecture

        cfg = resolve_cut(with_hf_architecture(cfg))
    checked = check_data(cfg, dataset, eval_dataset)
    num_samples, held_out = split_held_out(cfg, checked.source)
    check_metrics(cfg, checked.source.sample)
    spec = build_model_once(cfg) if needs_build(cfg) else None  # the one build of the model on the driver
    layers = None if spec is None else spec.layers
    facts = model_facts(cfg, layers)
    if cfg.parallel.auto:
        assert choose_layout is not None, "parallel.auto needs a layout chooser (raytrain.train passes one)"
        cfg = choose_layout(cfg, facts, layers)
    if cfg.model.hf is not None:
        from raytrain.models.hf_prepare import check_tensor_parallel

        check_tensor_parallel(cfg, layers)
    layout = model_layout(cfg, layers, checked.example)
    check_ties(cfg, facts, layout)
    source = checked.source
    if cfg.model.factory is not None:
        classes = check_model_takes_samples(cfg, layers, spec.loss_fn, checked.example(), layout,
                                            checked.target_range)
        source = dataclasses.replace(source, classes=classes)
    data_identity = identity.record(source, num_samples)
    cfg, resume = _name_run(cfg, layout, data_identity)
    return PreparedRun(cfg=cfg, layout=layout, source=source, num_samples=num_samples, model=facts,
                       resume=resume, held_out=held_out, model_code=model_code, data_identity=data_identity)


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


def _name_run(cfg: Config, layout: Layout, data_identity: dict) -> tuple[Config, Optional[str]]:
    """``cfg`` with run.dir, run.name and checkpoint.dir filled in (a new run directory claimed), the
    checkpoint to resume from, checked, and data.order_origin (``resumed_order``: ``data_identity`` is the
    run's data, raytrain.data.identity.record)."""
    root = run_root(cfg.run.dir)  # under ~/raytrain in a Ray job: the job's working dir is temporary
    run_name = cfg.run.name or _new_run_name(root, layout)
    ckpt_dir = cfg.checkpoint.dir or os.path.join(root, run_name, "checkpoints")
    try:
        resume = _resume_source(cfg, root, ckpt_dir)
        origin = resumed_order(cfg, resume, data_identity)
        _check_checkpoint_dir(cfg, ckpt_dir, resume)
        lineage = (resume and checkpoint.continued_lineage(resume)) or checkpoint.new_lineage()
    except ValueError:
        if cfg.run.name is None:  # the run that claimed this directory never starts: leave nothing behind
            remove_if_empty(os.path.join(root, run_name))
        raise
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=root, name=run_name),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=ckpt_dir, lineage=lineage),
        data=dataclasses.replace(cfg.data, order_origin=origin),
    )
    return cfg, resume


def resumed_order(cfg: Config, resume: Optional[str], data_identity: dict) -> list[int]:
    """data.order_origin for this run: [0, 0] when it starts afresh. A resume keeps its checkpoint's origin
    when the checkpoint's training data is ``data_identity``'s (raytrain.data.identity.change; a checkpoint
    that records none is not compared); with other data it restarts the order at the resumed step as a new
    epoch (data.new_epoch_on_change), or is refused, naming what changed and both fixes."""
    if resume is None:
        return list(data.NO_RESTART)
    manifest = checkpoint.read_manifest(resume)
    recorded = manifest.get("config")
    recorded_data = recorded.get("data") if isinstance(recorded, dict) else None
    origin = list((recorded_data or {}).get("order_origin", data.NO_RESTART))
    what = identity.change(manifest.get("data"), data_identity)
    if what is None:
        return origin
    step = manifest["step"]
    if not cfg.data.new_epoch_on_change:
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r} ({resume}): the training data changed since "
                         f"that checkpoint: {what}; going on with its epoch would repeat some samples and skip others: "
                         f"restore the data, or set data.new_epoch_on_change=true to train on the new data from step "
                         f"{step} as a new epoch")
    seen = manifest.get("samples_seen", step * cfg.train.global_batch)
    return [step * cfg.train.global_batch, data.next_epoch(origin, manifest["data"]["num_samples"], seen)]


def _check_checkpoint_dir(cfg: Config, ckpt_dir: str, resume: Optional[str]) -> None:
    """checkpoint.dir takes files, and holds no other run's checkpoints unless this run resumes one of them: a
    fresh run beside them would prune them (checkpoint.keep), and its ``latest`` would mix two runs."""
    try:
        checkpoint.check_writable(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"checkpoint.dir={ckpt_dir!r}: {e}; point checkpoint.dir at a writable directory or a "
                         f"pyarrow.fs URI (s3://, gs://, hdfs://) whose credentials this machine has") from e
    published = checkpoint.list_published(ckpt_dir)
    if not published or (resume is not None and _same_dir(resume.rstrip("/").rsplit("/", 1)[0], ckpt_dir)):
        return
    default = "" if cfg.checkpoint.dir else f" (run.name={cfg.run.name!r}'s default)"
    raise ValueError(
        f"checkpoint.dir={ckpt_dir!r}{default} holds {len(published)} checkpoint(s) of another run (the newest: "
        f"{published[-1].uri}, step {published[-1].step}), which this run would not resume but prune "
        f"(checkpoint.keep={cfg.checkpoint.keep}); continue that run with checkpoint.resume=latest, or give this "
        f"run a new checkpoint.dir" + (" (or run.name)" if default else ""))


def _same_dir(a: str, b: str) -> bool:
    """Whether two paths or URIs name one directory."""
    (fs_a, path_a), (fs_b, path_b) = checkpoint.filesystem(a), checkpoint.filesystem(b)
    return fs_a.type_name == fs_b.type_name and path_a.rstrip("/") == path_b.rstrip("/")


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
    """What the config names on this machine: data.path's entries name regular files, data.eval_path's too and
    none of data.path's (nothing opened: listings and stats), data.cache_dir takes files,
    model.factory, data.factory and data.transform import and name functions (what they return is checked
    when prepare calls them)."""
    if cfg.model.options and cfg.model.factory is None:  # the Python API's model= is model.factory by now
        raise ValueError(f"model.options={cfg.model.options}: they are the model function's settings (model.factory, "
                         "or raytrain.train(model=...)): give one, or unset them")
    # every entry names a file: listings only, nothing read
    train = None if cfg.data.path is None else shards.resolve(cfg.data.path, "data.path")
    if cfg.model.hf is not None and not os.path.isdir(os.path.expanduser(cfg.model.hf)):
        raise ValueError(f"model.hf={cfg.model.hf!r}: no such directory; point it at a local Hugging Face model "
                         "directory (config.json, and *.safetensors for pretrained weights)")
    if cfg.data.eval_path is not None:
        held = shards.resolve(cfg.data.eval_path, "data.eval_path")
        if train is not None:
            shards.check_held_out_apart(train, held)
    data.check_cache_dir(cfg.data.cache_dir)
    check_loggers(cfg.run.loggers)
    _check_compiler(cfg)
    for key in ("model.factory", "data.factory", "data.transform"):
        section, field = key.split(".")
        _check_function(key, getattr(getattr(cfg, section), field))


CXX_COMPILERS = ("g++", "clang++", "c++")
"""What torch.compile's Inductor looks for, after $CXX, to build its C++ kernels on CPU."""


def _check_compiler(cfg: Config) -> None:
    """train.compile on CPU needs a C++ compiler (Inductor builds C++ kernels; on GPUs it writes Triton)."""
    if not cfg.train.compile or cfg.resources.use_gpu:
        return
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else list(CXX_COMPILERS)
    if not any(shutil.which(c) for c in candidates):
        raise ValueError(f"train.compile=true: a CPU run needs a C++ compiler (torch.compile's Inductor builds C++ "
                         f"kernels) and none of {', '.join(candidates)} is on PATH: install one (apt-get install g++), "
                         "point $CXX at one, or set train.compile=false")


def _check_function(key: str, spec: Optional[str]) -> None:
    """``spec`` (``pkg.module:fn``, the value of ``key``) imports and names a function, when set."""
    if spec is None:
        return
    module_name, _, fn_name = spec.partition(":")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} ({e})") from e
    if not callable(getattr(module, fn_name, None)):
        raise ValueError(f"{key}={spec!r}: module {module_name!r} has no function {fn_name!r}")


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
    file's size and sha256, each a weights-only torch file), so a damaged one fails before any actor starts;
    a checkpoint of another model (a ``model.*`` key that decides its parameters differs) is refused too.

    ``latest`` means checkpoint.dir's latest when checkpoint.dir (or run.name) is set; else the checkpoint
    published last by any run under run.dir (each run has its own default checkpoint directory). Either way
    only a checkpoint of this experiment (``experiment_difference``: the same model and data) is taken, or a
    ValueError says why none is.
    """
    if cfg.checkpoint.resume is None:
        return None
    import_user_module("torch")  # verify loads torch: after the driver's background import of it, never beside it
    key = f"checkpoint.resume={cfg.checkpoint.resume!r}"
    try:
        resume = (_latest_of_this_experiment(cfg, root, ckpt_dir) if cfg.checkpoint.resume == "latest"
                  else checkpoint.resolve(cfg.checkpoint.resume))
        manifest = checkpoint.verify(resume)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"{key}: {e}; point it at another step_NNNNNNNN directory or a checkpoint.dir that holds "
                         "one, or drop it to start afresh") from e
    if manifest["step"] >= cfg.train.steps:
        raise ValueError(f"{key} ({resume}) is at step {manifest['step']}, not before train.steps={cfg.train.steps}; "
                         "raise train.steps to train further")
    other_model = model_difference(cfg, manifest.get("config"))
    if other_model is not None:
        raise ValueError(f"{key} ({resume}) holds another model: {other_model}; a checkpoint resumes only into "
                         f"the model it was saved from: set {other_model.key}={other_model.there!r}, or drop "
                         "checkpoint.resume to start afresh")
    _check_same_batch(cfg, key, resume, manifest.get("config"))
    return resume


def _check_same_batch(cfg: Config, key: str, resume: str, recorded: Any) -> None:
    """A resume keeps train.global_batch: step s consumes sample positions [sB, (s+1)B), so another B would
    skip or repeat samples of the epoch (an old checkpoint without a recorded config is not checked)."""
    saved = recorded.get("train", {}).get("global_batch") if isinstance(recorded, dict) else None
    if isinstance(saved, int) and saved != cfg.train.global_batch:
        raise ValueError(f"{key} ({resume}) was trained with train.global_batch={saved}, this run asks for "
                         f"{cfg.train.global_batch}: step s reads samples [s x B, (s+1) x B) of the order, so another "
                         f"batch would skip or repeat samples of the epoch; set train.global_batch={saved}")


def _latest_of_this_experiment(cfg: Config, root: str, ckpt_dir: str) -> str:
    """``checkpoint.resume=latest``: the newest checkpoint of this experiment where ``_resume_source`` looks;
    a CheckpointError when there is none at all, a ValueError naming what differs when none is of it."""
    if cfg.checkpoint.dir or cfg.run.name:
        where, newest = f"checkpoint.dir={ckpt_dir!r}", [checkpoint.resolve(ckpt_dir)]
    else:
        where, newest = f"run.dir={root!r}", _run_checkpoints_newest_first(root) or [checkpoint.resolve(ckpt_dir)]
    skipped = []
    for candidate in newest:
        difference = experiment_difference(cfg, checkpoint.read_manifest(candidate).get("config"))
        if difference is None:
            return candidate
        skipped.append(f"{candidate} has {difference}")
    shown = "; ".join(skipped[:3]) + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    raise ValueError(f"checkpoint.resume='latest': no checkpoint under {where} is of this experiment (the same "
                     f"model and data): {shown}; to continue one anyway name it (checkpoint.resume=<its path>), or "
                     "drop checkpoint.resume to start afresh")


def _run_checkpoints_newest_first(root: str) -> list[str]:
    """The latest checkpoint of each run under ``<root>/*/checkpoints``, the one published last first (by
    its manifest's time)."""
    found = []
    for run in os.scandir(root) if os.path.isdir(root) else []:
        latest = checkpoint.latest(os.path.join(run.path, "checkpoints")) if run.is_dir() else None
        if latest is not None:
            found.append((os.path.getmtime(os.path.join(latest, checkpoint.MANIFEST)), latest))
    return [path for _, path in sorted(found, reverse=True)]
