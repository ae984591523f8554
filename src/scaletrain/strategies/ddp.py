"""Synchronous data parallelism on torch's DistributedDataParallel (gloo on CPU, NCCL on GPU).

Gradient semantics. Plain DDP all-reduces gradients and divides by the world size, which is the
gradient of the mean loss over all samples only when every rank holds the same number of
samples. Here ranks may differ (the last batch of an epoch, uneven splits), so each rank scales
its local mean loss by ``n_r * W / N`` before backward (n_r: its samples, N: the step's samples
over all ranks, known to every rank from the sampler's plan, so no extra collective is needed).
DDP's division by W then yields ``sum_r n_r * grad_r / N``: the gradient of the mean over all N
samples. When all ranks hold N / W samples the scale is exactly 1 and is skipped, so the common
case is bit-for-bit plain DDP. Scaling the loss (rather than weighting inside a comm hook) keeps
the weighting independent of whatever hook carries the gradients.

Communication. Gradients travel through our own DDP comm hooks (compression/hook.py): plain
all-reduce, or ``--compression NAME`` (fp16, bf16, top-k, PowerSGD, sign), each bucket's
collectives timed from launch to completion and their bytes counted (metrics/timers.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletrain.compression import build_compressor
from scaletrain.compression.hook import HookState, compressed_hook, timed_allreduce_hook
from scaletrain.metrics.timers import CommTimer
from scaletrain.strategies.base import (
    Batch,
    LossFn,
    OptimizerFactory,
    StepResult,
    Strategy,
    replica_memory,
)


class DDPStrategy(Strategy):
    supports_compression = True
    supports_fp16 = True  # every replica holds the same gradients after the all-reduce
    holds_replica = True

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.cfg.comm.bucket_mb,
            gradient_as_bucket_view=True,
        )
        self.timer = CommTimer()
        compressor = build_compressor(self.cfg.comm.compression, self.ctx.world_size)
        state = HookState(
            self.timer, self.ctx.world_size, compressor, ordered=self.cfg.train.deterministic
        )
        hook = timed_allreduce_hook if compressor is None else compressed_hook
        # One process has nothing to communicate: DDP's own C++ path (no Python callback on
        # the backend's thread, which cost a 1-worker step about 1%) and comm_s 0, as it is.
        if self.ctx.world_size > 1 or compressor is not None:
            self.ddp.register_comm_hook(state, hook)
        self.optimizer = build_optimizer(self.ddp.parameters())
        self.loss_fn = loss_fn

    @property
    def model(self) -> nn.Module:
        return self.ddp.module

    def memory_bytes(self) -> dict[str, int]:
        return replica_memory(self.ddp.module, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.ddp.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ddp.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def _sync_device(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.ddp.no_sync()

    def train_step(self, batch: Batch) -> StepResult:
        start = self.timer.now()
        self.optimizer.zero_grad(set_to_none=True)
        scale = batch.num_samples * self.ctx.world_size / batch.global_samples
        loss = self.forward_backward(
            self.ddp, self.loss_fn, batch.inputs, batch.targets, batch.num_samples, scale
        )
        self._sync_device()
        backward_end = self.timer.now()
        extras = self.step_optimizer(self.optimizer, self.ddp.parameters())
        self._sync_device()
        end = self.timer.now()
        comm = self.timer.collect()
        # Blocked: inside backward on a blocking round (multi-round compressors), then from the
        # last bucket's launch until its collective completed.
        blocked = comm.blocked_s + (
            max(0.0, min(backward_end, comm.last_end) - comm.last_launch)
            if comm.num_collectives
            else 0.0
        )
        return StepResult(
            loss=loss,
            compute_s=(end - start) - blocked,
            comm_s=comm.busy_s,
            wait_s=blocked,
            comm_bytes=comm.bytes,
            dense_bytes=comm.dense_bytes,
            extras={"collectives": comm.num_collectives, **extras},
        )
