"""A user task with dropout whose masks differ between ranks: each rank reseeds torch with its
own seed once the (identical) model is built, so the ranks' random streams differ."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain import RunConfig, Task
from scaletrain.task import build_builtin_task


def build_task(cfg: RunConfig) -> Task:
    task = build_builtin_task(cfg)
    task.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5),
                               nn.Linear(64, 10))  # fmt: skip
    torch.manual_seed(1000 + dist.get_rank())
    return task
