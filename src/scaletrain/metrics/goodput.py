"""The whole job's time, and how much of it trained something that was kept (goodput).

A job's wall time runs from the start of its first run (launch/jobs.py) to the end of its
last, through every failure, restart, preemption and the time nobody ran it. Goodput is the
share of it spent in steps whose results were kept; the rest is itemized:

- ``startup_s``: each job run's start to its first step (interpreters, torch, rendezvous,
  the model, resuming);
- ``redone_s``: steps whose results were thrown away, trained again after a rollback (and
  parameter-server pushes the servers did not apply);
- ``checkpoint_s``: steps blocked writing checkpoints;
- ``between_steps_s``: the loop's own time between the steps of one attempt (planning the
  next step, the records, the checks between steps): no fault needed, every run has some;
- ``failure_detection_s`` and ``restart_s``: from the last step before a failure to the
  first step after it, split by the recoveries' own detection times; only where a failure
  happened (0 in a run without one);
- ``between_job_runs_s``: from a job run's end (a preemption, a killed job) to the next
  one's start;
- ``finish_s``: after the last step (the last checkpoint, evaluation, summary).

Pure: a function of metrics.jsonl's records (every rank's; a step's interval is
[unix_time - step_s, unix_time]), logs/job_runs.jsonl and the recoveries. Over ranks the
intervals are merged (a union), so ranks that train side by side count once, and survivors
that go on while another recovers (in place, a parameter server) keep the job's time good;
the ranks of one lockstep step count as one interval, blocked for its longest checkpoint
write. A step is redone when the same rank records the same step again in a later attempt.
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in _merge(intervals))


def _minus(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]) -> float:
    """Length of ``intervals`` outside ``cut``."""
    return _length(intervals + cut) - _length(cut)


def job_time(
    records: list[Record],
    job_runs: list[Record],
    recoveries: list[Record],
    end: float,
    start: float | None = None,
) -> dict[str, Any]:
    """{wall_s, goodput, kept_s, lost: {...}} of the job up to ``end`` (unix time). ``start``:
    when the job began, if job_runs does not say (a run started through the Python API)."""
    starts = {j["job_run"]: j["started_at"] for j in job_runs if "started_at" in j}
    ends = {j["job_run"]: j["ended_at"] for j in job_runs if "ended_at" in j}
    first = [r["unix_time"] - r["step_s"] for r in records]
    begin = min(starts.values(), default=start if start is not None else min(first, default=end))
    wall = max(end - begin, 0.0)
    later: dict[tuple[int, int], int] = {}  # (rank, step) -> the latest attempt recording it
    for r in records:
        key = (r["rank"], r["step"])
        later[key] = max(later.get(key, -1), r.get("attempt", 0))
    # The ranks of one step (same job run, attempt and step: lockstep) as one interval, from
    # the last to start (before it, the others wait for it in the step's collective) to the
    # last to end, blocked for its longest checkpoint write: a rank that waits in the next
    # step's collective while rank 0 writes is waiting, not training.
    steps: dict[tuple[int, int, int], list[Record]] = {}
    for r in records:
        steps.setdefault((r.get("job_run", 0), r.get("attempt", 0), r["step"]), []).append(r)
    kept: list[tuple[float, float]] = []
    redone: list[tuple[float, float]] = []
    blocked: list[tuple[float, float]] = []
    for group in steps.values():
        lo = max(r["unix_time"] - r["step_s"] for r in group)
        hi = max(r["unix_time"] for r in group)
        ckpt = min(max(r.get("checkpoint_s", 0.0) for r in group), hi - lo)
        thrown = all(
            r.get("attempt", 0) < later[(r["rank"], r["step"])] or r.get("committed") is False
            for r in group
        )
        (redone if thrown else kept).append((lo, hi - ckpt))
        blocked.append((hi - ckpt, hi))
    kept_s = _length(kept)
    redone_s = _minus(redone, kept)
    checkpoint_s = _minus(blocked, kept + redone)
    # Each job run's start to its first step, and the gaps between job runs.
    startup_s = between_s = 0.0
    runs = sorted(starts)
    for i, run in enumerate(runs):
        mine = [r for r in records if r.get("job_run", 0) == run]
        if mine:
            startup_s += max(min(r["unix_time"] - r["step_s"] for r in mine) - starts[run], 0.0)
        if i + 1 < len(runs):
            stopped = ends.get(run, max((r["unix_time"] for r in mine), default=starts[run]))
            between_s += max(starts[runs[i + 1]] - stopped, 0.0)
    finish_s = max(end - max((r["unix_time"] for r in records), default=end), 0.0)
    accounted = kept_s + redone_s + checkpoint_s + startup_s + between_s + finish_s
    rest = max(wall - accounted, 0.0)
    # The rest is time no step covers: inside an attempt's span, the loop's own time between
    # its steps; outside every span (a failure's gap between two attempts), detection and
    # restart. Only a failure makes the latter, which a run without one must not report.
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    for (job_run, attempt, _), group in steps.items():
        lo = min(r["unix_time"] - r["step_s"] for r in group)
        hi = max(r["unix_time"] for r in group)
        old = spans.get((job_run, attempt), (lo, hi))
        spans[(job_run, attempt)] = (min(old[0], lo), max(old[1], hi))
    inside_s = _length(list(spans.values())) - _length(kept + redone + blocked)
    failures = [e for e in recoveries if e.get("kind") != "resume"]
    detection_s = min(sum(e.get("detected_s") or 0.0 for e in failures), rest)
    restart_s = max(rest - detection_s - inside_s, 0.0) if failures else 0.0
    lost = {
        "startup_s": startup_s,
        "redone_s": redone_s,
        "checkpoint_s": checkpoint_s,
        "between_steps_s": rest - detection_s - restart_s,
        "failure_detection_s": detection_s,
        "restart_s": restart_s,
        "between_job_runs_s": between_s,
        "finish_s": finish_s,
    }
    return {
        "wall_s": wall,
        "goodput": kept_s / wall if wall > 0 else None,
        "kept_s": kept_s,
        "lost": lost,
        "job_runs": len(runs) or 1,
    }
