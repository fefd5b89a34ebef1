"""Which part of each parameter a tensor-parallel rank holds, as boxes of the whole tensor.

A layer declares its plan as ``tp_plan``: submodule name -> (style, fused parts), e.g. the built-in
GPT's ``Block.tp_plan`` (raytrain.models.layers). ``colwise`` splits a linear's output features (its
weight's and bias's dim 0), ``rowwise`` its input features (its weight's dim 1; the bias stays whole,
added once after the sum); a parameter in no planned submodule is replicated. A colwise linear that
fuses ``parts`` projections (q, k and v in one weight) is split per part, so rank r holds its rows of
each part: several boxes, stacked along dim 0 in the rank's local tensor in that order (``stack_dim``).
``replicated_grad_sum`` keeps a module whole on every rank but sums its gradient over the tp group: a
norm applied to each head (Qwen3's q_norm) sees only the rank's heads, so each rank's gradient is a part.
``tail_grad_sum`` keeps a linear whole on every rank and sums, over the tp group, the gradient of the
last n of its output features (the entry's second field, not a count of parts): DeepSeek-V2's latent
attention projects the keys' rotary part once for every head (``kv_a_proj_with_mqa``), so each rank's
heads give a part of that slice's gradient, while the rest of its output feeds a colwise linear whose
input gradient is already whole (transformers' ``mla_kv_a_proj``).
``param_rows`` names a bare parameter, not a module, and splits it by its dim 0 as ``colwise`` splits a
weight: attention sinks (one learnt logit per head: Granite SWA's ``sinks``) go with their rank's heads,
and the module that reads them sees its rank's rows, as it sees its rank's heads. ``expert_colwise`` and
``expert_rowwise`` split the bare (experts, out, in) weights of a mixture's experts as ``colwise`` and
``rowwise`` split one linear's, every expert alike, so each rank runs its slice of every expert; their
module is ``summed_experts``: its output is summed over the tp group, and its inputs' gradients too.
A rank's boxes of one tensor differ in a single dim, the dim its local tensor stacks them along
(``stack_dim``: dim 0 for a fused colwise weight, dim 1 for the experts' packed gate and up).
``colwise_gather_output`` and ``rowwise_split_input`` split a linear as ``colwise`` and ``rowwise`` do,
but the first gathers its output whole on every rank and the second takes a whole input and splits it
(transformers' styles of the same names): for a layer whose code between them needs whole activations
(OLMo 2's q/k norms over all heads at once, Phi-3's fused q/k/v cut apart by width).
``vocab_parallel`` splits an output head by vocabulary as ``colwise`` does and leaves its logits split:
the loss is computed on them where they lie (torch's ``loss_parallel``), so no rank holds a whole
batch x sequence x vocabulary of logits. It is a preference, not a requirement: where tp does not divide
the vocabulary, the head stays whole (``layer_plan`` drops it). ``vocab_embedding`` splits an input
embedding's table the same way (its weight's dim 0, the vocabulary): each rank looks up the tokens its
rows hold and an all-reduce sums the parts (torch's ``RowwiseParallel`` on an ``nn.Embedding``), so no
rank holds the whole table; it too is dropped where tp does not divide the vocabulary, and refused for
a table tied to a head.

Sequence parallelism (parallel.sequence_parallel; Megatron's, as torchtitan applies it): a layer whose
plan has a ``sequence_*`` entry keeps its activations outside the split linears split by tokens, each
rank holding seq_len / tp of every sample's. Its ``sequence_parallel`` norms run on the rank's tokens,
its colwise linears all-gather their input and its rowwise ones reduce-scatter their output (instead of
all-reducing it), ``sequence_scatter`` (``""``: the layer itself) keeps the rank's tokens of a whole
output (the embedding's) and ``sequence_gather`` gathers a whole module's input (a head tp cannot split
by vocabulary). ``sequence_region`` names a submodule whose code needs every token (a Hugging Face
attention reads the sequence length off its input): its input is gathered whole, the linears inside it
split as without the setting, but for its rowwise ones, which reduce-scatter to the rank's tokens, and
its output, if still whole, is cut to the rank's tokens; in a ``sequence_region_whole_output`` (where
split linears' outputs meet whole ones: a mixture's shared experts beside its routed experts, summed
whole) the rowwise linears all-reduce as without the setting, and the whole output is cut. A whole
model's layers must agree (the built-in GPT's and the Hugging Face cut's do), since pipeline stages pass
the split activations on. Without the setting, ``layer_plan`` leaves the ``sequence_*`` entries out.

A model.factory layer declares the same form (README: "Any model"); ``plan_problem`` checks it on the
driver before any actor starts. Its ``forward`` must read its local widths from what its colwise
linears return (a tp rank runs 1/tp of the heads), as ``Block.forward`` does.

Checkpoints record these boxes (``slices``, raytrain.checkpoint.assemble), so any layout reads a tp
worker's file, and a tp worker loads its boxes from any layout's. No torch.distributed here.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from torch import nn

from raytrain.checkpoint.assemble import stack_dim

Box = tuple[tuple[int, int], ...]
"""[start, stop) per dim of the whole tensor."""
TpPlan = dict[str, tuple[str, int]]
"""Submodule name -> (one of STYLES, fused parts; for tail_grad_sum, the count of output features)."""
VOCAB_PARALLEL = "vocab_parallel"
VOCAB_EMBEDDING = "vocab_embedding"
COLWISE_STYLES = ("colwise", "colwise_gather_output", VOCAB_PARALLEL)
"""Split by output features (a weight's dim 0, with its bias)."""
ROWWISE_STYLES = ("rowwise", "rowwise_split_input")
"""Split by input features (a weight's dim 1; the bias whole)."""
GRAD_SUM = "replicated_grad_sum"
TAIL_GRAD_SUM = "tail_grad_sum"
PARAM_ROWS = "param_rows"
"""A bare parameter (the entry names it, not a module) split by its dim 0: one value per head."""
EXPERT_COLWISE = "expert_colwise"
EXPERT_ROWWISE = "expert_rowwise"
EXPERT_SPLITS = {EXPERT_COLWISE: -2, EXPERT_ROWWISE: -1}
"""A bare parameter of a module of experts, shaped (experts, out, in) as each expert's weight: split by each
expert's output features (dim -2, in fused parts: a packed gate and up) or input features (dim -1)."""
SUMMED_EXPERTS = "summed_experts"
"""A module of experts whose parameters expert_* entries split: its output, a part on each rank, is summed
over the tp group, and so are its inputs' gradients."""
SEQUENCE_REGION = "sequence_region"
WHOLE_OUTPUT_REGION = "sequence_region_whole_output"
SEQUENCE_REGIONS = (SEQUENCE_REGION, WHOLE_OUTPUT_REGION)
SEQUENCE_STYLES = ("sequence_parallel", "sequence_scatter", "sequence_gather", *SEQUENCE_REGIONS)
"""Between split layers: a norm run on the rank's tokens, a layer (``""``) whose output each rank keeps
only its tokens of, a whole module whose input is gathered from every rank's tokens, and a region that
runs on every token (its input gathered, its output kept to the rank's tokens)."""
STYLES = (*COLWISE_STYLES, *ROWWISE_STYLES, VOCAB_EMBEDDING, GRAD_SUM, TAIL_GRAD_SUM, PARAM_ROWS, *EXPERT_SPLITS,
          SUMMED_EXPERTS, *SEQUENCE_STYLES)
BY_VOCABULARY = (VOCAB_PARALLEL, VOCAB_EMBEDDING)
"""Preferences, not requirements: a table or head whose vocabulary tp does not divide stays whole."""


def sequence_parallel(plan: TpPlan) -> bool:
    """Whether a layer's activations between its split linears are split by tokens (its colwise linears
    then gather their input, its rowwise ones reduce-scatter their output)."""
    return any(style in SEQUENCE_STYLES for style, _ in plan.values())


def layer_plan(layer, tp: int = 1, sequence: bool = False) -> TpPlan:
    """A layer's tensor-parallel plan at ``tp`` ranks (empty: every parameter replicated), without the
    ``vocab_parallel`` heads and ``vocab_embedding`` tables whose vocabulary ``tp`` does not divide (they
    stay whole), and without its ``sequence_*`` entries unless ``sequence`` (parallel.sequence_parallel)."""
    plan = {name: entry for name, entry in getattr(layer, "tp_plan", {}).items()
            if sequence or not (isinstance(entry, tuple) and entry[:1] and entry[0] in SEQUENCE_STYLES)}
    for name, entry in list(plan.items()):
        if isinstance(entry, tuple) and entry[:1] and entry[0] in BY_VOCABULARY and _vocabulary(layer, name) % tp:
            del plan[name]
            if entry[0] == VOCAB_PARALLEL and sequence_parallel(plan):  # the whole head still takes every rank's tokens
                plan[name] = ("sequence_gather", 1)
    return plan


def _vocabulary(layer, name: str) -> int:
    """The out_features of the linear, or the rows of the embedding, ``name`` of ``layer`` (0 when it names
    neither: plan_problem says so)."""
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        return 0
    if isinstance(module, nn.Embedding):
        return module.num_embeddings
    return module.out_features if isinstance(module, nn.Linear) else 0


def plan_problem(layers: list[nn.Module], tp: int, sequence: bool = False) -> Optional[str]:
    """Why ``tp`` ranks cannot split these layers by their ``tp_plan`` (None when they can): no layer
    declares one (that applies at ``tp``), or one names a style it does not know, a split submodule that
    is not a linear (an embedding, for vocab_embedding), widths that 1/tp of each part does not divide, a
    vocab_parallel head or vocab_embedding table that is fused or tied to another parameter (a head and
    its input embedding, which then stay whole), or, with ``sequence``, layers that do not agree on
    splitting the tokens."""
    planned = [(i, layer_plan(layer, tp, sequence)) for i, layer in enumerate(layers) if layer_plan(layer, tp, sequence)]
    if not planned:
        if any(getattr(layer, "tp_plan", None) for layer in layers):
            return (f"no entry of the layers' tp_plan splits a linear at tp={tp} (a vocab_parallel head stays whole "
                    "where tp does not divide its vocabulary; sequence_* entries need parallel.sequence_parallel and "
                    "split no weight): declare colwise and rowwise entries on the blocks")
        return "no layer declares a tensor-parallel plan (a tp_plan attribute)"
    shared = Counter(id(p) for layer in layers for _, p in layer.named_parameters(remove_duplicate=False))
    for i, plan in planned:
        for name, entry in plan.items():
            problem = _entry_problem(layers[i], f"layer {i}'s tp_plan[{name!r}]", name, entry, tp, shared)
            if problem is not None:
                return problem
    return token_split_problem([layer_plan(layer, tp, sequence) for layer in layers]) if sequence else None


def token_split_problem(plans: list[TpPlan]) -> Optional[str]:
    """Why the layers' sequence-parallel entries do not agree (None when they do): a layer that scatters the
    tokens, then only sequence-parallel layers, the last of which gathers them again (a head)."""
    if not any(sequence_parallel(plan) for plan in plans):
        return "no layer declares sequence_* entries (parallel.sequence_parallel splits the tokens by them)"
    split = False
    for i, plan in enumerate(plans):
        styles = {entry[0] for entry in plan.values()}
        if "sequence_scatter" in styles:
            if split:
                return f"layer {i} scatters the tokens ('sequence_scatter') that an earlier layer already split"
            split = True
        elif split != sequence_parallel(plan):
            return (f"layer {i} {'takes' if sequence_parallel(plan) else 'does not take'} the tokens split, but the "
                    f"layers before it {'do not split' if not split else 'split'} them: a sequence-parallel model "
                    "starts with a 'sequence_scatter' layer and every later layer declares sequence_* entries")
        if split and styles & {"sequence_gather", VOCAB_PARALLEL}:
            split = False  # a head: its input gathered from every rank's tokens
    if split:
        return ("the last layer leaves the tokens split: end a sequence-parallel model with a head that gathers "
                "them (a 'vocab_parallel' or 'sequence_gather' entry)")
    return None


def _entry_problem(layer: nn.Module, where: str, name: str, entry, tp: int, shared: Counter) -> Optional[str]:
    """Why one entry of a layer's plan cannot apply at ``tp`` ranks (None when it can)."""
    if not (isinstance(entry, tuple) and len(entry) == 2 and entry[0] in STYLES
            and isinstance(entry[1], int) and entry[1] >= 1):
        return f"{where} is {entry!r}; give (one of {' | '.join(map(repr, STYLES))}, fused parts >= 1)"
    if entry[0] == PARAM_ROWS or entry[0] in EXPERT_SPLITS:
        return param_split_problem(layer, where, name, entry[0], entry[1], tp)
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        module = None
    if entry[0] in (GRAD_SUM, SUMMED_EXPERTS) or entry[0] in SEQUENCE_STYLES:
        return f"{where} names no submodule of that layer" if module is None else None
    style, parts = entry
    if not isinstance(module, nn.Embedding if style == VOCAB_EMBEDDING else nn.Linear):
        return f"{where} names no {'nn.Embedding' if style == VOCAB_EMBEDDING else 'nn.Linear'} of that layer"
    if style in BY_VOCABULARY and parts != 1:
        return f"{where} is {entry!r}: a table or head split by vocabulary is one piece; give ({style!r}, 1)"
    if style in BY_VOCABULARY and shared[id(module.weight)] > 1:
        return (f"{where}: {name}.weight is tied to another parameter (a head and its input embedding share "
                "it); leave the entry out of that layer's tp_plan to keep it whole")
    if style == VOCAB_EMBEDDING:
        return None  # layer_plan kept it: tp divides its vocabulary
    if style == TAIL_GRAD_SUM:
        return None if parts <= module.out_features else (f"{where}: {name} has only {module.out_features} outputs; "
                                                          f"give a count of features <= {module.out_features}")
    width, what = ((module.out_features, "out_features") if style in COLWISE_STYLES
                   else (module.in_features, "in_features"))
    if width % (parts * tp):
        return f"{where}: {name}.{what}={width} does not split into {parts} part(s) of tp={tp} slices"
    return None


def param_split_problem(layer: nn.Module, where: str, name: str, style: str, parts: int, tp: int) -> Optional[str]:
    """Why a bare parameter's split (param_rows, expert_colwise, expert_rowwise) cannot apply at ``tp``
    ranks (None when it can)."""
    try:
        param = layer.get_parameter(name)
    except AttributeError:
        return f"{where} names no parameter of that layer ({style} names one, e.g. 'self_attn.sinks')"
    if style in EXPERT_SPLITS and param.dim() != 3:
        return f"{where}: {name} has {param.dim()} dims; {style} splits an (experts, out, in) weight"
    dim = EXPERT_SPLITS.get(style, 0)
    width = param.shape[dim] if param.dim() else 0
    if not width or width % (parts * tp):
        what = "rows" if style == PARAM_ROWS else f"features in its dim {dim}"
        return f"{where}: {name} has {width} {what}, which do not split into {parts} part(s) of tp={tp} slices"
    return None


def split_of(plan: TpPlan, param_name: str) -> Optional[tuple[str, int, int]]:
    """(style, parts, dim) by which parameter ``param_name`` (its name within the layer) is split, or None
    when it is replicated (no plan names it or its submodule, or it is a rowwise bias); an expert's dim
    counts from the end."""
    style, parts = plan.get(param_name, ("", 1))
    if style == PARAM_ROWS or style in EXPERT_SPLITS:
        return style, parts, EXPERT_SPLITS.get(style, 0)
    module, _, leaf = param_name.rpartition(".")
    if module not in plan:
        return None
    style, parts = plan[module]
    if style in COLWISE_STYLES or style == VOCAB_EMBEDDING:
        return style, parts, 0
    if style in ROWWISE_STYLES:
        return (style, parts, 1) if leaf == "weight" else None
    if style in (GRAD_SUM, TAIL_GRAD_SUM, SUMMED_EXPERTS) or style in SEQUENCE_STYLES:
        return None
    raise ValueError(f"unknown tensor-parallel style {style!r} for {module}")


def grad_summed(plan: TpPlan, param_name: str) -> bool:
    """Whether parameter ``param_name`` is whole on every tp rank with its gradient summed over them."""
    module = param_name.rpartition(".")[0]
    return module in plan and plan[module][0] == GRAD_SUM


def local_boxes(plan: TpPlan, param_name: str, shape: tuple[int, ...], tp: int, index: int) -> list[Box]:
    """The boxes of the whole tensor (of ``shape``) that tp rank ``index`` of ``tp`` holds, in the order
    its local tensor stacks them (along ``stack_dim``); one whole box when the parameter is replicated."""
    whole = tuple((0, n) for n in shape)
    split = split_of(plan, param_name)
    if split is None or tp == 1:
        return [whole]
    _, parts, dim = split
    dim %= len(shape)
    part = shape[dim] // parts
    width = part // tp
    assert part * parts == shape[dim] and width * tp == part, (param_name, shape, parts, tp)
    boxes = []
    for p in range(parts):
        start = p * part + index * width
        boxes.append(tuple((start, start + width) if d == dim else whole[d] for d in range(len(shape))))
    return boxes


def rows_of_stack(boxes: list[Box], start: int, stop: int) -> list[Box]:
    """The boxes of the whole that rows ``[start, stop)`` of a tp rank's local tensor (``boxes`` stacked
    along ``stack_dim``) hold: what an fsdp shard of a tensor-parallel parameter owns. Never empty: a shard
    owning no rows holds empty boxes."""
    if stack_dim(boxes) != 0:  # every box spans the local tensor's rows: each keeps rows [start, stop)
        first, end = boxes[0][0]
        lo, hi = min(first + start, end), min(first + max(stop, start), end)
        return [((lo, hi), *box[1:]) for box in boxes]
    held, offset = [], 0
    for box in boxes:
        (a, b), rest = box[0], box[1:]
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            held.append(((a + lo - offset, a + hi - offset), *rest))
        offset += b - a
    return held or [((boxes[0][0][0], boxes[0][0][0]), *boxes[0][1:])]
