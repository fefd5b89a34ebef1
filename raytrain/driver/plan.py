"""``prepare(config) -> RunPlan``: everything that can fail on bad input, done on the driver before any
actor starts, and what the run then needs, by name.

The config's own checks are pure (every node builds a Config); the checks here read the driver's
machine: the data file, the model factory's module, the checkpoint directory and the checkpoint to
resume from. The stage cuts are planned here too, building the model only when the answer needs it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Optional

from raytrain import checkpoint, data
from raytrain.checkpoint.experiment import experiment_difference, model_difference
from raytrain.config import Config, check_shardable
from raytrain.config.layout import Layout
from raytrain.data import shards
from raytrain.data import text as text_data
from raytrain.data.shards import DataSource, Files
from raytrain.driver.connect import run_root
from raytrain.driver.loggers import check_loggers
from raytrain.models.user_code import import_user_module


@dataclass(frozen=True)
class RunPlan:
    """A checked run: what the driver, the coordinator and its workers are started with."""

    cfg: Config
    """The config with its defaults filled in: run.name and checkpoint.dir are set."""
    layout: Layout
    """The layout, with the model's layer count and each stage's layers."""
    source: DataSource
    """The files the run reads, each with its samples: data.path's (one file, or the sorted files of a
    directory, glob or list; the built-in corpus: built on this machine) and data.eval_path's."""
    num_samples: int
    """Training samples: the windows of the training files' token rows (or with data.text_column their
    text's packed rows), all files together, before those data.eval_fraction holds out."""
    resume: Optional[str]
    """The checkpoint to resume from, checked; None to start fresh."""
    held_out: int = 0
    """Held-out rows (data.eval_fraction's of the training files, or data.eval_path's); never trained on."""

    @property
    def run_dir(self) -> str:
        return os.path.join(os.path.abspath(os.path.expanduser(self.cfg.run.dir)), self.cfg.run.name)

    @property
    def stage_layers(self) -> list[list[list[int]]]:
        """Global layer indices of each model chunk of each pipeline worker, as the coordinator and the
        workers take them: ``stage_layers[stage]`` is one list per chunk (one chunk without virtual stages)."""
        return self.layout.worker_layers


def prepare(cfg: Config) -> RunPlan:
    """Check ``cfg`` against this machine and plan the run; a ValueError naming the key when it cannot run."""
    check_inputs(cfg)
    if cfg.model.hf is not None:
        from raytrain.models.hf_plan import check_tensor_parallel, resolve_cut, with_hf_architecture

        cfg = resolve_cut(with_hf_architecture(cfg))
        check_tensor_parallel(cfg)
    source = check_data(cfg)
    num_samples, held_out = split_held_out(cfg, source)
    layout = plan_layout(cfg)
    root = run_root(cfg.run.dir)  # under ~/raytrain in a Ray job: the job's working dir is temporary
    run_name = cfg.run.name or _new_run_name(root, layout)
    ckpt_dir = cfg.checkpoint.dir or os.path.join(root, run_name, "checkpoints")
    try:
        resume = _resume_source(cfg, root, ckpt_dir)
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
    )
    return RunPlan(cfg=cfg, layout=layout, source=source, num_samples=num_samples, resume=resume,
                   held_out=held_out)


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


def split_held_out(cfg: Config, source: DataSource) -> tuple[int, int]:
    """(training rows, held-out rows) of the run's data: data.eval_fraction holds out the training files'
    last rows, data.eval_path (checked like data.path) holds its own. A ValueError naming the keys when too
    few rows are left to train on, or (with eval.every) too few held out for eval.batches: an error, not a
    clamp, so that every evaluation reads exactly eval.batches x train.global_batch rows."""
    d, B, rows = cfg.data, cfg.train.global_batch, source.train.total
    if d.eval_path is not None:
        held = source.held_out.total
        where, fix = f"data.eval_path={d.eval_path!r} has {held} rows", "add rows to it"
    else:
        held = data.held_out_count(rows, d.eval_fraction)
        where = f"data.eval_fraction={d.eval_fraction:g} holds out the last {held} of the {rows} rows"
        fix = f"raise data.eval_fraction to >= {cfg.eval.batches * B / rows:.3g}"
        if rows - held < B:
            raise ValueError(f"{where}, leaving {rows - held} to train on, fewer than train.global_batch={B}; "
                             "lower data.eval_fraction, or use data.eval_path")
    need = cfg.eval.batches * B
    if cfg.eval.every and held < need:
        raise ValueError(f"{where}, fewer than the eval.batches={cfg.eval.batches} x train.global_batch={B} = "
                         f"{need} that each evaluation reads (it refuses rather than reading fewer); {fix}, "
                         "or lower eval.batches")
    return data.training_rows(cfg, rows), held


