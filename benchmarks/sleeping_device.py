"""A task whose model computes on a *sleeping device*: the built-in model (--model, on the
built-in data) does its real arithmetic, which is tiny, and each of its top-level layers
also sleeps SCALETRAIN_DEVICE_MS milliseconds per sample in forward (split evenly over the
layers) and twice that in backward, as an accelerator would be busy while the host waits.

Sleeping processes do not compete for this machine's cores, so 32 workers behave as 32
devices would, and what a benchmark measures is scaletrain's own machinery (launch,
rendezvous, collectives, checkpoints, the loop's per-step work) and the communication, not
a 2-core host's arithmetic. What the emulation leaves out: the device's memory and its
bandwidth to the host, kernels that overlap communication on their own streams, and any
speed-up from a larger batch per device (a sleep is linear in the samples).

The hooks change neither the model's parameters nor its names, so every strategy (the
pipeline's cuts, tensor-parallel plans, FSDP units) sees the built-in model it knows, and
the weights are those of the same run without sleeps.

    scaletrain run --task benchmarks/sleeping_device.py:build_task --model mlp ...

A device can be made slower while it runs (benchmarks/chaos.py's "slow" fault): with
SCALETRAIN_DEVICE_SLOW_DIR set, a file ``rank<R>`` there holding a number multiplies rank R's
sleeps by it from its next forward on, until the file is removed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import RunConfig
from scaletrain.task import Task, build_builtin_task

DEVICE_MS = "SCALETRAIN_DEVICE_MS"  # per sample, forward; backward sleeps twice this
SLOW_DIR = "SCALETRAIN_DEVICE_SLOW_DIR"  # rank<R> there: rank R's device is that much slower


SLEEPS = [0]  # sleeps so far in this process (device_waits counts a step's)


class DeviceTime(torch.autograd.Function):
    """Identity that sleeps ``seconds`` in forward and twice that in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        SLEEPS[0] += 1
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        SLEEPS[0] += 1
        time.sleep(2 * ctx.seconds)
        return grad, None


def device_waits(model: nn.Module, inputs: torch.Tensor) -> int:
    """How many times a step of ``model`` on this device sleeps, each sleep a wake-up of the
    host (the cost model's host probe cuts a step's host work into as many pieces)."""
    add_device_time(model, 0.0)
    before = SLEEPS[0]
    model(inputs).sum().backward()
    return SLEEPS[0] - before


def add_device_time(model: nn.Module, ms_per_sample: float, slow_file: Path | None = None) -> None:
    """Every top-level layer's output passes through DeviceTime for its share of the time
    (times the number in ``slow_file``, read at each forward, while it exists)."""
    layers = list(model.children()) or [model]
    share = ms_per_sample * 1e-3 / len(layers)
    factor = [1.0]

    def read_factor(module: nn.Module, inputs: Any) -> None:
        try:
            factor[0] = float(slow_file.read_text()) if slow_file else 1.0
        except (OSError, ValueError):  # no file (or one being written): full speed
            factor[0] = 1.0

    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return DeviceTime.apply(output, factor[0] * share * output.shape[0])
        return output

    model.register_forward_pre_hook(read_factor)
    for layer in layers:
        layer.register_forward_hook(hook)


def build_task(cfg: RunConfig) -> Task:
    """The built-in task of ``cfg`` (its --model on its --dataset), on a sleeping device."""
    task = build_builtin_task(cfg)  # --model on --dataset; --task names this file
    slow_dir = os.environ.get(SLOW_DIR)
    slow_file = Path(slow_dir) / f"rank{os.environ.get('RANK', '0')}" if slow_dir else None
    add_device_time(task.model, float(os.environ.get(DEVICE_MS, "1.0")), slow_file)
    return task
