"""Any model on any data, without Ray: the design documents' MLP, a regression, a ResNet on images decoded by
data.transform, tied parameters across stages and tuple activations train to one plain process's
parameters in every layout (forked stage workers: tests/forked_stages.py); columns become tensors as the
README says; bad input is one line naming the key, before any actor."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain.config import load_config
from raytrain.data import columns as cols
from raytrain.data.order import sample_seeds
from raytrain.driver.prepare import prepare
from raytrain.models.layers import default_loss
from raytrain.worker.metrics import HeldOutMetrics
from tests.forked_stages import held_out_losses, held_out_metrics, run_stages
from tests.helpers import assert_same_params, reference_state

STEPS = ("train.steps=3", "train.global_batch=16")
MLP = ("model.factory=experiments.examples.mlp:classifier", "data.builtin=digits", *STEPS)
LAYOUTS = {"dp2": ("parallel.dp=2",), "pp2": ("parallel.pp=2",), "dp2-pp2": ("parallel.dp=2", "parallel.pp=2"),
           "fsdp2": ("parallel.fsdp=2",)}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> str:
    from experiments.examples.shapes import write_shapes

    return write_shapes(str(tmp_path_factory.mktemp("shapes") / "shapes.parquet"), rows=96)


def regression_rows(path, rows: int = 64) -> str:
    """y = x W + noise, x ten float columns f0..f9, y a fixed-size list of two floats (the seeds' Linear(10, 2))."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 10)).astype(np.float32)
    y = x @ rng.normal(size=(10, 2)).astype(np.float32) + 0.01 * rng.normal(size=(rows, 2)).astype(np.float32)
    table = {f"f{i}": x[:, i] for i in range(10)}
    table["y"] = pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), 2)
    pq.write_table(pa.table(table), path)
    return str(path)


# --- every layout is one process ----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_design_documents_mlp_on_digits_equals_one_process(make_config, tmp_path, layout):
    cfg = make_config(*MLP, *layout)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_params(model, reference_state(cfg))


@pytest.mark.parametrize("layout", [LAYOUTS["dp2"], LAYOUTS["fsdp2"]], ids=["dp2", "fsdp2"])
def test_a_regression_on_float_columns_with_mean_squared_error_equals_one_process(make_config, tmp_path, layout):
    path = regression_rows(tmp_path / "regression.parquet")
    inputs = "[" + ", ".join(f"f{i}" for i in range(10)) + "]"
    cfg = make_config("model.factory=experiments.examples.mlp:regression", f"data.path={path}",
                      f"data.inputs={inputs}", "data.targets=y", "model.options={inputs: 10, outputs: 2}", *STEPS,
                      *layout)
    assert prepare(cfg).source.sample.targets.dtype == "float32"  # float targets: the default loss is MSE
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_params(model, reference_state(cfg))


@pytest.mark.parametrize("layout", [LAYOUTS["pp2"], LAYOUTS["fsdp2"], LAYOUTS["dp2-pp2"],
                                    ("parallel.dp=2", "parallel.microbatches=2")], ids=["pp2", "fsdp2", "dp2-pp2", "dp2-m2"])
def test_a_resnet_on_images_decoded_and_augmented_by_the_transform_equals_one_process(make_config, tmp_path, shapes,
                                                                                     layout):
    # GroupNorm: no layout changes its math. The transform crops and flips each training image at random,
    # from its own seed: every layout draws the same pixels, or the parameters would differ.
    cfg = make_config("model.factory=experiments.examples.resnet:resnet", "model.options={norm: group, blocks: 2}",
                      f"data.path={shapes}", "data.inputs=image", "data.targets=label",
                      "data.transform=experiments.examples.shapes:decode", *STEPS, *layout)
    assert prepare(cfg).source.sample.inputs.shape == (3, 16, 16)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_params(model, reference_state(cfg))


@pytest.mark.parametrize("layout", [("parallel.pp=2",), ("parallel.pp=2", "parallel.fsdp=2"),
                                    ("parallel.pp=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved_1f1b",
                                     "parallel.microbatches=2")], ids=["pp2", "fsdp2-pp2", "interleaved"])
