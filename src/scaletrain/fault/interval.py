"""How often to checkpoint (--checkpoint-every auto), pure: Young's and Daly's first-order
optimum. Checkpointing every tau seconds at a cost of delta seconds each, with failures at a
mean interval M, loses about delta / tau of the time to checkpoints and tau / (2 M) to rework
(on average half an interval is redone per failure); their sum is least at
tau = sqrt(2 delta M). The loop measures delta (what a save blocked it) and its step time,
and recomputes the interval at every checkpoint.
"""

from __future__ import annotations

import math


def optimal_interval_s(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def predicted_overhead(cost_s: float, interval_s: float, mtbf_s: float) -> float:
    """The share of time lost to checkpoints and rework at this interval (first order)."""
    if interval_s <= 0:
        return math.inf
    return cost_s / interval_s + interval_s / (2.0 * mtbf_s)


def interval_steps(cost_s: float, step_s: float, mtbf_s: float) -> int:
    """The optimal interval in whole steps (at least 1)."""
    if step_s <= 0:
        return 1
    return max(1, round(optimal_interval_s(cost_s, mtbf_s) / step_s))
