"""A user task whose model raises on rank 1 only, at its third forward pass."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from scaletrain import RunConfig, Task
from scaletrain.task import build_builtin_task


class FlakyModel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            raise RuntimeError("user model exploded on rank 1")
        return self.inner(x)


def build_task(cfg: RunConfig) -> Task:
    task = build_builtin_task(cfg)
    task.model = FlakyModel(task.model)
    return task