def test_a_parameter_tied_across_stages_stays_one_and_equals_one_process(make_config, tmp_path, layout):
    cfg = make_config("model.factory=tests.factories:tied_embedding_head", *STEPS, *layout)
    prepared = prepare(cfg)
    assert [t.name for t in prepared.model.ties_across(prepared.stage_layers)] == ["0.weight"]
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_params(model, reference_state(cfg))  # the head's copy is checkpointed once, as the embedding's
    assert not any(name.startswith("4.") and name.endswith("weight") and "norm" not in name for name in model)


def test_a_tied_hugging_face_family_pipelines_and_equals_one_process(make_config, tmp_path):
    from tests.hf_models import assert_same_hf_params, write_hf_model

    path = write_hf_model(tmp_path / "gemma3", "gemma3", tied=True)
    cfg = make_config(f"model.hf={path}", "parallel.pp=2", *STEPS)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_hf_params(model, reference_state(cfg))
    assert [n for n in model if "head" in n or "embed" in n] == ["0.embed.weight"]


def test_stages_hand_on_a_tuple_of_a_float_and_an_integer_tensor(make_config, tmp_path):
    cfg = make_config("model.factory=tests.factories:tuple_activations", "parallel.pp=3", "parallel.microbatches=2",
                      *STEPS)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_params(model, reference_state(cfg))


def test_held_out_accuracy_is_the_same_in_every_layout(make_config, tmp_path):
    base = (*MLP, "data.eval_fraction=0.2", "eval.every=3", "eval.batches=2", "eval.metrics=[accuracy, top5]")
    assert prepare(make_config(*base)).held_out == 359  # floor(1797 x 0.2), never trained on
    got = {}
    for name in ("dp2", "pp2"):
        run_stages(make_config(*base, *LAYOUTS[name]), str(tmp_path / name), evaluate_after=(3,))
        got[name] = held_out_losses(str(tmp_path / name))[3], held_out_metrics(str(tmp_path / name))[3]
    (loss, rows), metrics = got["dp2"]
    assert rows == 32 and set(metrics) == {"accuracy", "top5"} and 0 < metrics["accuracy"] <= metrics["top5"] <= 1
    assert got["pp2"][0][0] == pytest.approx(loss, rel=1e-6) and got["pp2"][1] == pytest.approx(metrics, rel=1e-9)


# --- columns, losses, metrics, seeds --------------------------------------------------------------


def test_columns_become_tensors_of_their_shape():
    image = pa.FixedShapeTensorArray.from_numpy_ndarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    assert cols.column_array(image, "image").shape == (2, 3, 4)
    nested = pa.array([[[1.0, 2.0], [3.0, 4.0]]] * 2, type=pa.list_(pa.list_(pa.float64(), 2), 2))
    assert cols.column_array(nested, "m").shape == (2, 2, 2)
    assert cols.column_array(pa.array([[1, 2], [3, 4]]), "v").tolist() == [[1, 2], [3, 4]]  # variable lists, one length
    x, y = cols.sample_arrays({"a": np.array([1.0, 2.0]), "b": np.array([3, 4]), "t": np.array([0, 1])}, ["a", "b"], "t")
    assert x.dtype == np.float32 and x.tolist() == [[1.0, 3.0], [2.0, 4.0]] and y.dtype == np.int64


@pytest.mark.parametrize("column, words", [
    (pa.array([[1.0, 2.0], [3.0]]), "column 'x' is ragged: row 1 holds a list of 1 values where row 0 holds 2"),
    (pa.array([1.0, None]), "column 'x': row 1 is null"),
    (pa.array([{"a": 1}]), "which is no tensor"),
])
def test_a_column_that_cannot_be_a_tensor_is_named_with_its_row(column, words):
    with pytest.raises(cols.BadColumn, match=words):
        cols.column_array(column, "x")


def test_the_default_loss_follows_the_targets():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    assert torch.allclose(default_loss(logits, torch.tensor([0, 1])), torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])))
    out = torch.tensor([[1.0], [3.0]])
    assert float(default_loss(out, torch.tensor([0.0, 1.0]))) == pytest.approx((1 + 4) / 2)  # (B, 1) against (B,)
    with pytest.raises(ValueError, match=r"output \(2, 2\) and the targets \(2, 3\)"):
        default_loss(torch.zeros(2, 2), torch.zeros(2, 3))


