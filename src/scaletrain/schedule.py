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
