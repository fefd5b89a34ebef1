"""The run configuration's schema: one dataclass per section, each field a public, documented key
(``section.field``), checked in ``__post_init__``.

Every check raises one form of error, ``key=value: fix`` (raytrain.config.errors.require). The checks are pure
(no disk, no imports of user code): every node builds a Config, and what only the driver's machine
can answer (data.path exists, model.factory imports) is checked once, by ``raytrain.driver.prepare.prepare``.
YAML files and ``--set`` overrides are read by raytrain.config.loader.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from raytrain.config.errors import require
from raytrain.config.faults import Fault
from raytrain.config.layout import Layout
from raytrain.pipeline.schedule import SCHEDULES, V_SCHEDULES

LR_SCHEDULES = ("constant", "cosine", "linear")
BALANCE_MODES = ("params", "time")
MAX_SEED = 2**32 - 1
"""Largest train.seed: layer seeds are seed * 100_003 + layer, and torch.manual_seed takes at most 64 bits."""


def _blank(text: Optional[str]) -> bool:
    """An empty or all-space string: a path or name given as '' (None, unset, is not blank)."""
    return text is not None and not text.strip()


HF_CUTS = ("auto", "layers", "whole")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    n_layer: int = 4
    """Transformer blocks in the built-in GPT."""
    d_model: int = 128
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 64
    """Tokens per sample (the data holds seq_len + 1 to form next-token targets)."""
    vocab_size: int = 256
    """Vocabulary size; the built-in corpus is bytes, so 256."""
    factory: Optional[str] = None
    """Optional ``module:function`` returning a user model (see raytrain.models.layers.build_model)."""
    options: dict = field(default_factory=dict)
    """model.factory's own settings (widths, depths, ...), read by the factory from the config it is given
    (``model_cfg.options["hidden"]``); raytrain only carries them."""
    hf: Optional[str] = None
    """A local Hugging Face causal-LM directory (config.json, safetensors if pretrained); its config sets
    the architecture, so n_layer, d_model, n_head and vocab_size are read from it."""
    hf_cut: str = "auto"
    """How model.hf becomes pipeline layers: ``layers`` (embedding, decoder layers, norm + head),
    ``whole`` (one layer: data parallel only), ``auto`` (layers if they reproduce the model's own
    forward on a two-layer copy, checked before the run starts; else whole)."""
    trust_remote_code: bool = False
    """Run the Python files a model.hf directory's config.json names in ``auto_map`` (transformers'
    custom code). Off: such a directory is refused before anything starts, since it is code, not data."""

    def __post_init__(self):
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size"):
            value = getattr(self, name)
            require(value >= 1, f"model.{name}", value, "use >= 1")
        require(self.d_model % self.n_head == 0, "model.d_model", self.d_model,
                f"not divisible by model.n_head={self.n_head}; pick a model.n_head that divides it")
        require(self.hf is None or self.factory is None, "model.hf", self.hf,
                "set model.hf or model.factory, not both")
        require(self.hf_cut in HF_CUTS, "model.hf_cut", self.hf_cut, f"use one of {', '.join(HF_CUTS)}")
        require(self.hf is None or (isinstance(self.hf, str) and self.hf.strip() != ""), "model.hf", self.hf,
                "give a directory path")
        require(isinstance(self.options, dict) and all(isinstance(k, str) for k in self.options), "model.options",
                self.options, "a mapping of names to values, read by model.factory")
        if self.factory is not None:
            module, _, function = self.factory.partition(":")
            require(all(p.isidentifier() for p in module.split(".")) and function.isidentifier(), "model.factory",
                    self.factory, "write it as 'package.module:function', with importable names")

    @property
    def gpt_layers(self) -> int:
        """Cuttable layers of the built-in GPT: the embedding, model.n_layer blocks and the head."""
        return self.n_layer + 2


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run in total (a resumed run counts the steps already done)."""
    global_batch: int = 8
    """Samples per optimizer step, whatever the layout: dp and micro-batches only divide it."""
    lr: float = 3e-4
    """AdamW learning rate (0: the parameters stay as they are)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_eps: float = 1e-8
    """AdamW's eps, added to the root of the second moment: an update is lr * m / (sqrt(v) + eps).
    Larger (1e-6 .. 1e-5) damps the steps of parameters whose gradients are tiny, as bf16 runs often want."""
    fused_optimizer: bool = True
    """AdamW's fused kernel: one pass over each parameter instead of a chain of tensor ops (on CPU
    its step is 3-6x faster). The same update up to float rounding; false uses torch's default."""
    seed: int = 0
    """Seeds the model initialisation and the sample order."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    lr_schedule: str = "constant"
    """After the warm-up: constant at train.lr, or cosine / linear decay to train.min_lr at train.steps."""
    warmup_steps: int = 0
    """Steps of linear warm-up from train.lr / warmup_steps to train.lr."""
    min_lr: float = 0.0
    """Where cosine and linear decay end."""
    activation_checkpointing: bool = False
    """Keep only each layer's input in forward and recompute the layer in backward (torch's
    non-reentrant checkpoint): the same parameters for less activation memory and more compute."""
    compile: bool = False
    """Compile each layer with torch.compile (nn.Module.compile: names, hooks and checkpoints unchanged), after
    activation checkpointing and before FSDP2 or tensor parallelism wrap it (torchtitan's order); every stage
    chunk under pp; not with a schedule that splits backwards (zbv, dualpipev, parallel.split_backward). The
    first step's compile time is start-up badput. On CPU it needs a C++ compiler."""
    skip_nonfinite: int = 0
    """Steps whose loss or gradient norm is not finite that the run may skip (not apply) before it
    stops; 0 stops at the first, naming the step and the last good checkpoint."""

    def __post_init__(self):
        require(self.steps >= 1, "train.steps", self.steps, "use >= 1")
        require(self.global_batch >= 1, "train.global_batch", self.global_batch, "use >= 1")
        require(self.lr >= 0, "train.lr", self.lr, "use >= 0 (0 changes nothing: a dry run, or an export round trip)")
        require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "use >= 0 (0 turns clipping off)")
        require(self.skip_nonfinite >= 0, "train.skip_nonfinite", self.skip_nonfinite,
                "use >= 0 (0 stops at the first non-finite step)")
        require(self.lr_schedule in LR_SCHEDULES, "train.lr_schedule", self.lr_schedule,
                f"use one of {', '.join(LR_SCHEDULES)}")
        require(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "use >= 0 (0: no warm-up)")
        require(0 <= self.min_lr <= self.lr, "train.min_lr", self.min_lr, f"use 0..train.lr ({self.lr:g})")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "AdamW needs >= 0 (0: no decay)")
        require(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "AdamW needs > 0 (its default: 1e-8)")
        require(0 <= self.seed <= MAX_SEED, "train.seed", self.seed, "use an integer in 0..2**32-1")


