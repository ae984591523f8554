"""Batch plans: which samples each rank trains at each step, and when they count as consumed.

The training loop (trainer.py) asks its plan for the next step, loads what the plan says,
hands it to the strategy, and tells the plan when the step was applied. Where the samples
come from is what differs between modes, and it is all here or in the plans the strategies
bring:

- ``SamplerPlan`` (every strategy of the restart mode): the sampler's global-step plan
  (sampler.py, partition.py) over the data-parallel ranks, read through one DataLoader per
  epoch (which prefetches).
- In-place recovery's quorum plan (strategies/inplace.py): the same sampler, re-planned at
  every step over that step's quorum.
- The parameter server's lease plan (strategies/param_server/worker.py): the batch server 0
  leased to this worker.

A plan's state (``state_dict``) goes into checkpoints and into the state a healing replica
copies, with the loop's progress, so every sample is trained exactly once per epoch also
across failures.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from scaletrain.data.loading import make_loader, to_device
from scaletrain.data.partition import rank_indices, split_counts
from scaletrain.data.sampler import GlobalBatchSampler


@dataclass(kw_only=True)
class StepPlan:
    """One step as the plan deals it to this rank. ``step``: the number its record carries;
    ``indices``: this rank's sample ids (a rank without a share of its own holds one
    zero-weight stand-in); ``num_samples``: its share; ``global_samples``: the step's samples
    over all ranks (the weights' denominator). ``wait_s``: time the plan waited before it
    could deal the step (a quorum); ``extras`` go into the step's record."""

    step: int
    epoch: int
    indices: list[int]
    num_samples: int
    global_samples: int
    wait_s: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


class RunEnded(Exception):
    """The job finished without this process: a replica restarted after the others had
    finished has nothing to train and nothing to report."""


class BatchPlan(ABC):
    """``next_step`` deals the next step (None: training is over); ``load`` reads it;
    ``commit`` is called once the step is applied, never before."""

    @abstractmethod
    def next_step(self, progress: Any) -> StepPlan | None:
        """The step after ``progress`` (the loop's step, epoch, samples trained)."""

    @abstractmethod
    def load(self, plan: StepPlan) -> tuple[Any, Any]:
        """This rank's (inputs, targets) of ``plan``, on the device."""

    @abstractmethod
    def commit(self, plan: StepPlan) -> None:
        """``plan``'s step is applied: its samples are consumed."""

    @abstractmethod
    def total_steps(self, progress: Any) -> int:
        """The step the run ends at, as planned now (it may change with the membership)."""

    def steps_per_epoch(self) -> int:
        return 0

    def shares(self) -> list[float] | None:
        """Each rank's weight in a step's split (--balance speed); None: even."""
        return None

    def offer_rate(self, rate: float) -> bool:
        """--balance speed: this rank's rate over the last window. True: the plan shares the
        ranks' rates itself; False (here): the loop gathers them."""
        return False

    def set_shares(self, shares: list[float]) -> None:
        raise NotImplementedError(f"{type(self).__name__} splits no step by shares")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def load_indices(
    dataset: Dataset[Any], indices: list[int], device: torch.device
) -> tuple[Any, Any]:
    """The samples ``indices`` of ``dataset`` as one batch on ``device``."""
    loader = make_loader(
        Subset(dataset, indices), cuda=device.type == "cuda", batch_size=len(indices)
    )
    inputs, targets = next(iter(loader))
    return to_device(inputs, device), to_device(targets, device)


def build_sampler(dataset: Any, cfg: Any, *, world_size: int, rank: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        len(dataset),
        world_size=world_size,
        rank=rank,
        batch_size=cfg.samples_per_step,
        seed=cfg.train.seed,
        drop_last=cfg.train.drop_last,
        shard_sizes=getattr(dataset, "shard_sizes", None),
    )


class SampledPlan(BatchPlan):
    """A plan that deals the sampler's global steps (sampler.py): its state is the sampler's
    (epoch, cursor), which a committed step advances."""

    sampler: GlobalBatchSampler
    cfg: Any

    def remaining(self) -> int:
        """Steps of the current epoch not dealt yet."""
        return len(self.sampler)

    def total_steps(self, progress: Any) -> int:
        """The rest of the current epoch under this world size, then whole epochs, capped by
        --max-steps."""
        later = self.cfg.train.epochs - self.sampler.epoch - 1
        steps = progress.step + self.remaining() + later * self.sampler.steps_per_epoch()
        max_steps = self.cfg.train.max_steps
        return min(steps, max_steps) if max_steps else steps

    def commit(self, plan: StepPlan) -> None:
        self.sampler.commit(plan.global_samples)

    def shares(self) -> list[float] | None:
        return self.sampler.shares

    def set_shares(self, shares: list[float]) -> None:
        """From the next step dealt on (every rank the same, at the same step)."""
        self.sampler.shares = list(shares)

    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class SamplerPlan(SampledPlan):
    """The sampler's plan over a fixed set of data-parallel ranks (the ranks of one pipeline
    or tensor-parallel group share a data rank, and so a batch)."""

    def __init__(
        self, dataset: Any, cfg: Any, *, data_rank: int, data_world_size: int, device: torch.device
    ) -> None:
        self.cfg, self.rank, self.world = cfg, data_rank, data_world_size
        self.sampler = build_sampler(dataset, cfg, world_size=data_world_size, rank=data_rank)
        self.loader = make_loader(dataset, cuda=device.type == "cuda", batch_sampler=self.sampler)
        self.device = device
        self._epoch: int | None = None  # the epoch self._batches iterates
        self._batches: Iterator[Any] = iter(())
        self._bounds: collections.deque[tuple[int, int]] = collections.deque()
        self._dealt = 0  # steps dealt and not committed yet (0 or 1): still to be trained

    def _start_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self._epoch, self._bounds = epoch, collections.deque(self.sampler.bounds())
        self._order = self.sampler.order()
        # The loader asks the sampler for its plan now, so a restored cursor is honoured.
        self._batches = iter(self.loader)

    def next_step(self, progress: Any) -> StepPlan | None:
        """The sampler's epoch and cursor are the truth (a checkpoint restores them with the
        progress); an epoch whose steps are all dealt gives way to the next."""
        if progress.step >= self.total_steps(progress):
            return None
        while self._epoch is None or not self._bounds:
            epoch = self.sampler.epoch if self._epoch is None else self._epoch + 1
            if epoch >= self.cfg.train.epochs:
                return None
            self._start_epoch(epoch)
        start, end = self._bounds.popleft()
        self._dealt = 1
        shares = self.sampler.shares
        return StepPlan(
            step=progress.step + 1,
            epoch=self.sampler.epoch,
            indices=rank_indices(self._order, start, end, self.world, self.rank, shares),
            num_samples=split_counts(end - start, self.world, shares)[self.rank],
            extras={"share": shares[self.rank] / sum(shares)} if shares else {},
            global_samples=end - start,
        )

    def load(self, plan: StepPlan) -> tuple[Any, Any]:
        inputs, targets = next(self._batches)
        return to_device(inputs, self.device), to_device(targets, self.device)

    def commit(self, plan: StepPlan) -> None:
        super().commit(plan)
        self._dealt = 0

    def remaining(self) -> int:
        if self._epoch is None:
            return len(self.sampler)
        return len(self._bounds) + self._dealt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._epoch = None  # the next step re-plans the restored epoch from its cursor
