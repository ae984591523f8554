"""Batch sampler that follows the global-step plan of ``partition.py``.

It stands in for torch's DistributedSampler, which pads ranks to equal length by
duplicating samples; here every sample of an epoch is used exactly once and ranks' counts in a
step differ by at most one. It is a torch ``Sampler`` of index lists, so it plugs into a
standard ``DataLoader(batch_sampler=...)``. Mid-epoch resume and elastic re-partitioning are
the data-sharding issue's work; this sampler only knows whole epochs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from scaletrain.data import partition


class GlobalBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        num_samples: int,
        *,
        world_size: int,
        rank: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.bounds = partition.step_bounds(
            num_samples, batch_size * world_size, world_size, drop_last
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.bounds)

    def global_counts(self) -> list[int]:
        """Samples in each global step, over all ranks (the weights' denominators)."""
        return [end - start for start, end in self.bounds]

    def __iter__(self) -> Iterator[list[int]]:
        order = (
            partition.epoch_permutation(self.num_samples, self.seed, self.epoch)
            if self.shuffle
            else np.arange(self.num_samples)
        )
        for start, end in self.bounds:
            lo, hi = partition.rank_slice(start, end, self.world_size, self.rank)
            yield [int(i) for i in order[lo:hi]]
