"""Local SGD: every worker trains its own replica and the replicas are averaged every H steps.

Communication drops by a factor of H against per-step gradient all-reduce, at the price of
replicas drifting apart in between (Stich 2019; Lin et al. 2020, "Don't use large mini-batches,
use local SGD"). Details:

- Averages are weighted by the samples each worker trained on since the last synchronization,
  so uneven batches (an epoch's last step, a weight-zero stand-in rank) count as they should.
  Weights and counts travel in one all-reduce: [n_r * params_r, n_r].
- Floating-point buffers (e.g. BatchNorm statistics) are averaged with the parameters.
- A rank whose share of a step is only a weight-zero stand-in sample skips its optimizer step.
- The period follows this strategy's own step counter, which checkpoints carry, so a resumed
  run synchronizes at the same steps as an uninterrupted one. ``finish`` synchronizes once
  more if the last period was cut short, so evaluation and the saved model see one model.
- Checkpoints hold rank 0's replica and optimizer state, and every rank saves its own
  replica, optimizer state and samples since the last synchronization beside it
  (``rank_state_dict``), so a restart between synchronizations continues every replica
  exactly. A rank without such a file (it joined later) starts from rank 0's.

Subclasses change what a synchronization does (diloco.py) through ``synchronize``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.metrics.timers import sent_bytes
from scaletrain.strategies.base import (
    Batch,
    LossFn,
    OptimizerFactory,
    StepResult,
    Strategy,
    replica_memory,
)


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def local_step(strategy: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
    """One replica's own step (local SGD, DiLoCo, in place or not): its gradient, its
    optimizer's step, its samples since the last synchronization counted. A replica with no
    sample of its own (a stand-in) does not step; --clip-grad-norm clips its own gradient.
    (The loss, what the optimizer's step reports.)"""
    strategy.optimizer.zero_grad(set_to_none=True)
    loss = strategy.forward_backward(
        strategy.module, strategy.loss_fn, batch.inputs, batch.targets, batch.num_samples
    )
    extras: dict[str, Any] = {}
    if batch.num_samples:
        extras = strategy.step_optimizer(strategy.optimizer, strategy.module.parameters())
    strategy.samples_since_sync += batch.num_samples
    return loss, extras


class LocalSGDStrategy(Strategy):
    collective = "parameter averaging (every --sync-every steps)"
    holds_replica = True

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        self.module = model
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)  # one starting point, even for unseeded models
        self.optimizer = build_optimizer(model.parameters())
        self.loss_fn = loss_fn
        self.sync_every = self.cfg.comm.sync_every
        self.local_steps = 0  # steps taken since training began (checkpointed)
        self.samples_since_sync = 0

    @property
    def model(self) -> nn.Module:
        return self.module

    def memory_bytes(self) -> dict[str, int]:
        return replica_memory(self.module, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "local_steps": self.local_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.local_steps = state["local_steps"]
        self.samples_since_sync = 0

    def rank_state_dict(self) -> dict[str, Any] | None:
        return {**self.state_dict(), "samples_since_sync": self.samples_since_sync}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self.samples_since_sync = state["samples_since_sync"]

    def train_step(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        loss, extras = local_step(self, batch)
        self.local_steps += 1
        comm_s, nbytes = 0.0, 0
        if self.local_steps % self.sync_every == 0:
            comm_s, nbytes = self._timed_sync()
        return StepResult(
            loss=loss,
            compute_s=time.perf_counter() - start - comm_s,
            comm_s=comm_s,
            wait_s=comm_s,  # synchronization blocks; nothing overlaps it
            comm_bytes=nbytes,
            extras={"synced": bool(nbytes), **extras},
        )

    def finish(self) -> None:
        if self.local_steps % self.sync_every:
            self._timed_sync()

    @property
    def in_sync(self) -> bool:
        """Whether the replicas are one model now (just synchronized, or not yet trained)."""
        return self.local_steps % self.sync_every == 0

    def eval_model(self) -> nn.Module:
        """--eval-every between synchronizations: the replicas have drifted apart, and slices
        of the test split scored each by its own rank's replica would add up to a figure of
        no model. Every rank scores the model a synchronization now would give, a copy (one
        all-reduce; training goes on from each rank's own replica)."""
        if self.in_sync:
            return self.module
        averaged = copy.deepcopy(self.module)
        self.weighted_average(
            [*averaged.parameters(), *float_buffers(averaged)], self.samples_since_sync
        )
        return averaged

    def _timed_sync(self) -> tuple[float, int]:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        started = time.perf_counter()
        payload_bytes = self.synchronize(self.samples_since_sync)
        self.samples_since_sync = 0
        return time.perf_counter() - started, sent_bytes(
            "all_reduce", payload_bytes, self.ctx.world_size
        )

    def weighted_average(self, tensors: list[torch.Tensor], num_samples: int) -> int:
        """Replace each tensor by its sample-weighted average over ranks, in one all-reduce.
        Returns the payload's bytes."""
        weight = float(num_samples)
        flat = torch.cat([t.detach().reshape(-1).float() * weight for t in tensors])
        payload = torch.cat([flat, flat.new_tensor([weight])])
        dist.all_reduce(payload)
        total = payload[-1]
        if total <= 0:  # no rank trained since the last synchronization: nothing to average
            return payload.numel() * payload.element_size()
        offset = 0
        for t in tensors:
            t.data.copy_((payload[offset : offset + t.numel()] / total).view_as(t))
            offset += t.numel()
        return payload.numel() * payload.element_size()

    def synchronize(self, num_samples: int) -> int:
        """Average parameters and float buffers; returns the bytes this rank handed over."""
        return self.weighted_average(
            [*self.module.parameters(), *float_buffers(self.module)], num_samples
        )
