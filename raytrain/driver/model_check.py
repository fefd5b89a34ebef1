"""The model, built once on the driver before any actor starts: its layers counted, cut into stages, and
what the run needs of it (``ModelFacts``) kept; a model that cannot take the layout is refused by name.

The built-in GPT is counted by arithmetic and built (on the meta device) only to balance its cuts, so a
run at pp=1 keeps torch out of the driver; a Hugging Face model is built on the meta device; a
model.factory (or the Python API's model) is built for real, once, as its workers will build it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from raytrain.config import Config, check_shardable
from raytrain.config.layout import Layout
from raytrain.config.prepared import ModelFacts, Tie
from raytrain.models.memory import builtin_gpt_layers

def needs_build(cfg: Config) -> bool:
    """Whether prepare builds the model: every model but the built-in GPT at one chunk with hand-set or
    no cuts, which arithmetic answers."""
    if cfg.model.factory is not None or cfg.model.hf is not None:
        return True
    return cfg.gpt_layout().needs_cuts or cfg.parallel.auto


def build_model_once(cfg: Config):
    """The model's layers and loss (a ModelSpec), as ``model_layers`` builds them."""
    from raytrain.models.layers import ModelSpec, build_model, cross_entropy_loss

    if cfg.model.factory is not None:
        try:
            return build_model(cfg.model, cfg.train.seed)
        except ValueError:
            raise  # raytrain's own word on what the factory returned
        except Exception as e:  # noqa: BLE001 -- the user's code: one line naming it, not its traceback
            raise ValueError(f"model.factory={cfg.model.factory!r} raised {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:300] if str(e) else '(no message)'}; fix the factory") from e
    layers = model_layers(cfg)
    return ModelSpec(layers, list(range(len(layers))), len(layers), cross_entropy_loss)


def model_layers(cfg: Config) -> list:
    """The model's cuttable layers: on the meta device where raytrain builds them (the built-in GPT, a
    Hugging Face model), for real for a model.factory (its values are its own: they are built as the
    workers will build them)."""
    import torch

    from raytrain.models.layers import build_model

    if cfg.model.hf is not None:
        from raytrain.models.hf_weights import hf_layers

        return hf_layers(cfg.model.hf, cfg.model.hf_cut, cfg.model.trust_remote_code)[1]
    if cfg.model.factory is None:
        with torch.device("meta"):
            return build_model(cfg.model, cfg.train.seed).layers
    return build_model(cfg.model, cfg.train.seed).layers


def check_model_takes_samples(cfg: Config, layers: list, loss_fn, example: tuple, layout: Layout,
                              target_range: Optional[tuple[float, float]] = None) -> Optional[int]:
    """A model.factory model tried on the first samples, layer by layer (in eval mode, without gradients):
    a ValueError naming the layer and both shapes when a layer cannot take its input, naming the layer
    when an output a pipeline cut sends is not a tensor or a tuple of tensors, and naming the loss or
    data.targets when the loss cannot compare the output with the targets (class ids beyond its width).
    Returns the model's number of classes where the default loss reads class ids (else None)."""
    import torch

    x, y = example
    cuts = set(layout.cuts or ()) if layout.num_chunks > 1 else set()
    h = x
    batch_norms = _BatchNormInputs(layers)
    with torch.no_grad(), batch_norms:
        for i, layer in enumerate(layers):
            what = f"the samples' inputs ({_shape(h)})" if i == 0 else f"layer {i - 1}'s output ({_shape(h)})"
            was_training = layer.training
            layer.eval()
            try:
                h = layer(h)
            except Exception as e:  # noqa: BLE001 -- the user's layer: one line naming it
                fix = ("make the first layer take the data's inputs, or point data.inputs (or the dataset) at what "
                       "it takes" if i == 0 else "make the layers' shapes agree")
                raise ValueError(f"model.factory: layer {i} ({_describe(layer)}) cannot take {what}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0][:300]}; {fix}") from None
            finally:
                layer.train(was_training)
            if i + 1 in cuts and not _sendable(h):
                raise ValueError(f"model.factory: layer {i} ({_describe(layer)}) returns {type(h).__name__}, which "
                                 f"parallel.pp={layout.pp} must send to the next stage (a cut after layer {i}): "
                                 "return a tensor or a tuple of tensors, or cut elsewhere (parallel.split_points)")
        classes = _check_loss(loss_fn, h, y, target_range)
    batch_norms.check(_smallest_microbatch(cfg))
    if cfg.eval.metrics and not isinstance(h, torch.Tensor):
        raise ValueError(f"eval.metrics={cfg.eval.metrics} score the model's output, and it returns {type(h).__name__} "
                         "(the loss takes it, the metrics cannot): return one tensor from the last layer, or set "
                         "eval.metrics=[]")
    return classes


