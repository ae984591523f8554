"""--balance speed: each synchronous step's samples split over the ranks in proportion to
their measured speed, so a slower worker gets fewer and nobody waits for it.

Every rank measures its own rate (samples per second of its busy time: loading and
computing, not waiting for the others) over a window of steps; every --balance-every steps
the ranks gather their rates (one small all-gather) and every rank computes the same new
shares from the same numbers: rates smoothed over windows, and adopted only when some rank's
share would move by more than the hysteresis (so noise does not re-plan every window). No
rank's share falls below a quarter of an even share, so every rank keeps a rate to measure.

The math stays exact: a step's global batch is the same whatever its split, and the
strategies weight each rank's gradient by its samples (ddp.py), so the weights equal one
worker's trained on the same global batches. The shares are the sampler's state (in
checkpoints, so a resumed run continues with them); a world of another size starts even.
"""

from __future__ import annotations

from collections.abc import Sequence

HYSTERESIS = 0.1  # a share moves only when some rank's would change by more than 10%
SMOOTHING = 0.5  # weight of the newest window's rates
MIN_SHARE = 0.25  # of an even share


def floored(shares: list[float], floor: float) -> list[float]:
    """``shares`` (summing to 1) with none below ``floor``: those below get it, the others
    split what is left in their proportions, until none falls below."""
    fixed: set[int] = set()
    out = list(shares)
    while True:
        free = [i for i in range(len(out)) if i not in fixed]
        left = 1.0 - floor * len(fixed)
        weight = sum(shares[i] for i in free)
        for i in free:
            out[i] = left * shares[i] / weight
        low = {i for i in free if out[i] < floor}
        if not low:
            return [floor if i in fixed else out[i] for i in range(len(out))]
        fixed |= low


def next_shares(
    current: Sequence[float] | None, rates: Sequence[float], smoothed: Sequence[float] | None
) -> tuple[list[float] | None, list[float]]:
    """(the shares to use, None to keep ``current``; the smoothed rates). Pure: the same on
    every rank for the same gathered ``rates``."""
    world = len(rates)
    if min(rates) <= 0:  # a rank measured nothing this window (its warm-up step): no news
        return None, list(smoothed or [])
    if smoothed is None or len(smoothed) != world:
        smoothed = list(rates)
    else:
        smoothed = [
            SMOOTHING * r + (1 - SMOOTHING) * s for r, s in zip(rates, smoothed, strict=True)
        ]
    target = floored([r / sum(smoothed) for r in smoothed], MIN_SHARE / world)
    now = [x / sum(current) for x in current] if current else [1.0 / world] * world
    moved = max(abs(t - c) / c for t, c in zip(target, now, strict=True))
    return (target if moved > HYSTERESIS else None), smoothed


class RateMeter:
    """This rank's samples and busy seconds since the last rebalance. ``skip_first``: the
    first step added is left out (it carries the process's warm-up: first allocations, the
    first collective's connections)."""

    def __init__(self, *, skip_first: bool = False) -> None:
        self.samples = 0
        self.busy_s = 0.0
        self.skipping = skip_first

    def add(self, samples: int, busy_s: float) -> None:
        if self.skipping:
            self.skipping = False
            return
        self.samples += samples
        self.busy_s += busy_s

    def take(self) -> float:
        """Samples per busy second over the window (0 when it trained none), and reset."""
        rate = self.samples / self.busy_s if self.busy_s > 0 and self.samples else 0.0
        self.samples, self.busy_s = 0, 0.0
        return rate