def check_data(cfg: Config) -> DataSource:
    """data.path's files and data.eval_path's, resolved (raytrain.data.shards) and each checked and counted
    (``check_files``)."""
    held = data.eval_files(cfg)
    return DataSource(check_files(cfg, data.data_files(cfg), "data.path"),
                      None if held is None else check_files(cfg, held, "data.eval_path"))


def check_files(cfg: Config, paths: list[str], key: str) -> Files:
    """Every file of a dataset (``key`` names it) checked and counted before any actor starts. Token data
    (data.column) needs only each Parquet footer where the column has a fixed width and statistics (the
    built-in corpus's form); otherwise each file's column is streamed (nulls, row lengths, ids) once per
    file version: the findings are remembered in data.cache_dir, so preparing the same files again reads
    footers. Text (data.text_column) is tokenised here, file by file into this machine's cache: its packed
    rows cannot be counted without the tokens (the sample order is a permutation of all of them). A bad
    file (not Parquet, wrong or missing column, empty) is named, with the fix; the training files together
    must fill a global batch."""
    B = cfg.train.global_batch
    if len(paths) == 1:
        return shards.one_file(paths[0], _check_data(cfg, paths[0], key, B if key == "data.path" else 0))
    spec = cfg.data.path if key == "data.path" else cfg.data.eval_path
    where = f"one of the {len(paths)} files {key}={spec!r} names: fix it or remove it from there"
    samples = []
    for path in paths:
        try:
            count = _check_data(cfg, path, key, 0)
        except ValueError as e:
            raise ValueError(f"{e} ({where})") from e
        if count == 0:
            raise ValueError(f"{key} file {path!r} is empty: it holds no samples ({where})")
        samples.append(count)
    total = sum(samples)
    if key == "data.path" and total < B:
        raise ValueError(f"{key}={spec!r}: its {len(paths)} files hold {total} samples (of model.seq_len + 1 = "
                         f"{cfg.model.seq_len + 1} tokens), fewer than train.global_batch={B}; add data, or lower "
                         "train.global_batch or model.seq_len")
    return Files(tuple(paths), tuple(samples))


def _check_data(cfg: Config, data_path: str, key: str, batch: int) -> int:
    """The samples in a file of the run's data (``key`` names it), checked: the windows of model.seq_len + 1
    tokens its token rows (data.column) are cut into, or text packed into such rows (data.text_column:
    tokenised here, into this machine's cache, to count them); at least ``batch`` of them."""
    m, d = cfg.model, cfg.data
    if d.text_column is not None:
        return text_data.check_text_dataset(data_path, d, m.seq_len, batch, m.vocab_size, key=key)
    if text_data.is_json_lines(data_path):
        raise ValueError(f"{key}={data_path!r} is JSON lines, read as text: set data.text_column to the key "
                         "holding the text and data.tokenizer to a directory holding tokenizer.json")
    return data.check_dataset(data_path, d.column, m.seq_len, batch, m.vocab_size, key=key, cache_dir=d.cache_dir)


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