def test_metrics_sum_over_targets_and_count_them():
    metrics = HeldOutMetrics(["accuracy", "top5"])
    metrics.add(torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), torch.tensor([1, 0, 0]))
    assert metrics.sums["accuracy"] == 2 and metrics.counts["accuracy"] == 3 and metrics.sums["top5"] == 3
    regression = HeldOutMetrics(["mse", "mae"])
    regression.add(torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 4.0]))
    assert (regression.sums["mse"], regression.sums["mae"], regression.counts["mse"]) == (5.0, 3.0, 2)


def test_a_samples_seed_depends_on_its_id_epoch_and_run_seed_not_on_its_batch():
    together = sample_seeds(7, [3, 5], [0, 0])
    assert together[1] == sample_seeds(7, [5], [0])[0]
    assert len({int(sample_seeds(7, [5], [0])[0]), int(sample_seeds(7, [5], [1])[0]),
                int(sample_seeds(8, [5], [0])[0])}) == 3


# --- bad input: one line naming the key and the fix, before any actor ----------------------------------


def _rows(path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_bad_rows_are_refused_by_name(make_config, tmp_path):
    good = _rows(tmp_path / "good.parquet", x=pa.array([[0.0] * 4] * 32, type=pa.list_(pa.float32(), 4)),
                 y=pa.array([0, 1] * 16))
    _rows(tmp_path / "held.parquet", x=pa.array([[1.0] * 4] * 64, type=pa.list_(pa.float32(), 4)), y=pa.array([1, 0] * 32))
    cases = [
        (("data.inputs=pixels", "data.targets=y", f"data.path={good}"), r"data.inputs names column 'pixels', which "
         r"data.path=.*good.parquet.* lacks \(columns: \['x', 'y'\]\)"),
        (("data.inputs=x", "data.targets=label", f"data.path={good}"), r"data.targets names column 'label'"),
        (("data.inputs=x", "data.targets=y", f"data.path={_rows(tmp_path / 'r.parquet', x=pa.array([[0.0]] * 31 + [[0.0, 1.0]]), y=pa.array([0] * 32))}"),
         r"column 'x' is ragged: row 31"),
        (("data.inputs=x", "data.targets=y", f"data.path={good}", "data.transform=tests.test_any_model:no_such_fn"),
         r"data.transform='tests.test_any_model:no_such_fn': module 'tests.test_any_model' has no function 'no_such_fn'"),
        (("data.inputs=x", "data.targets=y", f"data.path={good}", "data.transform=tests.test_any_model:returns_one"),
         r"data.transform='tests.test_any_model:returns_one' cannot make samples.*must return \(inputs, targets\)"),
        (("data.inputs=x", "data.targets=y", f"data.path={good}", f"data.eval_path={good.replace('good', 'held')}",
          "train.global_batch=64"), r"the training data has 32 rows, fewer than train.global_batch=64 \(its held-out"),
    ]
    for overrides, words in cases:
        with pytest.raises(ValueError, match=words):
            prepare(make_config("model.factory=experiments.examples.mlp:classifier",
                                "model.options={inputs: 4, classes: 2}", *STEPS, *overrides))


def returns_one(columns):
    """A transform that forgets the targets."""
    return columns["x"]


def test_data_that_differs_between_files_or_from_its_held_out_rows_is_refused_by_name(make_config, tmp_path):
    """What a hostile user found trained until step 1 or the first evaluation, or trained on the wrong data."""
    def x(width, rows=32):
        return pa.array([[0.0] * width] * rows, type=pa.list_(pa.float32(), width))

    good = _rows(tmp_path / "good.parquet", x=x(4), y=pa.array([0, 1] * 16))
    (tmp_path / "split").mkdir()
    _rows(tmp_path / "split" / "a.parquet", x=x(4), y=pa.array([0, 1] * 16))
    _rows(tmp_path / "split" / "b.parquet", x=x(4), y=pa.array([0.0, 1.0] * 16))
    cases = [
        ((f"data.path={tmp_path / 'split'}",), r"data.path: column 'y' is double in '.*b.parquet' but int64 in "
         r"'.*a.parquet': every file of the data must give samples of one shape and type"),
        ((f"data.path={good}", f"data.eval_path={_rows(tmp_path / 'wide.parquet', x=x(8), y=pa.array([0, 1] * 16))}"),
         r"data.eval_path: the held-out samples are float32 \(8,\) -> int64 \(\), the training ones float32 \(4,\)"),
        ((f"data.path={good}", f"data.eval_path={_rows(tmp_path / 'ids.parquet', x=x(4), y=pa.array([0, 7] * 16))}"),
         r"class ids 0..7, outside the model's 2 outputs"),
        ((f"data.path={_rows(tmp_path / 'neg.parquet', x=x(4), y=pa.array([-1, 1] * 16))}",),
         r"class ids -1..1: class ids count from 0"),
        ((f"data.path={good}", "data.transform=tests.test_any_model:raises_key_error"),
         r"data.transform='tests.test_any_model:raises_key_error' cannot make samples of the first rows of "
         r"'.*good.parquet': KeyError: 'pixels'"),
        ((f"data.path={_rows(tmp_path / 'few.parquet', x=x(4, rows=5), y=pa.array([0, 1, 0, 1, 0]))}",),
         r"the training data has 5 rows, fewer than train.global_batch=16: add rows, or lower train.global_batch"),
        (("data.factory=tests.test_any_model:returns_none", "data.inputs=null", "data.targets=null"),
         r"data.factory='tests.test_any_model:returns_none' returned None: return the training data"),
        ((f"data.path={_rows(tmp_path / 'nan.parquet', x=x(4), y=pa.array([0.0] * 20 + [float('nan')] + [1.0] * 11))}",
          "model.factory=experiments.examples.mlp:regression", "model.options={inputs: 4, outputs: 1}"),
         r"nan.parquet': column 'y' holds NaN at row 20: a sample needs every value"),
    ]
    for overrides, words in cases:
        with pytest.raises(ValueError, match=words):
            prepare(make_config("model.factory=experiments.examples.mlp:classifier", "data.inputs=x", "data.targets=y",
                                "model.options={inputs: 4, classes: 2}", *STEPS, *overrides))
    # class ids 1..2 mapped to 0..1 by the transform: the model takes what the transform makes, not the column
    shifted = _rows(tmp_path / "shifted.parquet", x=x(4), y=pa.array([1, 2] * 16))
    prepare(make_config("model.factory=experiments.examples.mlp:classifier", "model.options={inputs: 4, classes: 2}",
                        "data.inputs=x", "data.targets=y", f"data.path={shifted}", *STEPS,
                        "data.transform=tests.test_any_model:ids_from_one"))
    # a transform's float64 tensors are float32 samples, as its float64 arrays are
    prepared = prepare(make_config("model.factory=experiments.examples.mlp:classifier", "data.inputs=x",
                                   "data.targets=y", "model.options={inputs: 4, classes: 2}", f"data.path={good}",
                                   *STEPS, "data.transform=tests.test_any_model:float64_tensors"))
    assert prepared.source.sample.inputs.dtype == "float32"


def raises_key_error(columns):
    """A transform written for another dataset's columns."""
    return columns["pixels"], columns["y"]


def ids_from_one(columns):
    """Class ids stored from 1, as the model counts them from 0."""
    return columns["x"], columns["y"] - 1


def float64_tensors(columns):
    """torch's float64 inputs, as a transform doing its arithmetic in numpy's default precision makes them."""
    return torch.from_numpy(columns["x"].astype("float64")), torch.from_numpy(columns["y"])


def returns_none(data_cfg):
    """A data factory that forgot its return."""
    dataset = None  # noqa: F841


@pytest.mark.parametrize("overrides, words", [
    (("model.options={inputs: 64, classes: 5}",), r"class ids 0..9, outside the model's 5 outputs \(its last layer "
     r"gives float32 \(2, 5\)\): widen the last layer to 10 classes"),
    (("model.options={inputs: 60}",), r"layer 0 \(Linear\(in_features=60.*\) cannot take the samples' inputs "
     r"\(float32 \(2, 64\)\).*2x64 and 60x100"),
    (("model.factory=tests.test_any_model:cross_entropy_on_floats", "data.targets=pixels", "data.inputs=pixels"),
     r"loss cannot compare the output \(float32 \(2, 10\)\) with the targets \(float32 \(2, 64\)\)"),
], ids=["class-ids", "input-shape", "float-targets-with-cross-entropy"])
def test_a_model_that_cannot_take_the_samples_is_refused_naming_the_layer(make_config, overrides, words):
    with pytest.raises(ValueError, match=words):
        prepare(make_config(*MLP, *overrides))


def cross_entropy_on_floats(model):
    from experiments.examples.mlp import classifier

    return classifier(model), torch.nn.functional.cross_entropy


def test_a_layer_returning_what_a_pipeline_cannot_send_is_refused_at_its_cut(make_config):
    with pytest.raises(ValueError, match=r"layer 0 \(.*\) returns dict, which parallel.pp=2 must send"):
        prepare(make_config("model.factory=tests.test_any_model:dict_between_layers", "parallel.pp=2", *STEPS,
                            "data.builtin=digits"))


def dict_between_layers(model):
    class ToDict(torch.nn.Module):
        def forward(self, x):
            return {"h": x}

    class FromDict(torch.nn.Linear):
        def forward(self, d):
            return super().forward(d["h"])

    return [ToDict(), FromDict(64, 10)]


def test_tp_that_would_split_a_tied_parameter_is_refused(make_config, tmp_path):
    from tests.hf_models import write_hf_model

    path = write_hf_model(tmp_path / "gemma3", "gemma3", weights=False, tied=True)
    with pytest.raises(ValueError, match=r"ties 0.embed.weight to layer 3.*parallel.pp=2.*parallel.tp=2 would split"):
        prepare(make_config(f"model.hf={path}", "parallel.pp=2", "parallel.tp=2",
                            "resources.placement_strategy=STRICT_PACK", *STEPS))


@pytest.mark.parametrize("metric, words", [("mse", "mse and mae compare float targets"),
                                           ("accuracy", "accuracy and top5 count class ids")])
def test_a_metric_the_targets_cannot_give_is_refused(make_config, tmp_path, metric, words):
    path = regression_rows(tmp_path / "regression.parquet")
    data = (f"data.path={path}", "data.inputs=[f0, f1]", "data.targets=y", "model.options={inputs: 2, outputs: 2}",
            "model.factory=experiments.examples.mlp:regression") if metric == "accuracy" else ("data.builtin=digits",
            "model.factory=experiments.examples.mlp:classifier")
    with pytest.raises(ValueError, match=rf"eval.metrics=\['{metric}'\]: {words}"):
        prepare(make_config(*data, *STEPS, "data.eval_fraction=0.25", "eval.every=2", "eval.batches=1",
                            f"eval.metrics=[{metric}]"))


def test_a_torch_dataset_that_cannot_be_pickled_is_refused_before_ray_starts(make_config):
    import threading

    import ray

    class Locked(torch.utils.data.Dataset):
        lock = threading.Lock()

        def __init__(self):
            self.lock = threading.Lock()

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(64), 0

    was_up = ray.is_initialized()
    with pytest.raises(ValueError, match=r"dataset \(Locked\) cannot be pickled for the workers: TypeError"):
        prepare(make_config("model.factory=experiments.examples.mlp:classifier", *STEPS), dataset=Locked())
    assert ray.is_initialized() == was_up


def test_a_factory_that_raises_is_one_line_naming_it(make_config):
    with pytest.raises(ValueError, match=r"^model.factory='tests.test_any_model:raises' raised RuntimeError: no GPU "
                                         r"here; fix the factory$"):
        prepare(make_config("model.factory=tests.test_any_model:raises", *STEPS))


def raises(model):
    raise RuntimeError("no GPU here\nand a second line nobody needs")


def test_a_sweep_whose_every_trial_failed_names_no_best(monkeypatch, capsys):
    import io
    import json

    from raytrain import cli
    from raytrain import tune as rt_tune

    failed = [rt_tune.TrialRow(trial_id=f"t{i}", layout="dp=1 pp=1 m=1", params={}, status="error", steps=3,
                               loss=float("nan"), samples_per_s=0.0, first_step_s=1.0) for i in range(2)]
    monkeypatch.setattr(rt_tune, "summarize", lambda grid, sweep: failed)
    monkeypatch.setattr(rt_tune, "write_reports", lambda grid, rows, where: ("r.csv", "r.png"))
    monkeypatch.setattr(rt_tune, "expected_trials", lambda sweep: 2)
    out = io.StringIO()
    grid = type("Grid", (), {"experiment_path": "exp"})()
    assert cli._sweep_report(grid, None, None, "resume", out) == 1
    assert json.loads(out.getvalue())["best"] is None and "no trial finished" in capsys.readouterr().err


def test_model_options_reach_the_python_apis_model_function_and_need_a_model_function(make_config):
    from experiments.examples.mlp import classifier

    seen = {}

    def build(model_cfg):
        seen.update(model_cfg.options)
        return classifier(model_cfg)

    prepare(make_config("data.builtin=digits", *STEPS, "model.options={hidden: 8}"), model=build)
    assert seen == {"hidden": 8}
    with pytest.raises(ValueError, match=r"model.options=\{'hidden': 8\}: they are the model function's settings"):
        prepare(make_config("data.builtin=digits", *STEPS, "model.options={hidden: 8}"))


def test_metrics_of_a_model_whose_output_is_not_a_tensor_are_refused_before_the_run(make_config):
    with pytest.raises(ValueError, match=r"eval.metrics=\['accuracy'\] score the model's output, and it returns tuple"):
        prepare(make_config("model.factory=tests.test_any_model:with_an_auxiliary_output", "data.builtin=digits",
                            *STEPS, "data.eval_fraction=0.25", "eval.every=2", "eval.batches=1",
                            "eval.metrics=[accuracy]"))


def with_an_auxiliary_output(model):
    """An MLP whose last layer also returns an auxiliary value, which its own loss reads."""
    from experiments.examples.mlp import classifier

    class WithAux(torch.nn.Module):
        def forward(self, logits):
            return logits, logits.pow(2).mean()

    def loss(out, targets):
        logits, aux = out
        return torch.nn.functional.cross_entropy(logits, targets) + 0.01 * aux

    return [*classifier(model), WithAux()], loss


def test_a_batch_norm_over_micro_batches_of_one_sample_is_refused_before_the_run(make_config):
    """torch's BatchNorm1d needs more than one value per channel in training: 16 samples over dp=2 and 8
    micro-batches leave one; it failed step 1 before."""
    base = ("model.factory=tests.factories:batch_norm_mlp", "data.builtin=digits", *STEPS, "parallel.dp=2")
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm1d\) is a batch norm over micro-batches of 1 sample: "
                                         r"in training it needs more than one value per channel"):
        prepare(make_config(*base, "parallel.microbatches=8"))
    prepare(make_config(*base, "parallel.microbatches=4"))  # two samples each: it trains


