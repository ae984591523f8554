"""Batch sampler over the global-step plan of ``partition.py``: resumable and elastic.

It stands in for torch's DistributedSampler, which pads ranks to equal length by duplicating
samples and cannot resume mid-epoch. Its state is (epoch, cursor): the cursor is the number of
samples of the epoch's order already trained on, advanced by ``commit`` once the optimizer step
that used them has been applied, never when they are merely loaded. Restoring the state with
``load_state_dict`` resumes at exactly the next sample, under the same or another world size:
the unconsumed rest of the epoch is split over whatever ranks there are now. It implements
torch's ``Stateful`` protocol (state_dict / load_state_dict), so DCP can save it.

It is a torch ``Sampler`` of index lists, for ``DataLoader(batch_sampler=...)``. The loader
asks for the plan when an iteration starts, so a cursor restored before ``iter(loader)`` is
honoured.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

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
        shard_sizes: Sequence[int] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if num_samples < 1:
            raise ValueError("the training dataset is empty")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.batch_size = batch_size
        self.global_batch = batch_size * world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.shard_sizes = list(shard_sizes) if shard_sizes else None
        self.epoch = 0
        self.cursor = 0
        # --balance speed: each rank's weight in a step's split (None: equal shares).
        self.shares: list[float] | None = None
        if not partition.step_count(num_samples, self.global_batch, drop_last):
            raise ValueError(
                f"drop_last with {num_samples} samples and a global batch of {self.global_batch} "
                "leaves no step; lower the batch size or turn drop_last off"
            )

    def resize(self, world_size: int, rank: int) -> None:
        """Plan the rest of the epoch over ``world_size`` ranks, this one ``rank``: in-place
        recovery calls it at every step with that step's membership, keeping the per-worker
        batch (the global batch follows the number of workers)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.world_size, self.rank = world_size, rank
        self.global_batch = self.batch_size * world_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless a restored state is already inside it."""
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0

    def bounds(self) -> list[tuple[int, int]]:
        """The remaining global steps of this epoch, as [start, end) positions in its order."""
        return partition.step_bounds(
            self.num_samples, self.global_batch, self.drop_last, self.cursor
        )

    def __len__(self) -> int:
        """The remaining global steps of this epoch."""
        return partition.step_count(
            self.num_samples, self.global_batch, self.drop_last, self.cursor
        )

    def next_bounds(self) -> tuple[int, int] | None:
        """The next global step's [start, end), None when the epoch has no step left."""
        if not len(self):
            return None
        return self.cursor, min(self.cursor + self.global_batch, self.num_samples)

    def steps_per_epoch(self) -> int:
        return partition.step_count(self.num_samples, self.global_batch, self.drop_last)

    def global_counts(self) -> list[int]:
        """Samples in each remaining global step, over all ranks (the weights' denominators)."""
        return [end - start for start, end in self.bounds()]

    def order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return partition.epoch_order(self.num_samples, self.seed, self.epoch, self.shard_sizes)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for start, end in self.bounds():  # the shares as they are when each step is read
            yield partition.rank_indices(order, start, end, self.world_size, self.rank,
                                         self.shares)  # fmt: skip

    def commit(self, global_samples: int) -> None:
        """The step that trained on the next ``global_samples`` samples has been applied."""
        self.cursor += global_samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shares": self.shares,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state is for {key}={state[key]}, this run has {getattr(self, key)}"
                )
        if not 0 <= state["cursor"] <= self.num_samples:
            raise ValueError(f"sampler state has cursor {state['cursor']} outside the epoch")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        shares = state.get("shares")
        # Shares fit the world that planned them; a resized world starts equal again.
        self.shares = list(shares) if shares and len(shares) == self.world_size else None
