"""Timing of gradient communication, measured where it happens.

``CommTimer`` is fed by the communication hook: each bucket's collective records its launch
time when the hook starts it and its end time when its future completes (in the backend's
thread). Per step it reports:

- ``busy_s``: wall time during which at least one collective was in flight (the union of the
  intervals), whether or not computation was hiding it;
- ``last_launch``: when the last bucket was handed off, i.e. when backward's own compute ended;
- ``last_end``: when the last collective completed. From ``last_launch`` to ``last_end`` the
  rank had nothing left to compute and sat blocked on communication (and on slower peers);
- ``bytes``: bytes this rank sent, by the textbook cost of each collective (``sent_bytes``),
  and ``dense_bytes``: what it would have sent uncompressed, so their ratio is the
  compression ratio actually achieved on the wire.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CommStats:
    busy_s: float = 0.0
    last_launch: float = 0.0
    last_end: float = 0.0
    num_collectives: int = 0
    bytes: int = 0
    dense_bytes: int = 0
    blocked_s: float = 0.0


def sent_bytes(collective: str, payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective over a payload of ``payload_bytes`` (per rank):
    a ring all-reduce sends 2 (W-1)/W of it (reduce-scatter, then all-gather), an all-gather
    (W-1) times it, a broadcast from this rank at most (W-1) times it."""
    if world_size <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (world_size - 1) * payload_bytes // world_size
    if collective in ("all_gather", "broadcast"):
        return (world_size - 1) * payload_bytes
    raise ValueError(f"unknown collective {collective!r}")


def overlap_ratio(compute_s: float, comm_s: float, step_s: float) -> float:
    """How much of the communication was hidden behind computation:
    (compute + comm - step) / min(compute, comm), clipped to [0, 1]; 0 without communication."""
    shortest = min(compute_s, comm_s)
    if shortest <= 0:
        return 0.0
    return min(1.0, max(0.0, (compute_s + comm_s - step_s) / shortest))


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
        self._dense_bytes = 0
        self._blocked = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def record(self, start: float, end: float, nbytes: int, dense_bytes: int | None = None) -> None:
        """One collective from ``start`` to ``end`` that sent ``nbytes`` (``dense_bytes``
        uncompressed; the same when not given). Called from the backend's threads."""
        with self._lock:
            self._intervals.append((start, end))
            self._bytes += nbytes
            self._dense_bytes += nbytes if dense_bytes is None else dense_bytes

    def blocked(self, seconds: float) -> None:
        """Time the computing thread itself sat waiting on a collective (a blocking round)."""
        with self._lock:
            self._blocked += seconds

    def collect(self) -> CommStats:
        """Stats of everything recorded since the last call, then start afresh."""
        with self._lock:
            intervals, nbytes, dense = self._intervals, self._bytes, self._dense_bytes
            blocked = self._blocked
            self._intervals, self._bytes, self._dense_bytes, self._blocked = [], 0, 0, 0.0
        if not intervals:
            return CommStats()
        return CommStats(
            busy_s=union_length(intervals),
            last_launch=max(s for s, _ in intervals),
            last_end=max(e for _, e in intervals),
            num_collectives=len(intervals),
            bytes=nbytes,
            dense_bytes=dense,
            blocked_s=blocked,
        )
