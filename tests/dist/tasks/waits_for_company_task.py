"""The built-in task, except that a world of one trains only its first steps: from its fifth
step on, the loss function waits for good. Only a node joining moves the run on: the agent
then stops this healthy world and forms a larger one, which trains normally."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from scaletrain import RunConfig, Task
from scaletrain.task import build_builtin_task

ALONE_STEPS = 4


def build_task(cfg: RunConfig) -> Task:
    task = build_builtin_task(cfg)
    plain, calls = task.loss_fn, [0]

    def loss_fn(outputs: Any, targets: Any) -> Any:
        calls[0] += 1
        while dist.get_world_size() == 1 and calls[0] > ALONE_STEPS:
            time.sleep(0.05)  # until the agent stops this world (SIGTERM)
        return plain(outputs, targets)

    task.loss_fn = loss_fn
    return task
