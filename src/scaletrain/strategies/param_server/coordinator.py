"""Who trains on which samples, under a parameter server: leases dealt from the epoch order.

Pure bookkeeping, no communication: server 0 holds one ``DataCoordinator`` and deals it out in
its replies (server.py). Workers do not run in lockstep under asp/ssp, so a fixed per-rank
split (data/sampler.py) would leave fast workers idle while a slow one finishes its share:
instead every worker *leases* its next batch when it pushes its last gradient.

- The epoch's order is ``partition.epoch_order`` (the same as every other strategy). A lease
  takes the next positions of that order: ``batch_size`` of them (asp, ssp), or, under bsp, one
  global step of ``batch_size x participants`` split over the participants in worker order,
  exactly as ``partition.rank_slice`` splits a data-parallel step (so bsp sees the same
  batches as ddp).
- A lease is *committed* when server 0 applies the gradient computed on it, and only then do
  its samples count as trained. When its worker dies (or is dropped from a bsp barrier) the
  lease is *requeued*: its positions are dealt again before any new ones of that epoch.
  Every sample is trained on exactly once per epoch, also across failures.
- Under asp/ssp the next epoch may start while leases of the last one are still out: a
  requeued position of an older epoch is dealt before anything newer.
- ``max_steps`` caps the run as it caps a data-parallel run: at that many global steps
  under bsp; under asp/ssp, where there are no global steps, at their samples
  (``max_steps x batch_size x num_workers``), to which a requeued lease gives its samples
  back, so the run still ends with them trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scaletrain.data.partition import epoch_order, split_counts


@dataclass(frozen=True, kw_only=True)
class Lease:
    epoch: int
    step: int  # bsp: the global step; asp/ssp: the lease's serial number
    positions: tuple[int, ...]  # positions in the epoch's order
    indices: tuple[int, ...]  # the dataset indices at those positions


@dataclass(kw_only=True)
class _Epoch:
    cursor: int = 0
    requeued: list[int] = field(default_factory=list)
    outstanding: int = 0  # leases of this epoch dealt and neither committed nor requeued


class DataCoordinator:
    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        epochs: int,
        seed: int,
        drop_last: bool,
        num_workers: int,
        lockstep: bool,
        max_steps: int = 0,
        shard_sizes: list[int] | None = None,
    ) -> None:
        self.num_samples, self.batch_size, self.epochs = num_samples, batch_size, epochs
        self.seed, self.drop_last, self.num_workers = seed, drop_last, num_workers
        self.max_steps, self.shard_sizes = max_steps, shard_sizes
        self.lockstep = lockstep  # bsp: deal_step for all at once; asp/ssp: deal per worker
        self.epoch_state: dict[int, _Epoch] = {0: _Epoch()}
        self.leases: dict[int, Lease] = {}  # worker -> its lease out
        self.steps_dealt = 0  # bsp global steps, or asp/ssp leases
        self.samples_trained = 0
        self._orders: dict[int, np.ndarray] = {}

    # -- what is left --------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.num_samples, self.seed, epoch,
                                               self.shard_sizes)}  # fmt: skip
        return self._orders[epoch]

    def _fresh_left(self, state: _Epoch) -> int:
        left = self.num_samples - state.cursor
        # drop_last: an incomplete batch at the end of the epoch order is never dealt.
        return 0 if self.drop_last and left < self.batch_size else left

    def _available(self, epoch: int) -> int:
        state = self.epoch_state[epoch]
        return len(state.requeued) + self._fresh_left(state)

    def _budget_left(self) -> int:
        """Samples that may still be dealt under --max-steps (a large number without it)."""
        if not self.max_steps:
            return self.num_samples * self.epochs
        if self.lockstep:
            return self.num_samples if self.steps_dealt < self.max_steps else 0
        out = sum(len(lease.positions) for lease in self.leases.values())
        budget = self.max_steps * self.batch_size * self.num_workers
        return budget - self.samples_trained - out

    def _dealing_epoch(self) -> int | None:
        """The oldest epoch with samples to deal, opening the next epoch when the newest has
        dealt all of its own; None when nothing is left to deal now."""
        for epoch in sorted(self.epoch_state):
            if self._available(epoch):
                return epoch
        newest = max(self.epoch_state)
        if newest + 1 < self.epochs:
            self.epoch_state[newest + 1] = _Epoch()
            self._retire()
            return newest + 1 if self._available(newest + 1) else None
        return None

    def _retire(self) -> None:
        """Forget epochs that are finished: nothing to deal and nothing out."""
        for epoch in sorted(self.epoch_state)[:-1]:
            state = self.epoch_state[epoch]
            if not self._available(epoch) and not state.outstanding:
                del self.epoch_state[epoch]

    def finished(self) -> bool:
        """Nothing left to deal and no lease out: the run is over."""
        if self.leases:
            return False
        return self._budget_left() <= 0 or self._dealing_epoch() is None

    @property
    def epoch(self) -> int:
        """The oldest epoch not finished (what progress reports)."""
        return min(self.epoch_state)

    # -- dealing -------------------------------------------------------------------------
    def _take(self, epoch: int, count: int) -> list[int]:
        if not self.lockstep:  # bsp's budget is in steps, checked before the step is dealt
            count = min(count, self._budget_left())
        state = self.epoch_state[epoch]
        taken = state.requeued[:count]
        del state.requeued[:count]
        fresh = min(count - len(taken), self._fresh_left(state))
        taken += range(state.cursor, state.cursor + fresh)
        state.cursor += fresh
        return taken

    def _lease(self, worker: int, epoch: int, step: int, positions: list[int]) -> Lease:
        order = self.order(epoch)
        lease = Lease(epoch=epoch, step=step, positions=tuple(positions),
                      indices=tuple(int(order[p]) for p in positions))  # fmt: skip
        if positions:
            self.epoch_state[epoch].outstanding += 1
            self.leases[worker] = lease
        return lease

    def _next_step(self) -> int | None:
        """Count one more step (or lease) and return the epoch it deals from; None when the
        budget is spent or nothing is left to deal now."""
        if self._budget_left() <= 0:
            return None
        epoch = self._dealing_epoch()
        if epoch is not None:
            self.steps_dealt += 1
        return epoch

    def deal(self, worker: int) -> Lease | None:
        """asp/ssp: the next batch for ``worker``; None when nothing can be dealt now (the
        run is over when ``finished()``, else a lease still out may yet be requeued)."""
        assert not self.lockstep and worker not in self.leases, worker
        epoch = self._next_step()
        if epoch is None:
            return None
        return self._lease(worker, epoch, self.steps_dealt, self._take(epoch, self.batch_size))

    def deal_step(self, workers: list[int]) -> dict[int, Lease] | None:
        """bsp: one global step over ``workers`` (in worker order; a worker may get no
        samples at the end of an epoch); None when the run is over."""
        assert self.lockstep
        epoch = self._next_step()
        if epoch is None:
            return None
        ordered = sorted(workers)
        positions = self._take(epoch, self.batch_size * len(ordered))
        counts = split_counts(len(positions), len(ordered))
        leases, offset = {}, 0
        for worker, count in zip(ordered, counts, strict=True):
            leases[worker] = self._lease(worker, epoch, self.steps_dealt,
                                         positions[offset : offset + count])  # fmt: skip
            offset += count
        return leases

    # -- outcomes ------------------------------------------------------------------------
    def commit(self, worker: int) -> int:
        """The gradient of ``worker``'s lease was applied: its samples are trained."""
        lease = self.leases.pop(worker, None)
        if lease is None:
            return 0
        self.epoch_state[lease.epoch].outstanding -= 1
        self.samples_trained += len(lease.positions)
        self._retire()
        return len(lease.positions)

    def requeue(self, worker: int) -> int:
        """``worker`` died or was dropped: its lease is dealt again, first."""
        lease = self.leases.pop(worker, None)
        if lease is None:
            return 0
        state = self.epoch_state[lease.epoch]
        state.outstanding -= 1
        state.requeued[:0] = lease.positions
        return len(lease.positions)

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Leases out at save time are saved as requeued: whoever held them reconnects to a
        restored server 0 with nothing applied, and is dealt afresh."""
        epochs = {}
        for epoch, state in self.epoch_state.items():
            out = [p for lease in self.leases.values() if lease.epoch == epoch
                   for p in lease.positions]  # fmt: skip
            epochs[epoch] = {"cursor": state.cursor, "requeued": out + state.requeued}
        return {
            "epochs": epochs,
            "steps_dealt": self.steps_dealt,
            "samples_trained": self.samples_trained,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_state = {
            int(e): _Epoch(cursor=s["cursor"], requeued=list(s["requeued"]))
            for e, s in state["epochs"].items()
        }
        self.leases = {}
        self.steps_dealt = state["steps_dealt"]
        self.samples_trained = state["samples_trained"]

    # -- replication (replica.py) --------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The whole state, leases out included as they are (a checkpoint saves them as
        requeued): what a backup needs for its server 0 to go on where this one stopped,
        the workers holding those leases still training on them. JSON-able."""
        return {
            "epochs": {
                str(e): [s.cursor, list(s.requeued), s.outstanding]
                for e, s in self.epoch_state.items()
            },
            "leases": {
                str(w): [lease.epoch, lease.step, list(lease.positions)]
                for w, lease in self.leases.items()
            },
            "steps_dealt": self.steps_dealt,
            "samples_trained": self.samples_trained,
        }

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        self.epoch_state = {
            int(e): _Epoch(cursor=c, requeued=list(r), outstanding=o)
            for e, (c, r, o) in snap["epochs"].items()
        }
        self.leases = {int(w): self.lease_of(*held) for w, held in snap["leases"].items()}
        self.steps_dealt = snap["steps_dealt"]
        self.samples_trained = snap["samples_trained"]

    def lease_of(self, epoch: int, step: int, positions: list[int]) -> Lease:
        """The lease of those positions of ``epoch``'s order (as a snapshot names it)."""
        order = self.order(epoch)
        return Lease(epoch=epoch, step=step, positions=tuple(positions),
                     indices=tuple(int(order[p]) for p in positions))  # fmt: skip
