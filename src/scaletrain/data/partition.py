"""Pure functions that decide which samples each rank trains on at each step.

The plan is built around the *global* order of an epoch, not around per-rank streams:

- ``epoch_order(num_samples, seed, epoch, shard_sizes)`` is the order in which the whole job
  visits the samples of an epoch; it depends only on (seed, epoch) and the shard layout.
- A ``cursor`` counts the samples of that order already trained on (committed with the
  optimizer step that used them). Global step after global step takes the next
  ``batch_size x world_size`` samples from the cursor and splits them over the ranks so that
  counts differ by at most one.

Consequences:

- the samples of a step do not depend on the world size, so N workers with per-worker batch b
  see exactly what 1 worker with batch N*b sees;
- resuming is setting the cursor; changing the world size mid-epoch (N -> M) is re-planning
  ``order[cursor:]`` over M ranks: every sample is trained on exactly once per epoch;
- every rank can compute every rank's count for every step without communicating, which is
  what the sample-weighted gradient average needs (strategies/ddp.py);
- no sample is duplicated to pad ranks to equal length, as torch's DistributedSampler does.

When a step holds fewer samples than there are ranks (the end of an epoch, or after the world
grew), ranks beyond the step's count have nothing to train. Collectives still need them, so
such a rank reads the step's first sample and gives it weight zero (``num_samples`` 0): it
runs the step, contributes nothing, and nothing counts as trained twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def epoch_order(
    num_samples: int,
    seed: int,
    epoch: int,
    shard_sizes: Sequence[int] | None = None,
    window: int = 0,
) -> np.ndarray:
    """The order of all samples in one epoch; a pure function of its arguments.

    Without shards: a uniform permutation. With ``shard_sizes`` (consecutive index ranges),
    shard-aware: shards in random order, then samples shuffled inside consecutive windows of
    ``window`` samples (default: the largest shard), so reads stay mostly sequential.
    """
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    if not shard_sizes:
        return rng.permutation(num_samples)
    if sum(shard_sizes) != num_samples:
        raise ValueError(f"shard sizes add up to {sum(shard_sizes)}, not {num_samples} samples")
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]])
    order = np.concatenate(
        [
            np.arange(starts[s], starts[s] + shard_sizes[s])
            for s in rng.permutation(len(shard_sizes))
        ]
    )
    window = window or max(shard_sizes)
    for lo in range(0, num_samples, window):
        rng.shuffle(order[lo : lo + window])
    return order


def step_bounds(
    num_samples: int, global_batch: int, drop_last: bool, cursor: int = 0
) -> list[tuple[int, int]]:
    """[start, end) positions in the epoch order of each remaining global step."""
    if not 0 <= cursor <= num_samples:
        raise ValueError(f"cursor {cursor} is outside an epoch of {num_samples} samples")
    bounds = [
        (s, min(s + global_batch, num_samples)) for s in range(cursor, num_samples, global_batch)
    ]
    if drop_last and bounds and bounds[-1][1] - bounds[-1][0] < global_batch:
        bounds.pop()
    return bounds


def step_count(num_samples: int, global_batch: int, drop_last: bool, cursor: int = 0) -> int:
    """``len(step_bounds(...))`` without building the list: the loop asks for it at every
    step (the run's total steps), and an epoch of a large dataset has tens of thousands."""
    if not 0 <= cursor <= num_samples:
        raise ValueError(f"cursor {cursor} is outside an epoch of {num_samples} samples")
    left = num_samples - cursor
    return left // global_batch if drop_last else -(-left // global_batch)


def split_counts(count: int, world_size: int, shares: Sequence[float] | None = None) -> list[int]:
    """Split of one global step over the ranks. Equal by default: the first
    count % world_size ranks get one more. With ``shares`` (one weight per rank, --balance
    speed), in proportion to them: each rank its whole part, the samples left over by
    largest remainder (ties to the lower rank), so every rank computes the same split."""
    if shares is None:
        base, extra = divmod(count, world_size)
        return [base + (1 if r < extra else 0) for r in range(world_size)]
    if len(shares) != world_size or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(f"shares {list(shares)} do not fit a world of {world_size}")
    total = float(sum(shares))
    exact = [count * w / total for w in shares]
    counts = [int(x) for x in exact]
    left = count - sum(counts)
    by_remainder = sorted(range(world_size), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[:left]:
        counts[r] += 1
    return counts


def rank_slice(
    start: int, end: int, world_size: int, rank: int, shares: Sequence[float] | None = None
) -> tuple[int, int]:
    """This rank's contiguous [start, end) within one global step (empty when it has none)."""
    counts = split_counts(end - start, world_size, shares)
    lo = start + sum(counts[:rank])
    return lo, lo + counts[rank]


def rank_indices(
    order: np.ndarray,
    start: int,
    end: int,
    world_size: int,
    rank: int,
    shares: Sequence[float] | None = None,
) -> list[int]:
    """Sample ids this rank reads in one step. A rank with no sample of its own reads the
    step's first one, to be weighted zero (see the module docstring)."""
    lo, hi = rank_slice(start, end, world_size, rank, shares)
    return [int(i) for i in order[lo:hi]] if hi > lo else [int(order[start])]