def test_a_batchs_class_ids_are_checked_against_the_models_outputs_naming_the_sample():
    from raytrain.data.samples import check_class_ids

    check_class_ids(torch.tensor([0, 9, 3]), [5, 6, 7], 10)  # within
    check_class_ids(torch.tensor([0, 12]), [5, 6], None)  # no classifier: nothing to check
    check_class_ids(torch.tensor([0.5, 12.0]), [5, 6], 10)  # float targets: a regression's
    with pytest.raises(ValueError, match=r"^training sample 7 has class id 10, outside the model's 10 outputs .*"
                                         r"__getitem__.*, or widen the model's last layer to 11 classes$"):
        check_class_ids(torch.tensor([0, 9, 10]), [5, 6, 7], 10)
    with pytest.raises(ValueError, match=r"^held-out sample 6 has class id -1, .*: class ids count from 0$"):
        check_class_ids(torch.tensor([[0, 1], [2, -1]]), [5, 6], 10, held_out=True)  # several targets per sample


def test_prepare_records_the_classes_the_workers_check_only_for_a_classifier(make_config):
    classifier = prepare(make_config("model.factory=experiments.examples.mlp:classifier", "data.builtin=digits",
                                     "train.global_batch=16"))
    assert classifier.source.classes == 10
    assert prepare(make_config()).source.classes is None  # the built-in GPT: its own loss over tokens
