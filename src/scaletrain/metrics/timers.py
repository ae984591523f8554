"""Timing of gradient communication, measured where it happens.

``CommTimer`` is fed by the communication hook: each bucket's collective records its launch
time when the hook starts it and its end time when its future completes (in the backend's
thread). Per step it reports:

- ``busy_s``: wall time during which at least one collective was in flight (the union of the
  intervals), whether or not computation was hiding it;
- ``last_launch``: when the last bucket was handed off, i.e. when backward's own compute ended;
- ``last_end``: when the last collective completed. From ``last_launch`` to ``last_end`` the
  rank had nothing left to compute and sat blocked on communication (and on slower peers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CommStats:
    busy_s: float = 0.0
    last_launch: float = 0.0
    last_end: float = 0.0
    num_collectives: int = 0
    bytes: int = 0


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


class CommTimer:
    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def record(self, start: float, end: float, nbytes: int) -> None:
        # Called from the communication backend's thread; list.append is atomic under the GIL.
        self._intervals.append((start, end))
        self._bytes += nbytes

    def collect(self) -> CommStats:
        """Stats of everything recorded since the last call, then start afresh."""
        intervals, nbytes = self._intervals, self._bytes
        self._intervals, self._bytes = [], 0
        if not intervals:
            return CommStats()
        return CommStats(
            busy_s=union_length(intervals),
            last_launch=max(s for s, _ in intervals),
            last_end=max(e for _, e in intervals),
            num_collectives=len(intervals),
            bytes=nbytes,
        )