class _BatchNormInputs:
    """While the model runs on the first samples: the values per channel and sample that each batch norm
    among ``layers`` normalises (its input's spatial size); ``check`` refuses a micro-batch too small for
    one in training, where torch needs more than one value per channel."""

    def __init__(self, layers: list):
        from torch import nn

        kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
        self.norms = [(f"layer {i} ({name or type(m).__name__})", m) for i, layer in enumerate(layers)
                      for name, m in layer.named_modules() if isinstance(m, kinds)]
        self.per_sample: dict[str, int] = {}
        self._hooks: list = []

    def __enter__(self):
        for where, m in self.norms:
            self._hooks.append(m.register_forward_pre_hook(lambda _, args, where=where: self._record(where, args[0])))
        return self

    def _record(self, where: str, x) -> None:
        self.per_sample.setdefault(where, int(x[0].numel() // x.shape[1]))  # one sample's values per channel

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def check(self, microbatch: int) -> None:
        for where, per_sample in self.per_sample.items():
            if microbatch * per_sample <= 1:
                raise ValueError(f"model.factory: {where} is a batch norm over micro-batches of {microbatch} sample: "
                                 "in training it needs more than one value per channel; raise train.global_batch, "
                                 "lower parallel.microbatches (or dp, fsdp), or use GroupNorm / LayerNorm")


def _smallest_microbatch(cfg: Config) -> int:
    """The fewest samples a worker's micro-batch holds: the global batch divided among the most replicas the
    run may grow to, their shards (fsdp), and the micro-batches."""
    replicas = max(cfg.parallel.dp, cfg.elastic.max_dp or 0)
    return cfg.train.global_batch // replicas // cfg.parallel.fsdp // cfg.parallel.microbatches


def _check_loss(loss_fn, out, y, target_range: Optional[tuple[float, float]]) -> Optional[int]:
    """The loss of the model's output against the targets must be a scalar; class ids within its width,
    which is returned where the default loss reads class ids."""
    from raytrain.models.layers import default_loss

    classes = None
    if loss_fn is default_loss and not y.is_floating_point() and hasattr(out, "shape") and out.dim() >= 2:
        classes = out.shape[-1]
        low, high = target_range or (int(y.min()), int(y.max()))
        if low < 0:
            raise ValueError(f"the targets hold class ids {low:g}..{high:g}: class ids count from 0 (cross entropy "
                             f"takes 0..{classes - 1} for the model's {classes} outputs); fix data.targets, or map "
                             "them in data.transform")
        if high >= classes:
            raise ValueError(f"the targets hold class ids {low:g}..{high:g}, outside the model's {classes} outputs "
                             f"(its last layer gives {_shape(out)}): widen the last layer to {int(high) + 1} "
                             "classes, or fix data.targets")
    try:
        loss = loss_fn(out, y)
    except Exception as e:  # noqa: BLE001 -- the user's loss: one line naming it
        hint = (" (the default loss: cross entropy for integer targets, mean squared error for float ones, which "
                "need the output's shape)" if loss_fn is default_loss else "")
        raise ValueError(f"model.factory's loss cannot compare the output ({_shape(out)}) with the targets "
                         f"({_shape(y)}){hint}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    if not (hasattr(loss, "dim") and loss.dim() == 0):
        raise ValueError(f"model.factory's loss_fn returned {_shape(loss)}; it must return the batch's mean loss, "
                         "a scalar tensor")
    return classes


def _sendable(value) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, tuple) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _shape(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return type(value).__name__


def _describe(layer) -> str:
    text = repr(layer).splitlines()
    return text[0] if len(text) == 1 else type(layer).__name__


def model_facts(cfg: Config, layers: Optional[list]) -> ModelFacts:
    """What the run needs of the model: each layer's parameter count, how far fsdp may cut it, and the
    parameters layers share; by arithmetic for the built-in GPT when it was not built."""
    if layers is None:
        m = cfg.model
        counts, max_fsdp = builtin_gpt_layers(m.n_layer, m.d_model, m.vocab_size, m.seq_len)
        return ModelFacts(tuple(counts), max_fsdp)
    counts = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return ModelFacts(counts, shardable_rows(layers), find_ties(layers))


def check_ties(cfg: Config, facts: ModelFacts, layout: Layout) -> None:
    """A ValueError when tensor parallelism would split a parameter that two stages hold (an embedding tied
    to the head): each stage keeps a copy and their gradients are summed (raytrain.worker.ties), which the
    tp ranks' split copies do not support."""
    across = facts.ties_across(layout.worker_layers)
    if layout.tp > 1 and across:
        model = f"model.hf={cfg.model.hf!r}" if cfg.model.hf else "the model"
        raise ValueError(f"{model} ties {across[0].name} to layer {across[0].layers[-1]} (an input embedding and the "
                         f"output head), which parallel.pp={layout.pp} puts on different stages and parallel.tp="
                         f"{layout.tp} would split; use parallel.tp=1 (fsdp shards a tied parameter), parallel.pp=1, "
                         "or untie them (tie_word_embeddings false)")


def find_ties(layers: list) -> tuple[Tie, ...]:
    """Parameters held by more than one layer, each under its global name (its first layer's)."""
    holders: dict[int, dict[int, str]] = {}  # parameter -> {layer: its name there}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            holders.setdefault(id(param), {}).setdefault(index, f"{index}.{name}")
    return tuple(Tie(next(iter(held.values())), tuple(held), tuple(held.values()))
                 for held in holders.values() if len(held) > 1)


def shardable_rows(layers: list) -> int:
    """The most shards parallel.fsdp may cut these layers into: the rows (dim 0, what FSDP cuts) of the
    largest parameter, so every shard owns some; 1 when a parameter is a scalar, which FSDP cannot cut."""
    shapes = [p.shape for layer in layers for p in layer.parameters()]
    return 1 if any(len(shape) == 0 for shape in shapes) else max((shape[0] for shape in shapes), default=1)


def model_layout(cfg: Config, layers: Optional[list] = None, example: Optional[Callable[[], tuple]] = None) -> Layout:
    """The configured layout with the model's layer count and stage cuts (parallel.split_points, else
    balanced by parallel.balance); a ValueError naming parallel.pp or parallel.split_points when the
    model cannot be cut so. ``layers``: the model's, when the caller built them (else built here, when
    needed); ``example``: the first samples, whose inputs parallel.balance=time times a model.factory's
    layers on. Needs model.factory importable (raytrain.driver.prepare.check_inputs)."""
    if cfg.model.hf is not None:
        return _hf_layout(cfg, layers if layers is not None else model_layers(cfg))
    if cfg.model.factory is None:
        layout = cfg.gpt_layout()
        if not layout.needs_cuts:
            return layout
        layers = layers if layers is not None and cfg.parallel.balance == "params" else _gpt_layers_to_cut(cfg)
    else:
        layers = layers if layers is not None else model_layers(cfg)
        layout = Layout.of(cfg.parallel).for_model(len(layers), "model.factory")
        check_shardable(layout.fsdp, shardable_rows(layers), "model.factory's largest parameter (or it has a scalar)")
        _check_factory_tp_plan(cfg, layers)
        if not layout.needs_cuts:
            return layout
    from raytrain.pipeline.partition import layer_cuts

    return dataclasses.replace(layout, cuts=tuple(layer_cuts(layers, layout.num_chunks, _timing_input(cfg, example))))


def _gpt_layers_to_cut(cfg: Config) -> list:
    """The built-in GPT's layers with values, to time them (parallel.balance=time); on the meta device
    when only their parameter counts are wanted."""
    from raytrain.models.layers import build_model

    if cfg.parallel.balance == "params":
        return model_layers(cfg)
    return build_model(cfg.model, cfg.train.seed).layers


def _check_factory_tp_plan(cfg: Config, layers: list) -> None:
    """parallel.tp > 1 needs the factory's layers to declare a tp plan their linears fit."""
    from raytrain.models.tensor_plan import plan_problem

    problem = plan_problem(layers, cfg.parallel.tp, cfg.parallel.sequence_parallel) if cfg.parallel.tp > 1 else None
    if problem is not None:
        raise ValueError(f"parallel.tp={cfg.parallel.tp}: model.factory={cfg.model.factory!r} cannot be split: "
                         f"{problem}. Declare tp_plan on its layers (README: Any model) or use parallel.fsdp")


def _hf_layout(cfg: Config, layers: list) -> Layout:
    """A Hugging Face model's layout: cut by parameter counts of its meta-device layers (or timed)."""
    from raytrain.models.hf_prepare import hf_layout
    from raytrain.pipeline.partition import layer_cuts

    layout = hf_layout(cfg, layers)
    check_shardable(layout.fsdp, shardable_rows(layers), "model.hf's largest parameter (or it has a scalar)")
    if layout.needs_cuts:
        if cfg.parallel.balance == "time":
            raise ValueError("parallel.balance=time builds the whole model on the driver to time its layers, which "
                             "model.hf does not do; use parallel.balance=params or parallel.split_points")
        layout = dataclasses.replace(layout, cuts=tuple(layer_cuts(layers, layout.num_chunks)))
    return layout


def _timing_input(cfg: Config, example: Optional[Callable[[], tuple]] = None):
    """One micro-batch of inputs to time the layers on (parallel.balance=time): the first samples' repeated
    (with ``example``), else token ids; None for parallel.balance=params."""
    if cfg.parallel.balance != "time":
        return None
    import torch

    layout = cfg.layout()
    micro_batch = max(1, cfg.train.global_batch // (layout.mesh.columns * layout.microbatches))
    if example is not None and cfg.model.factory is not None:
        x = example()[0]
        return x[torch.arange(micro_batch) % len(x)]
    return torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long)
