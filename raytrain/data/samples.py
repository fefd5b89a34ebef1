"""What a sample is, and where the samples a worker reads live, as values the driver builds once.

A sample is ``(inputs, target)``: two tensors of any shape and dtype (``SampleSpec``). Token windows are
one kind (inputs and next-token targets, each ``(model.seq_len,)`` int64); feature rows, images and a
user's dataset are others. Where the samples live is one of:

- ``Files`` (raytrain.data.shards): Parquet or JSON lines files, read as token windows, text, or rows of
  data.inputs / data.targets columns;
- ``Objects``: a user's map-style ``torch.utils.data.Dataset``, pickled into Ray's object store once;
- ``Blocks``: a Ray Dataset, materialised into the object store, its blocks numbered in order.

Each numbers its samples 0..total-1, which is all the sample order (raytrain.data.order) needs: every
kind keeps every sample exactly once per epoch, whatever the layout. No torch here: the coordinator
carries these values to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from raytrain.data.shards import Files, NumberedParts


@dataclass(frozen=True)
class TensorSpec:
    """One sample's tensor: its shape (without the batch dimension) and dtype (torch's name: ``float32``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def is_integer(self) -> bool:
        return self.dtype in ("int64", "int32", "int16", "int8", "uint8")

    def describe(self) -> str:
        return f"{self.dtype} {tuple(self.shape)}"


@dataclass(frozen=True)
class SampleSpec:
    """The shapes and dtypes of a sample's inputs and target: what the first stage's layers take, what the
    loss compares the last stage's output with."""

    inputs: TensorSpec
    targets: TensorSpec

    @classmethod
    def tokens(cls, seq_len: int) -> SampleSpec:
        """A token window: seq_len ids in, the next seq_len ids as targets."""
        return cls(TensorSpec((seq_len,), "int64"), TensorSpec((seq_len,), "int64"))


@dataclass(frozen=True)
class Objects:
    """A user's map-style dataset (index -> (inputs, target)), pickled into Ray's object store by the driver:
    every worker that reads samples unpickles its own copy."""

    ref: Any
    """ObjectRef of the dataset's pickled bytes."""
    count: int
    """len(dataset)."""

    @property
    def total(self) -> int:
        return self.count


@dataclass(frozen=True)
class Blocks(NumberedParts):
    """A Ray Dataset materialised into Ray's object store: its blocks (each a dict of column -> numpy array)
    in the dataset's order, numbered as their concatenation, as files are (``Files``)."""

    refs: tuple
    """ObjectRef of each block."""
    samples: tuple[int, ...]
    """Rows of each block."""


Samples = Union[Files, Objects, Blocks]
"""Where one dataset's samples live."""


@dataclass(frozen=True)
class DataSource:
    """What a run reads, resolved and counted on the driver: the training samples (data.path's files, the
    built-in corpus, a torch Dataset or a Ray Dataset), the held-out ones when they are apart from them
    (data.eval_path, or the Python API's eval_dataset; data.eval_fraction's are the training samples'
    last ones), and the shape of a sample."""

    train: Samples
    sample: SampleSpec
    held_out: Optional[Samples] = None
    classes: Optional[int] = None
    """The model's outputs where the default loss reads integer class ids (a model.factory classifier): the
    workers check every batch's targets against it on the CPU, where the driver could read only some (a
    torch Dataset's first samples). On a GPU an out-of-range id would be a device-side assert."""


def check_class_ids(targets, sample_ids, classes: Optional[int], held_out: bool = False) -> None:
    """A ValueError naming the first sample whose class id is outside ``classes`` (DataSource.classes; no
    check when None) in a batch of integer ``targets`` (a CPU tensor, one row per id of ``sample_ids``, which
    number the held-out samples where ``held_out``)."""
    if classes is None or targets.is_floating_point() or targets.numel() == 0:
        return
    rows = targets.reshape(len(sample_ids), -1)
    bad = ((rows < 0) | (rows >= classes)).any(dim=1).nonzero()
    if len(bad) == 0:
        return
    row = int(bad[0])
    value = int(next(v for v in rows[row].tolist() if v < 0 or v >= classes))
    fix = ": class ids count from 0" if value < 0 else f", or widen the model's last layer to {value + 1} classes"
    raise ValueError(f"{'held-out' if held_out else 'training'} sample {int(sample_ids[row])} has class id {value}, "
                     f"outside the model's {classes} outputs (cross entropy takes 0..{classes - 1}): fix the targets "
                     f"the data gives (a torch Dataset's __getitem__, data.targets or data.transform){fix}")
