"""Pure functions that decide which samples each rank trains on at each step.

The plan is built around the *global* step, not around per-rank streams: global step t of
an epoch covers a contiguous slice of the epoch's permutation, and that slice is split over
the ranks so that counts differ by at most one. Consequences:

- the set of samples in step t does not depend on the world size, so N workers with
  per-worker batch b see exactly what 1 worker with batch N*b sees;
- every rank can compute every rank's sample count for every step without communicating,
  which is what the sample-weighted gradient average needs (see strategies/ddp.py);
- no sample is duplicated to pad ranks to equal length (torch's DistributedSampler does).

A rank with zero samples in a step would still have to join that step's collectives with
an empty batch, which many models (BatchNorm) cannot run. So when the last global batch of an
epoch holds fewer samples than there are ranks, it is merged into the step before it (that
step is then at most world_size - 1 samples larger). With ``drop_last`` the incomplete last
batch is dropped instead.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of all samples in one epoch; depends only on (seed, epoch)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(num_samples)


def step_bounds(
    num_samples: int, global_batch: int, world_size: int, drop_last: bool
) -> list[tuple[int, int]]:
    """[start, end) offsets into the epoch permutation, one pair per global step."""
    if num_samples < world_size:
        raise ValueError(
            f"the dataset has {num_samples} samples, fewer than the {world_size} workers"
        )
    full, rest = divmod(num_samples, global_batch)
    bounds = [(i * global_batch, (i + 1) * global_batch) for i in range(full)]
    if rest and not drop_last:
        if rest >= world_size or not bounds:
            bounds.append((full * global_batch, num_samples))
        else:
            start, _ = bounds.pop()
            bounds.append((start, num_samples))
    if not bounds:
        raise ValueError(
            f"drop_last with {num_samples} samples and a global batch of {global_batch} "
            "leaves no step; lower the batch size or turn drop_last off"
        )
    return bounds


def split_counts(count: int, world_size: int) -> list[int]:
    """Balanced split of one global step: the first count % world_size ranks get one more."""
    base, extra = divmod(count, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def rank_slice(start: int, end: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous [start, end) within one global step."""
    counts = split_counts(end - start, world_size)
    lo = start + sum(counts[:rank])
    return lo, lo + counts[rank]
