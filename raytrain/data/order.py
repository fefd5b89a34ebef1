"""The global sample order and its division among replicas: pure arithmetic, imported by the coordinator.

Invariant (ARCHITECTURE.md: every sample exactly once per epoch): the order of samples is a pure
function of (seed, epoch); step s consumes global positions [s*B, (s+1)*B), and each data-parallel
replica takes a contiguous slice of them. So every sample is seen exactly once per epoch whatever
the layout, and a resumed run needs only the step number to continue where it stopped.

A resume that accepted changed data (data.new_epoch_on_change) restarts the numbering instead of
continuing the checkpoint's epoch over other samples: from its ``origin`` = (position, epoch) on, position
p is offset (p - position) % N of epoch ``epoch + (p - position) // N``. The run never goes back before its
origin (it resumed after it), and the origin's epoch is one no position before it used.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

NO_RESTART = (0, 0)
"""The origin of a run whose order was never restarted: position 0 is epoch 0's first."""


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The permutation of sample ids for one epoch: a pure function of (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_ids(seed: int, num_samples: int, start: int, stop: int,
               origin: Sequence[int] = NO_RESTART) -> list[int]:
    """Sample ids at global positions [start, stop), none before ``origin``'s position; positions run on
    across epochs, numbered from ``origin`` = (position, epoch)."""
    first, first_epoch = origin
    assert start >= first, (start, origin)
    ids = []
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos - first, num_samples)
        take = min(stop - pos, num_samples - offset)
        ids.extend(epoch_order(seed, first_epoch + epoch, num_samples)[offset : offset + take].tolist())
        pos += take
    return ids


def next_epoch(origin: Sequence[int], num_samples: int, position: int) -> int:
    """The first epoch that no position before ``position`` began, in an order of ``num_samples`` samples
    numbered from ``origin``: the epoch a restart at ``position`` takes, so that its permutation and its
    samples' seeds are new."""
    first, first_epoch = origin
    return first_epoch + -(-(position - first) // num_samples)


def replica_slices(global_batch: int, shares: Sequence[int]) -> list[tuple[int, int]]:
    """Offsets [begin, end) within a step's global batch for each replica, contiguous and in order."""
    assert sum(shares) == global_batch, (shares, global_batch)
    bounds = np.cumsum([0, *shares]).tolist()
    return [(bounds[r], bounds[r + 1]) for r in range(len(shares))]


def even_shares(global_batch: int, num_replicas: int) -> list[int]:
    base, extra = divmod(global_batch, num_replicas)
    return [base + (1 if r < extra else 0) for r in range(num_replicas)]


def step_positions(step: int, global_batch: int, begin: int, end: int) -> tuple[int, int]:
    """Global positions a replica with batch offsets [begin, end) consumes at ``step``."""
    return step * global_batch + begin, step * global_batch + end


def microbatch_bounds(count: int, num_microbatches: int) -> list[tuple[int, int]]:
    sizes = even_shares(count, num_microbatches)
    bounds = np.cumsum([0, *sizes]).tolist()
    return [(bounds[i], bounds[i + 1]) for i in range(num_microbatches)]



HELD_OUT_EPOCH = 2**32 - 1
"""The epoch a held-out row's seed is drawn for: apart from every training epoch, the same at every evaluation."""


def sample_seeds(seed: int, ids: Sequence[int], epochs: Sequence[int]) -> np.ndarray:
    """A 64-bit seed per sample, a pure function of (train.seed, epoch, sample id) (splitmix64 of the three):
    what data.transform and a dataset's random augmentations draw from, so every layout and every resize
    sees the same pixels, and each epoch new ones."""
    with np.errstate(over="ignore"):  # multiplication modulo 2**64 is the mix
        mixed = np.asarray(ids, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        mixed ^= (np.asarray(epochs, dtype=np.uint64) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
        mixed ^= np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x94D049BB133111EB)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            mixed = (mixed ^ (mixed >> np.uint64(shift))) * np.uint64(factor)
        return mixed ^ (mixed >> np.uint64(31))


def position_epochs(num_samples: int, start: int, stop: int, origin: Sequence[int] = NO_RESTART) -> np.ndarray:
    """The epoch of each global position in [start, stop) (positions run on across epochs, from ``origin``)."""
    first, first_epoch = origin
    return first_epoch + (np.arange(start, stop, dtype=np.int64) - first) // num_samples