def plan_layout(cfg: Config) -> Layout:
    """The configured layout with the model's layer count and stage cuts (parallel.split_points, else
    balanced by parallel.balance); a ValueError naming parallel.pp or parallel.split_points when the
    model cannot be cut so. Needs model.factory importable (``check_inputs``).

    The built-in GPT is built only to balance its cuts, so a run at pp=1 or with split_points keeps
    torch out of the driver; a model.factory is built to count its layers.
    """
    if cfg.model.hf is not None:
        return _hf_layout(cfg)
    if cfg.model.factory is None:
        layout = cfg.gpt_layout()
        if not layout.needs_cuts:
            return layout
        layers = _layers(cfg)
    else:
        layers = _layers(cfg)
        layout = Layout.of(cfg.parallel).for_model(len(layers), "model.factory")
        check_shardable(layout.fsdp, shardable_rows(layers), "model.factory's largest parameter (or it has a scalar)")
        _check_factory_plan(cfg, layers)
        if not layout.needs_cuts:
            return layout
    from raytrain.pipeline.partition import plan_cuts

    return dataclasses.replace(layout, cuts=tuple(plan_cuts(layers, layout.num_chunks, _timing_input(cfg))))


def _check_factory_plan(cfg: Config, layers: list) -> None:
    """parallel.tp > 1 needs the factory's layers to declare a plan their linears fit."""
    from raytrain.models.tensor_plan import plan_problem

    problem = plan_problem(layers, cfg.parallel.tp, cfg.parallel.sequence_parallel) if cfg.parallel.tp > 1 else None
    if problem is not None:
        raise ValueError(f"parallel.tp={cfg.parallel.tp}: model.factory={cfg.model.factory!r} cannot be split: "
                         f"{problem}. Declare tp_plan on its layers (README: Any model) or use parallel.fsdp")


def _hf_layout(cfg: Config) -> Layout:
    """A Hugging Face model's layout: cut by parameter counts of its meta-device layers (or timed)."""
    from raytrain.models.hf_plan import check_ties, hf_layout
    from raytrain.models.hf_weights import hf_layers
    from raytrain.pipeline.partition import plan_cuts

    _, layers = hf_layers(cfg.model.hf, cfg.model.hf_cut, cfg.model.trust_remote_code)
    layout = hf_layout(cfg, layers)
    check_shardable(layout.fsdp, shardable_rows(layers), "model.hf's largest parameter (or it has a scalar)")
    if layout.needs_cuts:
        if cfg.parallel.balance == "time":
            raise ValueError("parallel.balance=time builds the whole model on the driver to time its layers, which "
                             "model.hf does not do; use parallel.balance=params or parallel.split_points")
        layout = dataclasses.replace(layout, cuts=tuple(plan_cuts(layers, layout.num_chunks)))
    check_ties(cfg, layers, layout)
    return layout


def _layers(cfg: Config) -> list:
    """The model's layers: on the meta device when only the built-in GPT's parameter counts are wanted."""
    import torch

    from raytrain.models.layers import build_model

    if cfg.model.factory is None and cfg.parallel.balance == "params":
        with torch.device("meta"):
            return build_model(cfg.model, cfg.train.seed).layers
    return build_model(cfg.model, cfg.train.seed).layers


def shardable_rows(layers: list) -> int:
    """The most shards parallel.fsdp may cut these layers into: the rows (dim 0, what FSDP cuts) of the
    largest parameter, so every shard owns some; 1 when a parameter is a scalar, which FSDP cannot cut."""
    shapes = [p.shape for layer in layers for p in layer.parameters()]
    return 1 if any(len(shape) == 0 for shape in shapes) else max((shape[0] for shape in shapes), default=1)


def model_layers(cfg: Config) -> list:
    """The model's cuttable layers, for counting (on the meta device where raytrain builds them)."""
    import torch

    from raytrain.models.layers import build_model

    if cfg.model.hf is not None:
        from raytrain.models.hf_weights import hf_layers

        layers = hf_layers(cfg.model.hf, cfg.model.hf_cut, cfg.model.trust_remote_code)[1]
    elif cfg.model.factory is None:
        with torch.device("meta"):
            layers = build_model(cfg.model, cfg.train.seed).layers
    else:
        layers = build_model(cfg.model, cfg.train.seed).layers
    return layers


def _timing_input(cfg: Config):
    """One micro-batch of token ids to time the layers on (parallel.balance=time), else None."""
    if cfg.parallel.balance != "time":
        return None
    import torch

    layout = cfg.layout()
    micro_batch = max(1, cfg.train.global_batch // (layout.mesh.columns * layout.microbatches))
    return torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long)


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
    return resume


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
