"""Any model on any data, on real Ray actors: the design documents' MLP survives a killed worker seeing each
sample once; a torch Dataset (through data.factory, the CLI's way) and a Ray Dataset (through the Python API,
with map_batches preprocessing on Ray's workers) train to the Parquet rows' parameters; batch norm's statistics
stay identical on the replicas and resume into another layout."""

import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raytrain import checkpoint, train
from raytrain.control.coordinator import StepFailed
from raytrain.data.corpus import DIGITS_PATH
from raytrain.testing.reference import train_reference
from tests.helpers import assert_replicas_identical, assert_same_params, reference_state

pytestmark = pytest.mark.ray
MLP = ("model.factory=experiments.examples.mlp:classifier", "train.global_batch=16", "train.lr=3e-3")


def digits() -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(DIGITS_PATH)
    return np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype(np.float32), \
        table.column("digit").to_numpy()


class Digits(torch.utils.data.Dataset):
    """The built-in digits as a map-style dataset: sample i is (pixels, digit), as row i of the Parquet file."""

    def __init__(self):
        self.x, self.y = digits()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def digits_dataset(data_cfg):
    """data.factory: the digits as a torch Dataset."""
    return Digits()


class DigitsWithALateBadClass(torch.utils.data.Dataset):
    """40 of the digits, sample 30 labelled 12: beyond the first samples that the driver decodes."""

    def __init__(self):
        self.x, self.y = digits()

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), 12 if i == 30 else int(self.y[i])


def late_bad_class_dataset(data_cfg):
    """data.factory: DigitsWithALateBadClass."""
    return DigitsWithALateBadClass()


def test_the_mlp_survives_a_killed_worker_seeing_each_sample_once_and_reports_accuracy(ray_session, make_config):
    cfg = make_config(*MLP, "data.builtin=digits", "parallel.dp=2", "train.steps=6", "run.record_samples=true",
                      "elastic.faults=['1:0@2:backward']", "data.eval_fraction=0.2", "eval.every=3", "eval.batches=2",
                      "eval.metrics=[accuracy]")
    result = train(cfg)
    assert result.failures == 1 and result.committed_steps == list(range(6))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 6 * 16 and max(ids) < 1797 - 359  # none held out
    assert_replicas_identical(result, replicas=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    summary = result.summary()
    assert 0 < summary["eval_accuracy"] <= 1 and [r["eval_accuracy"] for r in result.metrics if "eval_loss" in r]


def test_a_torch_dataset_and_a_ray_dataset_train_to_the_parquet_rows_parameters(ray_session, make_config):
    base = (*MLP, "parallel.dp=2", "train.steps=4")
    parquet = checkpoint.load_state_dict(train(make_config(*base, "data.builtin=digits")).checkpoint)
    from_factory = train(make_config(*base, "data.factory=tests.test_any_data:digits_dataset"))
    assert_same_params(checkpoint.load_state_dict(from_factory.checkpoint), parquet, rtol=0)

    x, y = digits()
    items = ray_session.data.from_items([{"pixels": x[i] * 16, "digit": y[i]} for i in range(len(y))])
    scaled = items.map_batches(lambda batch: {**batch, "pixels": batch["pixels"] / 16}, batch_size=256)
    from_ray = train(make_config(*base, "data.inputs=pixels", "data.targets=digit"), dataset=scaled)
    assert_same_params(checkpoint.load_state_dict(from_ray.checkpoint), parquet, rtol=0)
    with pytest.raises(ValueError, match=r"dataset \(a Ray Dataset\) is empty"):
        train(make_config(*base, "data.inputs=pixels", "data.targets=digit"), dataset=scaled.limit(0))
    # a torch Dataset's later samples are only read by the workers: they check every batch's class ids
    # at dp=2 the worker that read it leaves its groups, so its peer fails at once, not after detect_timeout_s
    started = time.monotonic()
    with pytest.raises(StepFailed, match="training sample 30 has class id 12, outside the model's 10 outputs"):
        train(make_config(*MLP, "parallel.dp=2", "train.steps=3", "elastic.detect_timeout_s=60",
                          "data.factory=tests.test_any_data:late_bad_class_dataset"))
    assert time.monotonic() - started < 40


def test_batch_norm_statistics_stay_identical_on_replicas_and_resume_into_another_layout(ray_session, make_config):
    first = train(make_config("model.factory=tests.factories:batch_norm_mlp", "data.builtin=digits",
                              "train.global_batch=16", "parallel.dp=2", "train.steps=3", "run.record_samples=true"))
    assert_replicas_identical(first, replicas=2)  # their digests hold the running statistics too
    saved = checkpoint.load_state_dict(first.checkpoint)
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(saved)
    assert float(saved["1.num_batches_tracked"]) == 3 and saved["1.running_mean"].abs().sum() > 0
    # one replica of two stages, one micro-batch: batch norm sees the whole batch, as one process does
    cfg = make_config("model.factory=tests.factories:batch_norm_mlp", "data.builtin=digits", "train.global_batch=16",
                      "parallel.pp=2", "train.steps=5", f"checkpoint.resume={first.checkpoint}")
    resumed = checkpoint.load_state_dict(train(cfg).checkpoint)
    model, _ = train_reference(cfg, resume_from=first.checkpoint)
    assert_same_params(resumed, {**dict(model.named_parameters()), **dict(model.named_buffers())})


def test_a_ray_datasets_every_row_is_checked_before_the_run(ray_session, make_config):
    """A missing value, or a class id beyond the model's outputs, in a later block of a Ray Dataset is refused
    before any actor starts, naming the row, as a Parquet file's are (they failed step 1 before)."""
    import ray.data

    from raytrain.driver.prepare import prepare

    rows = [{"x": np.zeros(64, dtype=np.float32), "y": i % 10} for i in range(200)]
    beyond = [dict(r, y=12) if i == 150 else r for i, r in enumerate(rows)]
    missing = [dict(r, x=None) if i == 120 else r for i, r in enumerate(rows)]
    cfg = make_config("model.factory=experiments.examples.mlp:classifier", "data.inputs=x", "data.targets=y",
                      "train.steps=2", "train.global_batch=8")
    for items, words in ((beyond, r"class ids 0..12, outside the model's 10 outputs"),
                         (missing, r"dataset \(a Ray Dataset\): column 'x' has no value at row 120")):
        with pytest.raises(ValueError, match=words):
            prepare(cfg, dataset=ray.data.from_items(items, override_num_blocks=4))