@dataclass
class ParallelConfig:
    dp: int = 1
    """Data-parallel replicas (each fsdp x tp x pp worker actors)."""
    fsdp: int = 1
    """Workers that shard one replica's parameters, gradients and optimizer state (FSDP2; HSDP with dp > 1)."""
    tp: int = 1
    """Workers that split each transformer block of a stage (tensor parallelism: attention heads and MLP
    columns, by each layer's tp plan; with fsdp, FSDP2 shards the tp parts). Its group talks on every
    layer, so it is placed on one node."""
    pp: int = 1
    """Pipeline stages the model is cut into."""
    microbatches: int = 1
    """Micro-batches each replica splits its share of the global batch into."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (virtual_stages >= 2, microbatches a multiple of pp),
    zbv (zero-bubble V: virtual_stages = 2, backwards always split) or dualpipev (virtual_stages = 2,
    microbatches >= 2 pp, only its warm-up's and cool-down's backwards split)."""
    virtual_stages: int = 1
    """Model chunks each pipeline worker holds (stages pp apart, or the V's): the chunked schedules' smaller
    bubble, for more and smaller messages and more activations held."""
    sequence_parallel: bool = False
    """With parallel.tp: between its split linears each tp rank holds seq_len / tp of the tokens (norms and
    residuals on them; all-gathers and reduce-scatters instead of all-reduces: raytrain.models.tensor_plan).
    Off by default: on CPU workers over gloo it measured slower and no smaller (experiments/RESULTS.md)."""
    split_backward: bool = False
    """Stages after the first send their input gradient before computing weight gradients (W actions):
    a shorter cool-down per step for more memory and per-layer autograd overhead (experiments/RESULTS.md)."""
    split_points: Optional[list] = None
    """Hand-set cuts: indices of the first layer of stages 1..pp-1, or of chunks 1..pp x virtual_stages - 1
    (overrides balance)."""
    balance: str = "params"
    """How to cut the layers when split_points is not set: params or time."""
    auto: bool = False
    """Probe the feasible layouts with short Tune trials, then train with the fastest (raytrain.tune.autolayout)."""
    auto_steps: int = 6
    """Steps per probe trial (the first is warm-up and not timed)."""
    auto_max_workers: Optional[int] = None
    """Workers a probed layout may use (default: every CPU slot or GPU of the cluster)."""
    auto_microbatches: list = field(default_factory=lambda: [2, 4, 8])
    """Micro-batch counts probed for pipeline layouts."""
    auto_schedules: list = field(default_factory=lambda: ["1f1b"])
    """Schedules probed for pipeline layouts (1F1B has GPipe's bubble with less memory)."""

    def __post_init__(self):
        for name in ("dp", "fsdp", "tp", "pp", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            require(value >= 1, f"parallel.{name}", value, "use >= 1")
        require(self.schedule in SCHEDULES, "parallel.schedule", self.schedule,
                f"unknown; use one of {', '.join(SCHEDULES)}")
        require(self.balance in BALANCE_MODES, "parallel.balance", self.balance,
                f"unknown; use one of {', '.join(BALANCE_MODES)}")
        self._check_virtual_stages()
        if self.split_points is not None:
            self._check_split_points()
        require(self.tp == 1 or not self.auto, "parallel.auto", True,
                "chooses parallel.tp itself among its candidates: leave parallel.tp=1")
        require(not (self.auto and self.split_points is not None), "parallel.auto", True,
                "it chooses pp, so parallel.split_points cannot be set; drop one of them")
        self._check_auto()

    def _check_virtual_stages(self):
        """Which schedules take several chunks per worker, and what each needs."""
        v, chunked = self.virtual_stages, self.schedule in ("interleaved_1f1b", *V_SCHEDULES)
        require(v == 1 or self.pp > 1, "parallel.virtual_stages", v,
                "chunks are pipeline stages of one worker: set parallel.pp > 1, or leave virtual_stages at 1")
        if self.pp == 1:
            return
        require(chunked or v == 1, "parallel.virtual_stages", v,
                f"parallel.schedule={self.schedule} runs one chunk per worker: use interleaved_1f1b, zbv or dualpipev, "
                "or leave virtual_stages at 1")
        require(self.schedule != "interleaved_1f1b" or v >= 2, "parallel.virtual_stages", v,
                "interleaved_1f1b needs >= 2 chunks per worker (with 1 it is 1f1b): set virtual_stages=2")
        require(self.schedule not in V_SCHEDULES or v == 2, "parallel.virtual_stages", v,
                f"{self.schedule} puts exactly 2 chunks on each worker (the V): set virtual_stages=2")
        require(self.schedule != "interleaved_1f1b" or self.microbatches % self.pp == 0, "parallel.microbatches",
                self.microbatches, f"interleaved_1f1b runs micro-batches in rounds of parallel.pp={self.pp}: use a "
                f"multiple of {self.pp}")
        require(self.schedule != "dualpipev" or self.microbatches >= 2 * self.pp, "parallel.microbatches",
                self.microbatches, f"dualpipev fills its V with at least 2 x parallel.pp = {2 * self.pp} micro-batches: "
                f"use >= {2 * self.pp}, or parallel.schedule=zbv")

    def _check_split_points(self):
        """Hand-set cuts: pp x virtual_stages - 1 layer indices, strictly increasing (their range needs the
        model: Layout.for_model)."""
        cuts, chunks = self.split_points, self.pp * self.virtual_stages
        require(all(_is_int(c) for c in cuts), "parallel.split_points", cuts,
                "cuts are layer indices: use a list of integers like [2, 4]")
        require(len(cuts) == chunks - 1, "parallel.split_points", cuts,
                f"{len(cuts)} cuts, but parallel.pp={self.pp}" + (f" x virtual_stages={self.virtual_stages}"
                                                                   if self.virtual_stages > 1 else "")
                + f" needs {chunks - 1}")
        require(list(cuts) == sorted(set(cuts)), "parallel.split_points", cuts, "cuts must be strictly increasing")

    def _check_auto(self):
        """The probe settings, checked whether or not parallel.auto is on: a bad value is bad either way."""
        require(self.auto_steps >= 2, "parallel.auto_steps", self.auto_steps,
                "a probe needs >= 2 steps (the first is warm-up)")
        require(bool(self.auto_schedules) and all(s in SCHEDULES for s in self.auto_schedules),
                "parallel.auto_schedules", self.auto_schedules, f"use a non-empty list of {', '.join(SCHEDULES)}")
        require(bool(self.auto_microbatches) and all(_is_int(m) and m >= 1 for m in self.auto_microbatches),
                "parallel.auto_microbatches", self.auto_microbatches, "use a list of integers >= 1")
        require(self.auto_max_workers is None or self.auto_max_workers >= 1, "parallel.auto_max_workers",
                self.auto_max_workers, "a probed layout needs >= 1 worker; unset it to use the whole cluster")


@dataclass
class DataConfig:
    path: Union[str, list, None] = None
    """Parquet file with a token column (or text: see data.text_column, which also reads JSON lines), or many:
    a directory, a glob, or a list of those, local or pyarrow.fs URIs (raytrain.data.shards: sorted by path,
    concatenated); unset uses the built-in corpus (Python stdlib source, bytes). The files are listed and
    checked on the driver's machine, by raytrain.driver.prepare.prepare; workers read them (and data.tokenizer)
    at the same paths, each file when the sample order first reaches it."""
    column: str = "tokens"
    """Name of the token column in data.path (list<int> or bytes); each row needs >= seq_len + 1 tokens."""
    cache_dir: str = "~/.cache/raytrain"
    """Where the built-in corpus is built once, and where each machine keeps decoded token rows (decoded/)."""
    max_bytes: int = 8_000_000
    """Cap on the source bytes read into the built-in corpus."""
    text_column: Optional[str] = None
    """Raw text instead of token ids: the string column of a Parquet data.path, or the key of each line of a
    JSON lines data.path (``.jsonl``/``.json``). Tokenised with data.tokenizer once per machine and packed
    into rows of seq_len + 1 tokens (raytrain.data.text); data.column is then unused."""
    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer directory holding ``tokenizer.json``, used with data.text_column only."""
    eval_fraction: float = 0.0
    """Hold out the last floor(rows x eval_fraction) rows of the data for the held-out loss (eval.every):
    they are never trained on (the sample order covers only the rows before them). 0: none."""
    eval_path: Union[str, list, None] = None
    """Held-out rows in the data's format (token column, or text with data.text_column) instead of
    data.eval_fraction: a file, a directory, a glob or a list, as data.path; checked like data.path."""
    builtin: str = "stdlib"
    """The data when data.path is unset: ``stdlib`` (Python's standard library source as bytes, cut into token
    windows) or ``digits`` (scikit-learn's 1797 handwritten digits, shipped with raytrain: 8 x 8 pixels
    scaled to [0, 1] as 64 floats in column ``pixels``, the digit 0-9 in column ``digit``)."""
    inputs: Union[str, list, None] = None
    """Samples of any shape instead of token windows: the column of data.path (or of a Ray Dataset) holding
    each sample's inputs (a number, a fixed-size list, a fixed_shape_tensor; binary with data.transform), or
    a list of numeric columns stacked into one float vector, which must not hold data.targets' column
    unless data.transform picks the inputs (one column as both, an autoencoder's, is allowed). Needs
    data.targets."""
    targets: Optional[str] = None
    """With data.inputs: the column holding each sample's target (integer class ids, a float, a fixed-size
    list of floats)."""
    transform: Optional[str] = None
    """``pkg.module:fn`` run on the worker over a batch of rows: ``fn(columns, seeds, training) -> (inputs,
    targets)``, ``columns`` a dict of the data.inputs and data.targets columns' arrays (an object array of
    bytes for a binary column); ``seeds``, one per row, for its randomness (``training`` false for held-out
    rows). It may take just ``columns``, or ``columns, seeds``."""
    factory: Optional[str] = None
    """``pkg.module:fn`` returning the training data as a map-style ``torch.utils.data.Dataset`` (index ->
    (inputs, target)) or a Ray Dataset (``ray.data.Dataset``, read through data.inputs and data.targets), or
    a pair (train, held_out) of them; called on the driver with this data config. Instead of data.path."""
    new_epoch_on_change: bool = False
    """A resume whose training data changed since its checkpoint (a file added, removed, resized or rewritten:
    each manifest records the files, their samples and content fingerprints): false refuses it, naming the
    file; true trains on the new data from the resumed step as a new epoch (each of its samples once in it),
    instead of going on with the checkpoint's epoch, whose sample numbers the change moved."""
    order_origin: list = field(default_factory=lambda: [0, 0])
    """Set by raytrain (prepare replaces a value given): [position, epoch], where the sample order restarted as
    a new epoch (a resume that took changed data: data.new_epoch_on_change); [0, 0] when it never did.
    Recorded in each manifest's config, so later resumes keep it (raytrain.data.order)."""

    def __post_init__(self):
        if self.builtin == "digits" and self.path is None and self.factory is None:
            self.inputs = "pixels" if self.inputs is None else self.inputs
            self.targets = "digit" if self.targets is None else self.targets
        require(not _blank(self.column), "data.column", self.column, "name the token column of data.path")
        _check_paths("data.path", self.path)
        self._check_samples()
        require(not _blank(self.cache_dir), "data.cache_dir", self.cache_dir,
                "give a directory (default ~/.cache/raytrain)")
        require(self.max_bytes >= 1, "data.max_bytes", self.max_bytes, "the built-in corpus needs >= 1 byte")
        self._check_text()
        require(0 <= self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction,
                "use a fraction in [0, 1): the share of the rows held out for eval (0: none)")
        _check_paths("data.eval_path", self.eval_path)
        require(self.eval_path is None or self.eval_fraction == 0, "data.eval_path", self.eval_path,
                f"held-out rows come from data.eval_fraction={self.eval_fraction:g} or data.eval_path, "
                "not both: unset one of them")
        origin = self.order_origin
        require(isinstance(origin, list) and len(origin) == 2 and all(_is_int(v) and v >= 0 for v in origin),
                "data.order_origin", origin, "leave it unset: raytrain sets it ([position, epoch] where a resume "
                "restarted the sample order)")

    def _check_samples(self):
        """data.builtin, data.inputs / data.targets, data.transform and data.factory, each with what it needs."""
        require(self.builtin in BUILTIN_DATA, "data.builtin", self.builtin, f"use one of {', '.join(BUILTIN_DATA)}")
        require(self.builtin == "stdlib" or (self.path is None and self.factory is None), "data.builtin",
                self.builtin, "the built-in data is read when data.path and data.factory are unset: unset them, or "
                "data.builtin")
        require(self.path is None or self.factory is None, "data.factory", self.factory,
                "data.path and data.factory both name the training data: unset one of them")
        inputs = [self.inputs] if isinstance(self.inputs, str) else self.inputs
        require(self.inputs is None or (isinstance(inputs, list) and inputs and
                                        all(isinstance(c, str) and not _blank(c) for c in inputs)),
                "data.inputs", self.inputs, "name a column, or give a non-empty list of numeric column names")
        require(not _blank(self.targets), "data.targets", self.targets, "name the target column, or unset it")
        require((self.inputs is None) == (self.targets is None), "data.inputs" if self.targets else "data.targets",
                self.inputs if self.targets else self.targets,
                "data.inputs and data.targets come together: set both (rows of inputs and targets) or neither "
                "(token windows)")
        require(self.transform is not None or not isinstance(self.inputs, list) or len(inputs) < 2
                or self.targets not in inputs, "data.inputs", self.inputs,
                f"it lists the data.targets column {self.targets!r} among the model's inputs, which would read the "
                "answer it is asked for: drop it from data.inputs (one column as both inputs and targets, an "
                "autoencoder's, is allowed)")
        require(self.inputs is None or self.text_column is None, "data.inputs", self.inputs,
                "rows of inputs and targets are not text: unset data.text_column (or data.inputs)")
        for key in ("transform", "factory"):
            value = getattr(self, key)
            module, _, function = (value or "").partition(":")
            require(value is None or (all(p.isidentifier() for p in module.split(".")) and function.isidentifier()),
                    f"data.{key}", value, "write it as 'package.module:function', with importable names")
        require(self.transform is None or self.inputs is not None or self.factory is not None, "data.transform",
                self.transform, "it turns rows of data.inputs and data.targets columns into samples: set them "
                "(a torch Dataset transforms in its own __getitem__)")

    def _check_text(self):
        """data.text_column and data.tokenizer come together, and only with a data.path to read."""
        require(not _blank(self.text_column), "data.text_column", self.text_column,
                "name the text column (Parquet) or key (JSON lines) of data.path, or unset it")
        require(not _blank(self.tokenizer), "data.tokenizer", self.tokenizer,
                "give a directory holding tokenizer.json, or unset it")
        require(self.tokenizer is not None or self.text_column is None, "data.text_column", self.text_column,
                "text needs a tokenizer: set data.tokenizer to a directory holding tokenizer.json, "
                "or unset data.text_column to read token ids from data.column")
        require(self.text_column is not None or self.tokenizer is None, "data.tokenizer", self.tokenizer,
                "a tokenizer is used only on text: set data.text_column to the text column of data.path, "
                "or unset data.tokenizer")
        require(self.text_column is None or self.path is not None, "data.text_column", self.text_column,
                "the built-in corpus (data.path unset) is bytes, not text: point data.path at a Parquet or "
                "JSON lines file holding the text")


