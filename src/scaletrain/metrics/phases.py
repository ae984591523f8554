"""When each phase of a process's start-up ended, for summary.json's ``startup``: at scale,
launch-to-first-step is where a job's minutes go (imports on every process, the rendezvous,
the model's build and first broadcast), and it must be seen by phase to be cut.

A process marks a phase when it ends (``mark``); the worker marks ``process`` first thing,
before it imports torch. The marks travel in the process's final totals (RankTotals.phases,
unix times) and the summary gives the median over processes of each phase's length.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

# In the order they happen in a worker: its interpreter started (the mark before any import),
# scaletrain and torch imported, the process group joined (the rendezvous), the model built
# and wrapped (DDP's first broadcast included), the first step begun.
PHASES = ("process", "imported", "group", "model", "first_step")
_MARKS: dict[str, float] = {}


def mark(phase: str, when: float | None = None) -> None:
    _MARKS.setdefault(phase, time.time() if when is None else when)


def marks() -> dict[str, float]:
    return dict(_MARKS)


def open_fds() -> int:
    """File descriptors this process holds now (0 where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def startup_summary(
    per_process: list[dict[str, float]], launched_at: float | None
) -> dict[str, Any]:
    """{phase_s: median seconds over the processes} from each one's marks (the last
    attempt's processes); ``launch_s`` from the job run's start (the launcher's first line; it
    includes earlier attempts when there were restarts) to the median process's start."""
    out: dict[str, Any] = {}
    complete = [m for m in per_process if all(p in m for p in PHASES)]
    if not complete:
        return out
    if launched_at is not None:
        out["launch_s"] = max(statistics.median(m["process"] for m in complete) - launched_at, 0.0)
    for before, after in zip(PHASES, PHASES[1:], strict=False):
        out[f"{after}_s"] = statistics.median(m[after] - m[before] for m in complete)
    out["slowest_process_to_first_step_s"] = max(m["first_step"] - m["process"] for m in complete)
    return out
