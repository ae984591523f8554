"""The built-in task, except that rank 1 dies twice: at step 6 of the first attempt, and at
the first step of the second, before that attempt can write a checkpoint of its own."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from scaletrain import RunConfig, Task
from scaletrain.task import build_builtin_task


def build_task(cfg: RunConfig) -> Task:
    task = build_builtin_task(cfg)
    plain, calls = task.loss_fn, [0]
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def loss_fn(outputs: Any, targets: Any) -> Any:
        calls[0] += 1
        if dist.get_rank() == 1 and (restarts, calls[0]) in {(0, 6), (1, 1)}:
            os._exit(1)
        return plain(outputs, targets)

    task.loss_fn = loss_fn
    return task