def _check_paths(key: str, value: Union[str, list, None]) -> None:
    """A path, directory or glob, or a non-empty list of them; what they name is checked by prepare."""
    entries = [value] if isinstance(value, str) else value
    require(value is None or (isinstance(entries, list) and len(entries) > 0 and
                              all(isinstance(e, str) and not _blank(e) for e in entries)), key, value,
            "give a Parquet or JSON lines file, a directory or a glob of them, or a list of those; or unset it")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Directory or URI (pyarrow.fs: local path, s3://, gs://...) for checkpoints; default <run_dir>/checkpoints."""
    every: int = 0
    """Save every this many steps (0: only at the end)."""
    resume: Optional[str] = None
    """Checkpoint to resume from: a step directory, a checkpoint.dir (its latest), or 'latest'."""
    keep: int = 3
    """Committed checkpoints to keep (oldest are deleted after a newer one is published)."""
    async_save: bool = False
    """Write checkpoints in the background: each saver snapshots its shard into host memory (one more copy of
    its parameters and AdamW moments: 12 bytes per parameter it owns) and training goes on while the files are
    written; the manifest is published once every file is durable. The run's last save, and one before a stop,
    are waited for."""
    lineage: Optional[str] = None
    """Set by raytrain (prepare replaces a value given): the chain of runs whose checkpoints this run continues,
    recorded in each manifest. A fresh run starts one; a run resumed from a lineage's newest checkpoint
    continues it. A run prunes (checkpoint.keep) only its own lineage's checkpoints."""

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", self.every, "use >= 0 (0: only at the end)")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "use >= 1")
        require(not _blank(self.dir), "checkpoint.dir", self.dir,
                "give a directory or URI, or unset it (<run_dir>/checkpoints)")
        require(not _blank(self.resume), "checkpoint.resume", self.resume,
                "give a step directory, a checkpoint.dir, or 'latest'; or unset it")
        require(not _blank(self.lineage), "checkpoint.lineage", self.lineage,
                "leave it unset: raytrain sets it (the chain of runs a run's checkpoints belong to)")


@dataclass
class ElasticConfig:
    min_dp: Optional[int] = None
    """Fewest replicas the run may shrink to after losing workers (default parallel.dp: replace, never shrink)."""
    max_dp: Optional[int] = None
    """Most replicas: the run grows to this when capacity appears (default parallel.dp: it grows back only)."""
    grow_poll_s: float = 2.0
    """How often a run below max_dp checks whether the cluster granted more replicas."""
    detect_timeout_s: float = 60.0
    """A collective stuck this long on a silent peer fails, so the peer is declared lost."""
    capacity_wait_s: float = 60.0
    """Below min_dp, how long to wait for capacity (replacement workers) before failing (the last checkpoint
    stays intact). Formerly elastic.wait_s, still read with a DeprecationWarning."""
    standby: int = 0
    """Replicas' worth of workers (fsdp x tp x pp each) started with the run, beyond elastic.max_dp, that
    wait as spares: a lost or drained worker's slot is taken at once, without a worker's start-up;
    the replacement started for it becomes the next standby."""
    replace_at_notice: bool = True
    """A worker told to leave (SIGTERM, its node draining with a deadline) keeps training while a
    replacement starts in a placement group of its own; it goes at the first step boundary after the
    replacement is up (or in time for its deadline, should none start: then as when off), so the run
    keeps its width and the start-up costs no step. The leaver's bundle in the run's placement group
    stays reserved until the run ends. Not with a standby waiting (it takes the slot at once), with
    parallel.tp > 1 or a STRICT_* resources.placement_strategy (a replacement elsewhere could break
    them), nor in a Tune trial (it runs in what Tune reserved); off: it goes at the next boundary."""
    drain_grace_s: float = 30.0
    """How long a worker told to leave (SIGTERM) waits for the coordinator to let it go before it exits
    on its own (GKE's grace period; AWS spot gives 120 s)."""
    max_failures: int = 20
    """Give up after this many repairs in one run."""
    coordinator_restarts: int = 3
    """Times the driver restarts a lost coordinator (it resumes from the last committed checkpoint)."""
    faults: list = field(default_factory=list)
    """A test knob, for chaos runs and tests: kill workers at 'replica:stage@step:phase' (see
    raytrain.config.faults). Leave it empty in production runs."""

    def __post_init__(self):
        for text in self.faults:
            Fault.parse(str(text))
        for name in ("detect_timeout_s", "capacity_wait_s", "grow_poll_s", "drain_grace_s"):
            value = getattr(self, name)
            require(value > 0, f"elastic.{name}", value, "a duration must be > 0 seconds")
        require(isinstance(self.replace_at_notice, bool), "elastic.replace_at_notice", self.replace_at_notice,
                "true or false")
        require(isinstance(self.standby, int) and self.standby >= 0, "elastic.standby", self.standby,
                "a count of standby replicas >= 0 (0: a lost worker waits for a replacement's start)")
        for name in ("min_dp", "max_dp"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"elastic.{name}", value,
                    "a run needs >= 1 replica; unset it to follow parallel.dp")
        for name in ("max_failures", "coordinator_restarts"):
            value = getattr(self, name)
            require(value >= 0, f"elastic.{name}", value, "use a count >= 0")


BUILTIN_DATA = ("stdlib", "digits")
"""data.builtin: the data a run reads when data.path and data.factory are unset."""

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ResourcesConfig:
    use_gpu: bool = False
    """One GPU per worker with NCCL; otherwise one CPU slot per worker with gloo."""
    cpus_per_worker: int = 1
    """CPU slots (and torch threads) per worker."""
    bf16: bool = False
    """bf16 autocast for forward and backward, on GPU or CPU; parameters and AdamW state stay fp32."""
    placement_wait_s: float = 60.0
    """At start, how long to wait for the cluster to grant the workers' resources (their placement group)
    before failing. Formerly resources.wait_s, still read with a DeprecationWarning."""
    step_timeout_s: float = 300.0
    """A worker silent for longer than this in one step is killed and repaired like a lost worker (it
    counts against elastic.max_failures), so a hung worker never hangs the run. Once a worker is lost, its
    survivors have at least elastic.detect_timeout_s + 5 s from the loss (a collective blocked on the lost
    peer returns at its group's timeout)."""
    placement_strategy: str = "PACK"
    """How each replica's workers are placed (raytrain.driver.placement): a tp group always stays on one node;
    PACK (default) packs a replica without tp where it fits and lets it span nodes, STRICT_PACK keeps each
    whole replica on one node; without tp, SPREAD spreads the workers (the starting replicas' together) and
    STRICT_SPREAD puts each on a node of its own (a node's loss costs one worker)."""
    check_memory: bool = True
    """Refuse, before any actor starts, a layout whose estimated memory per worker (raytrain.models.memory)
    exceeds what a worker has on the cluster's largest node (with resources.use_gpu, one GPU's memory); false
    tries it anyway."""

    def __post_init__(self):
        require(self.placement_strategy in PLACEMENT_STRATEGIES, "resources.placement_strategy",
                self.placement_strategy, f"use one of {', '.join(PLACEMENT_STRATEGIES)}")
        require(self.cpus_per_worker >= 1, "resources.cpus_per_worker", self.cpus_per_worker, "use >= 1")
        for name in ("placement_wait_s", "step_timeout_s"):
            value = getattr(self, name)
            require(value > 0, f"resources.{name}", value, "a duration must be > 0 seconds")


@dataclass
class EvalConfig:
    every: int = 0
    """Compute the held-out loss (eval_loss) after every this many steps and after the last; 0: never.
    Needs held-out rows: data.eval_fraction or data.eval_path."""
    batches: int = 4
    """Global batches (of train.global_batch rows) of held-out rows each evaluation reads: always the
    same first eval.batches x train.global_batch held-out rows."""
    metrics: list = field(default_factory=list)
    """Measured on the held-out rows beside the loss, each reported as ``eval_<name>``: ``accuracy`` (top-1:
    the share of targets that are the output's largest class), ``top5``, ``mse``, ``mae`` (of the output
    against float targets)."""

    def __post_init__(self):
        require(self.every >= 0, "eval.every", self.every, "use a count of steps >= 0 (0: no evaluation)")
        require(self.batches >= 1, "eval.batches", self.batches, "an evaluation needs >= 1 batch")
        require(isinstance(self.metrics, list) and all(m in EVAL_METRICS for m in self.metrics)
                and len(set(self.metrics)) == len(self.metrics), "eval.metrics", self.metrics,
                f"use a list of {', '.join(EVAL_METRICS)} (each once), or []")
        require(not self.metrics or self.every > 0, "eval.metrics", self.metrics,
                "they are measured at each evaluation: set eval.every > 0 (and held-out rows), or eval.metrics=[]")


EVAL_METRICS = ("accuracy", "top5", "mse", "mae")
"""eval.metrics: what an evaluation can measure beside the held-out loss."""


LOGGER_NAMES = ("tensorboard", "mlflow")
"""run.loggers: each the name of the package it writes with."""


@dataclass
class RunConfig:
    dir: str = "runs"
    """Parent directory of run directories (metrics.jsonl, loss.png, trace.json)."""
    name: Optional[str] = None
    """Run directory name; default a timestamp."""
    trace_steps: int = 3
    """Steps whose per-action timeline goes into trace.json (Chrome trace)."""
    loggers: list = field(default_factory=list)
    """Where else the metrics go, beside metrics.jsonl: any of LOGGER_NAMES (raytrain.driver.loggers)."""
    record_samples: bool = False
    """A test knob, for chaos runs and tests: every metrics row lists the sample ids its step consumed
    (to check exactly-once), and the Result has a digest of every worker's state at the end (to check
    that the replicas of a stage are identical); costs a little."""

    def __post_init__(self):
        require(not _blank(self.dir), "run.dir", self.dir, "give a directory for the run directories (default runs)")
        require(self.name is None or (not _blank(self.name) and self.name not in (".", "..")
                                       and "/" not in self.name and os.sep not in self.name),
                "run.name", self.name, "a run directory name without '/' (it goes under run.dir); or unset it")
        require(self.trace_steps >= 0, "run.trace_steps", self.trace_steps, "use a count of steps >= 0 (0: no trace)")
        require(isinstance(self.loggers, list) and all(name in LOGGER_NAMES for name in self.loggers),
                "run.loggers", self.loggers, f"use a list of {', '.join(LOGGER_NAMES)} (or [] for metrics.jsonl alone)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        """Checks that span sections; the per-section checks ran in their own __post_init__."""
        p, t = self.parallel, self.train
        for key, on, layers in (("train.activation_checkpointing", t.activation_checkpointing, "recomputed layers"),
                                ("train.compile", t.compile, "compiled layers (one backward graph each)")):
            require(not (on and p.split_backward), key, True,
                    f"{layers} cannot be split into input and weight halves: turn off parallel.split_backward")
            require(not (on and p.schedule in V_SCHEDULES and p.pp > 1), key, True, f"{layers} cannot be split into "
                    f"input and weight halves, and {p.schedule} splits backwards: use parallel.schedule=interleaved_1f1b")
        self._check_batch_division()
        self._check_tensor_parallel()
        if self.model.factory is None and self.model.hf is None:
            self.gpt_layout()  # a model.factory's or model.hf's layers are counted by raytrain.driver.model_check.model_layout
            rows = max(4 * self.model.d_model, self.model.seq_len, self.model.vocab_size)
            check_shardable(p.fsdp, rows, "the built-in GPT's largest parameter")
        if self.data.path is None and self.data.factory is None and self.data.builtin == "stdlib":
            self._check_builtin_corpus()
        self._check_elastic_range()

    def _check_elastic_range(self):
        """elastic.min_dp and elastic.max_dp around parallel.dp, and the largest grid within the global batch."""
        p, e, t = self.parallel, self.elastic, self.train
        require(not (p.auto and (e.min_dp is not None or e.max_dp is not None)), "parallel.auto", True,
                "it chooses parallel.dp, so elastic.min_dp / elastic.max_dp cannot be set with it; drop them, "
                "or set the layout by hand")
        require(e.min_dp is None or 1 <= e.min_dp <= p.dp, "elastic.min_dp", e.min_dp,
                f"use a value in 1..parallel.dp={p.dp}")
        require(e.max_dp is None or e.max_dp >= p.dp, "elastic.max_dp", e.max_dp,
                f"below parallel.dp={p.dp}, where the run starts; set elastic.max_dp >= {p.dp} (or lower parallel.dp)")
        if e.max_dp is not None:
            shards = f" x parallel.fsdp={p.fsdp}" if p.fsdp > 1 else ""
            require(self.layout().mesh.with_dp(e.max_dp).columns * p.microbatches <= t.global_batch,
                    "elastic.max_dp", e.max_dp, f"{e.max_dp} replicas{shards} x parallel.microbatches="
                    f"{p.microbatches} exceed train.global_batch={t.global_batch}: some micro-batch would be empty; "
                    "lower elastic.max_dp")

    def _check_tensor_parallel(self):
        """parallel.tp splits the heads and MLP columns of the built-in GPT (or a tp plan's linears), on one node."""
        tp, m, sequence = self.parallel.tp, self.model, self.parallel.sequence_parallel
        require(not sequence or tp > 1, "parallel.sequence_parallel", True,
                "it splits the tokens between tp ranks: set parallel.tp > 1, or leave it false")
        if tp == 1:
            return
        if m.hf is None and m.factory is None:  # the others' plans are checked when the driver builds them
            require(m.n_head % tp == 0, "parallel.tp", tp,
                    f"does not divide model.n_head={m.n_head} (each tp rank runs n_head / tp heads; model.d_model "
                    f"and the MLP width 4 x d_model then divide too); use a divisor of {m.n_head}")
        require(not sequence or m.seq_len % tp == 0, "parallel.tp", tp,
                f"does not divide model.seq_len={m.seq_len}: with parallel.sequence_parallel each tp rank holds "
                "seq_len / tp of every sample's tokens; use a tp that divides it, or sequence_parallel=false")
        require(self.resources.placement_strategy != "STRICT_SPREAD", "resources.placement_strategy",
                self.resources.placement_strategy, f"parallel.tp={tp} keeps each tp group on one node (it talks on "
                "every layer), which STRICT_SPREAD (one worker per node) forbids; unset it, or use SPREAD")

    def _check_batch_division(self):
        """The global batch divides over dp x fsdp data-parallel workers, each one's share over its micro-batches."""
        p, t = self.parallel, self.train
        require(t.global_batch % p.dp == 0, "train.global_batch", t.global_batch,
                f"not divisible by parallel.dp={p.dp}; use a multiple of {p.dp} "
                f"(e.g. {p.dp * max(1, t.global_batch // p.dp)})")
        columns = self.layout().mesh.columns
        require(t.global_batch % columns == 0, "train.global_batch", t.global_batch,
                f"not divisible by parallel.dp x parallel.fsdp={columns} (every shard trains on its own slice of "
                f"its replica's share); use a multiple of {columns}, or lower parallel.fsdp")
        share = t.global_batch // columns
        per = "train.global_batch / parallel.dp" + (" / parallel.fsdp" if p.fsdp > 1 else "")
        require(share % p.microbatches == 0, "parallel.microbatches", p.microbatches,
                f"does not divide the per-replica batch {share} ({per}); pick a divisor of {share}")

    def gpt_layout(self) -> Layout:
        """The layout over the built-in GPT's layers; a ValueError when parallel.pp or
        parallel.split_points cannot cut them."""
        m = self.model
        return Layout.of(self.parallel).for_model(
            m.gpt_layers, f"the model (model.n_layer={m.n_layer} blocks + embedding + head)")

    def _check_builtin_corpus(self):
        """With data.path unset the data are bytes (ids 0..255), cut into rows of model.seq_len + 1."""
        m, t = self.model, self.train
        require(m.vocab_size >= 256, "model.vocab_size", m.vocab_size, "the built-in corpus (data.path unset) is "
                "bytes, token ids 0..255; set model.vocab_size >= 256, or point data.path at your tokens")
        corpus_bytes = t.global_batch * (m.seq_len + 1)
        require(self.data.max_bytes >= corpus_bytes, "data.max_bytes", self.data.max_bytes,
                f"the built-in corpus needs train.global_batch={t.global_batch} rows of model.seq_len + 1 = "
                f"{m.seq_len + 1} bytes; set data.max_bytes >= {corpus_bytes}")

    # --- public helpers -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def layout(self) -> Layout:
        """The configured layout (its ``label``: ``dp=2 pp=1 m=1``); without the model's layer count
        and cuts, which raytrain.driver.prepare adds."""
        return Layout.of(self.parallel)


def check_shardable(fsdp: int, rows: int, what: str) -> None:
    """FSDP cuts every parameter into parallel.fsdp row slices (torch.chunk's cut: a small parameter
    leaves some shards empty, which works); a shard must own rows of some parameter, or the extra
    worker holds nothing. ``rows``: the largest parameter's rows (1 when a scalar cannot be cut)."""
    require(fsdp <= rows, "parallel.fsdp", fsdp,
            f"more shards than the {rows} rows of {what}, so some shard would own nothing; use "
            f"parallel.fsdp <= {rows}")
