"""Learning-rate schedules (--lr-schedule, --warmup-steps), pure: the factor of --lr for each
update is a function of how many updates came before it and how many the run will make.

A schedule has no state of its own: resuming from a checkpoint at step k continues it
exactly (the step is in the checkpoint's progress). Under an elastic world size the run's
total steps change with the membership (the global batch does), and the schedule follows
the new horizon from where it is.

- constant: 1
- cosine: from 1 to 0 along half a cosine
- linear: from 1 to 0
- step: 1, then 0.1 from half of the run, 0.01 from three quarters
With warmup, the first W updates ramp up linearly (1/W, 2/W, ..., 1), and the schedule runs
over the updates after them.
"""

from __future__ import annotations

import math
from typing import Any


def lr_factor(kind: str, step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """The factor for the update after ``step`` applied updates (the first update: step 0)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    t = min(max(step - warmup_steps, 0) / span, 1.0)  # the fraction of the decay done
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if kind == "linear":
        return 1.0 - t
    if kind == "step":
        return 1.0 if t < 0.5 else 0.1 if t < 0.75 else 0.01
    raise ValueError(f"lr_schedule: unknown schedule {kind!r}")


# Where each parameter group keeps its base rate: the key torch's own schedulers use.
BASE_LR = "initial_lr"


def mark_base_lr(optimizer: Any) -> Any:
    """Record each parameter group's learning rate as built under ``initial_lr`` (the key
    torch's own schedulers use), before any state is saved or restored, and return the
    optimizer. The base rate is then part of the optimizer's state dict from the start: a
    checkpoint always carries it, and a restore gets it back even where only the keys the
    fresh optimizer already has are read (torch.distributed.checkpoint's load fills the state
    dict it is given). Recorded lazily instead, at the first scheduled update, a fresh
    optimizer lacked the key, the sharded restore skipped it, and the next update took the
    restored, already scheduled rate as the base: the schedule applied twice."""
    for group in optimizer.param_groups:
        group.setdefault(BASE_LR, group["lr"])
    return optimizer


def scale_lr(optimizer: Any, factor: float) -> None:
    """Set each group's learning rate to its base rate (``mark_base_lr``) times ``factor``. A
    group restored without one (from a checkpoint of a run that never scheduled its rate, so
    its rate is the base) takes its rate as the base."""
    for group in mark_base_lr(optimizer).param_groups:
        group["lr"] = group[BASE_LR] * factor
