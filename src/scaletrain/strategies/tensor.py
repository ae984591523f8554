"""Tensor parallelism on DTensor (``parallelize_module``): each weight matrix the model's plan
names is split over a group of ``--tp`` ranks, Megatron-style: column-split layers give each
rank a slice of the outputs (a share of the attention heads, of the MLP's hidden units),
row-split layers take those slices and all-reduce their partial outputs. Activations between
blocks are whole on every rank of the group; the group sees one batch together.

Layout: a (data parallel D) x (tensor parallel T) mesh, W = D x T; the T ranks of a group are
consecutive (on one host, where their per-layer all-reduces are cheapest). With D > 1 the
groups are replicas: ``--strategy tensor`` averages gradients over "dp" (an all-reduce of
each rank's local shards, weighted by samples, timed as communication), and ``--strategy fsdp
--tp T`` shards them over "dp" instead (the mesh and the split are dtensor.py's, shared
with fsdp.py).

The model must say how to split itself: a ``tensor_parallel_plan()`` method that returns
{module name: ColwiseParallel() | RowwiseParallel()} (the built-in transformer has one), and
optionally ``tensor_parallel_divisors()``: {what: size} that T must divide, checked before
any worker starts, with every planned layer's split dimension.

State is DTensors: checkpoints through DCP (resharded on load), the final replica gathered as
in fsdp.py. Communication bytes: each row-split layer all-reduces its output forward and the
matching column-split input gradient backward, both the size of the layer's output.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import RunConfig
from scaletrain.metrics.timers import sent_bytes
from scaletrain.strategies.base import Batch, LossFn, OptimizerFactory, StepResult
from scaletrain.strategies.dtensor import (
    apply_tensor_parallel,
    check_tensor_parallel,
    flat_zeros,
    local,
    tensor_parallel_mesh,
)
from scaletrain.strategies.fsdp import FSDPStrategy


class TensorStrategy(FSDPStrategy):
    """State handling (DCP checkpoints, full-state gather, per-rank bytes) and the (dp, tp)
    data layout are fsdp.py's: both hold DTensors. Only setup and the step differ."""

    collective = "tensor-parallel all-reduce"
    compile_refusal = "compiling DTensor-parallel layers is not supported here yet"
    balance_refusal = "a tensor-parallel group shares one batch; not balanced here yet"
    # Its forward communicates only inside a tensor-parallel group, whose ranks share one
    # batch; the replicas average gradients once, after the last micro-batch.
    same_micro_batch_count = False

    @classmethod
    def checks_model(cls, cfg: RunConfig) -> bool:
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to hold back: the replicas average gradients in the step, after the last
        micro-batch (``_average_gradients``); backward itself syncs only inside a group. (The
        model is not FSDP's, so fsdp.py's no_sync does not apply.)"""
        yield

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        check_tensor_parallel(model, cfg.parallel.tp, world_size)

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        tp = cfg.parallel.tp
        try:
            check_tensor_parallel(model, tp, world_size)
        except ValueError:
            return None
        planned = dict(model.named_modules())
        plan: dict[str, Any] = getattr(model, "tensor_parallel_plan", dict)()
        split = sum(p.numel() * p.element_size() for n in plan for p in planned[n].parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        # Row-split biases stay whole; close enough for a budget.
        return (total - split + split // tp) * (2 + optimizer_copies)

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        self.skeleton = copy.deepcopy(model).to("meta")
        self.param_bytes_full = sum(p.numel() * p.element_size() for p in model.parameters())
        tp = self.cfg.parallel.tp
        check_tensor_parallel(model, tp, self.ctx.world_size)
        self.mesh = tensor_parallel_mesh(self.ctx, tp)
        self.tp, self.dp = tp, self.ctx.world_size // tp
        self.rowwise = apply_tensor_parallel(model, self.mesh) if tp > 1 else []
        self.activation_bytes = 0
        for layer in self.rowwise:
            layer.register_forward_hook(self._count_activation)
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model.parameters())
        self.loss_fn = loss_fn
        self.replica: nn.Module | None = None

    def summary_info(self) -> dict[str, Any]:
        """fsdp's without its replica groups, which tensor parallelism does not have (with
        --tp 1 the strategy is data parallel alone)."""
        return {"tensor_parallel": {"tp": self.tp, "data_parallel": self.dp}} if self.tp > 1 else {}

    def _count_activation(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self.activation_bytes += local(output).numel() * local(output).element_size()

    def train_step(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        self.activation_bytes = 0
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(
            self.module, self.loss_fn, batch.inputs, batch.targets, batch.num_samples
        )
        comm_s, sent = 0.0, 2 * sent_bytes("all_reduce", self.activation_bytes, self.tp)
        if self.dp > 1:
            comm_start = time.perf_counter()
            sent += self._average_gradients(batch)
            comm_s = time.perf_counter() - comm_start
        extras = self.step_optimizer(self.optimizer, self.module.parameters())
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        step_s = time.perf_counter() - start
        return StepResult(
            loss=loss,
            compute_s=step_s - comm_s,
            comm_s=comm_s,
            wait_s=comm_s,
            comm_bytes=sent,
            extras=extras,
        )

    def _average_gradients(self, batch: Batch) -> int:
        """Sample-weighted mean over the data-parallel replicas of each rank's local shards
        (the same shards on every replica). Returns the bytes this rank sent."""
        grads = [local(p.grad) if p.grad is not None else None for p in self.params]
        shapes = [local(p).shape for p in self.params]
        flat = torch.cat(
            [g.reshape(-1) if g is not None else flat_zeros(s, self.ctx.device)
             for g, s in zip(grads, shapes, strict=True)]
        )  # fmt: skip
        flat.mul_(batch.num_samples / batch.global_samples)
        dist.all_reduce(flat, group=self.mesh.get_group("dp"))
        offset = 0
        for g, s in zip(grads, shapes, strict=True):
            n = s.numel()
            if g is not None:
                g.copy_(flat[offset : offset + n].view(s))
            offset += n
        return sent_bytes("all_reduce", flat.numel() * flat.element_size(), self.dp)
