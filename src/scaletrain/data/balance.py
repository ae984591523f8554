"""--balance speed: each synchronous step's samples split over the ranks in proportion to
their measured speed, so a slower worker gets fewer and nobody waits for it.

Every rank measures its own rate (samples per second of its busy time: loading and
computing, not waiting for the others) over a window of steps: the median of its steps'
rates, so one step descheduled by the host does not speak for the window. Every
--balance-every steps the ranks gather their rates (one small all-gather) and every rank
computes the same new shares from the same numbers: the rates smoothed over windows, no
rank's share below a quarter of an even share (so every rank keeps a rate to measure).

A new split is adopted only when someone waits: when a rank that could take fewer samples
is busy more than the hysteresis longer per step than the least busy rank (a rank's busy
time per step is its share over its rate); and only when some share moves by more than the
hysteresis. The first condition matters where a step is mostly fixed cost (small models):
there a rank's rate follows its share, so a rate lowered by noise would lower the share
that lowers the rate, a walk that starves a healthy rank; but its busy time per step stays
the others', and nobody waits.

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


def rebalanced(now: Sequence[float], rates: Sequence[float]) -> list[float] | None:
    """The split to adopt for the ranks' (positive) ``rates`` when ``now`` (shares summing
    to 1) is in force, or None to keep it (the module's docstring: only when someone
    waits, and only a move larger than the hysteresis). Pure: the same on every rank."""
    world = len(rates)
    floor = MIN_SHARE / world
    busy = [s / r for s, r in zip(now, rates, strict=True)]  # a step's busy time, per sample
    movable = [b for b, s in zip(busy, now, strict=True) if s > floor * (1 + 1e-6)]
    if not movable or max(movable) <= (1 + HYSTERESIS) * min(busy):
        return None
    target = floored([r / sum(rates) for r in rates], floor)
    moved = max(abs(t - c) / c for t, c in zip(target, now, strict=True))
    return target if moved > HYSTERESIS else None


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
    now = [x / sum(current) for x in current] if current else [1.0 / world] * world
    return rebalanced(now, smoothed), smoothed


class RateMeter:
    """This rank's steps (samples, busy seconds) since the last rebalance. ``skip_first``:
    the first step added is left out (it carries the process's warm-up: first allocations,
    the first collective's connections)."""

    def __init__(self, *, skip_first: bool = False) -> None:
        self.steps: list[tuple[int, float]] = []
        self.skipping = skip_first

    def add(self, samples: int, busy_s: float) -> None:
        if self.skipping:
            self.skipping = False
            return
        if samples and busy_s > 0:  # a stand-in step (no samples) measures no rate
            self.steps.append((samples, busy_s))

    def take(self) -> float:
        """The median of the window's per-step rates, in samples per busy second (0 when
        it trained none), and reset."""
        rates = sorted(samples / busy_s for samples, busy_s in self.steps)
        self.steps = []
        if not rates:
            return 0.0
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2
