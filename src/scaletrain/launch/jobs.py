"""A job's runs: running the same command again on the same run directory continues the job.

A cluster takes whole jobs away (a spot VM reclaimed, a node rebooted, a scheduler's time
limit, an eviction) and gives them back later with the same command. So ``scaletrain run
--out DIR`` on a DIR that holds an unfinished job is a new *job run* of it: its workers
resume from the newest valid checkpoint (the restart mode's resume, as after a worker death),
metrics.jsonl goes on (each record carries ``job_run``), and summary.json covers the whole
history. On a finished job it continues only if the new command trains further (more
--epochs, or a larger --max-steps); otherwise the job is complete and there is nothing to do
(``JobComplete``: exit 0, so a requeue loop that runs the command once more is not failed).

What may change between job runs (config.FREE_FIELDS): how and where it runs (every launch
flag: more or fewer workers or nodes re-plan the rest of the epoch from the sampler's cursor,
and fsdp reshards through DCP), how long it trains, what it records and how it checkpoints.
Anything else is the math of the training (model, data, optimizer, batch, seed, precision,
strategy, ...): a change is refused, naming the fields. In place (--recovery inplace) the
replicas resume from the checkpoints one of them wrote (--checkpoint-every; a job without
any is refused). A parameter-server job continues after a preemption or a whole-job kill
from the newest moment every server checkpointed (strategies/param_server/cuts.py; one
without such checkpoints is refused); one preempted before its first step starts again.

logs/job_runs.jsonl has a line when each job run starts (number, time, attempt base, what
changed) and one when it ends (finished, preempted, failed). Attempts are numbered across the
job: a job run's first attempt comes after the last one of the runs before it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig
from scaletrain.fault.jobs import current_job_run, job_runs_path
from scaletrain.fault.preempt import preempt_path
from scaletrain.io import append_jsonl, read_jsonl


class JobComplete(Exception):
    """The same command on a job that finished: nothing to do, and not an error (a requeue
    loop that runs it again after the job ended must not turn it into a failure)."""

    def __init__(self, out: Path) -> None:
        from scaletrain.io import read_json

        super().__init__(f"the job in {out} is complete")
        self.summary: dict[str, Any] = {
            **(read_json(out / "summary.json") or {}),
            "run_dir": str(out),
            "already_complete": True,
        }


@dataclass(frozen=True, kw_only=True)
class JobRun:
    number: int  # 0 for the job's first run
    attempt_base: int  # the first attempt number of this run
    resumed_from: str  # "" (a new job), "unfinished" or "finished" (trained further)


def math_changes(old: RunConfig, new: RunConfig) -> list[str]:
    """The math fields whose values differ: 'name: old -> new'."""
    before, after = old.math_fields(), new.math_fields()
    return [f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if before[k] != after[k]]


def extends(old: RunConfig, new: RunConfig) -> bool:
    """Whether ``new`` trains further than ``old`` did (more epochs, more steps)."""
    more_epochs = new.train.epochs > old.train.epochs
    old_cap, new_cap = old.train.max_steps, new.train.max_steps
    more_steps = bool(old_cap) and (new_cap == 0 or new_cap > old_cap)
    return more_epochs or (more_steps and new.train.epochs >= old.train.epochs)


def next_attempt(out: Path) -> int:
    """One more than every attempt the job's records and incidents name so far."""
    seen = [r.get("attempt", -1) for r in read_jsonl(out / "metrics.jsonl")]
    seen += [i.get("attempt", -1) for i in read_jsonl(out / "logs" / "incidents.jsonl")]
    seen += [e.get("attempt", -1) for e in read_jsonl(out / "logs" / "recoveries.jsonl")]
    seen += [j.get("attempt_base", -1) for j in read_jsonl(job_runs_path(out))]
    return max(seen, default=-1) + 1


def plan_job_run(cfg: RunConfig, out: Path, mode: str) -> JobRun:
    """Decide what running ``cfg`` on ``out`` is: a new job, or the next run of the job there
    (ValueError when it may not be, naming why). Writes nothing."""
    config, summary = out / "config.toml", out / "summary.json"
    started = [j["job_run"] for j in read_jsonl(job_runs_path(out)) if "started_at" in j]
    if not started or not config.exists():
        # No job was started here (a config.toml alone may be another node's, written as it
        # joins this new job).
        for name in ("summary.json", "metrics.jsonl"):
            if (out / name).exists():
                raise ValueError(
                    f"out: {out} already holds a run ({name} exists, but no record of the job "
                    "to resume it with); pass another --out or remove it"
                )
        return JobRun(number=0, attempt_base=0, resumed_from="")
    from scaletrain.config import load_toml

    old = load_toml(config)
    changes = math_changes(old, cfg)
    if changes:
        raise ValueError(
            f"out: {out} holds a job trained with other settings, and a job resumes only "
            f"with the same math: {'; '.join(changes)}. Run it with its own settings "
            f"({config}), or pass another --out"
        )
    finished = summary.exists()
    if finished and not extends(old, cfg):
        raise JobComplete(out)
    trained = (out / "metrics.jsonl").exists()
    if mode == "ps" and trained:
        _check_ps_continues(cfg, out, finished)
    if mode == "inplace" and trained and not _has_checkpoints(out):
        raise ValueError(
            f"out: {out} holds a job that wrote no checkpoint, and in place the replicas' "
            "state was lost with them: there is nothing to continue from. Pass another --out "
            "(and --checkpoint-every N to make an in-place job continuable)"
        )
    if finished and not old.fault.checkpoints_on and not _has_checkpoints(out):
        raise ValueError(
            f"out: {out} finished without checkpoints (--checkpoint-every 0), so there is no "
            "state to train further from; pass another --out"
        )
    return JobRun(
        number=max(started) + 1,
        attempt_base=next_attempt(out),
        resumed_from="finished" if finished else "unfinished",
    )


def _check_ps_continues(cfg: RunConfig, out: Path, finished: bool) -> None:
    """A parameter-server job continues from the newest moment every server checkpointed
    (strategies/param_server/cuts.py): after a preemption, when every worker had left and
    each server checkpointed with nothing in flight; after a whole-job kill, the newest
    global step every server checkpointed (bsp) or the newest cut (asp, ssp: the servers
    copied their state together, with no push in flight). A finished job is not trained
    further (its servers wrote final slices, not checkpoints)."""
    if finished:
        raise ValueError(
            f"out: {out} holds a finished parameter-server job; training it further is not "
            "built under --strategy ps (its servers wrote their final slices, not "
            "checkpoints); pass another --out"
        )
    runs = [j for j in read_jsonl(job_runs_path(out)) if "ended_at" in j]
    how = runs[-1].get("how") if runs else None
    from scaletrain.strategies.param_server.cuts import consistent_checkpoint

    if consistent_checkpoint(out, cfg.ps.num_servers, cfg.ps.consistency) is not None:
        return
    if how == "preempted":
        raise ValueError(
            f"out: {out} holds a preempted parameter-server job whose servers left no "
            "checkpoint of one moment on every server: there is nothing to continue from; "
            "pass another --out"
        )
    ended = f"ended {how}" if how else "ended without a word (killed, or its machine lost)"
    of = "one global step" if cfg.ps.consistency == "bsp" else "one cut"
    raise ValueError(
        f"out: {out} holds a {cfg.ps.consistency} parameter-server job that {ended} without "
        f"checkpoints of {of} on every server (--checkpoint-every N makes them): there is "
        "nothing consistent to continue from. Pass another --out"
    )


def _has_checkpoints(out: Path) -> bool:
    from scaletrain.fault.checkpoint import read_index

    return bool(read_index(out / "checkpoints"))


def start_job_run(out: Path, job: JobRun, cfg: RunConfig, old: RunConfig | None) -> None:
    """Record the job run's start; a finished job trained further keeps its last summary as
    logs/summary.job<N>.json; a leftover preemption request is cleared."""
    summary = out / "summary.json"
    if job.resumed_from == "finished" and summary.exists():
        os.replace(summary, out / "logs" / f"summary.job{job.number - 1}.json")
    preempt_path(out).unlink(missing_ok=True)
    entry: dict[str, Any] = {
        "job_run": job.number,
        "started_at": time.time(),
        "attempt_base": job.attempt_base,
        "resumed_from": job.resumed_from,
        "config_hash": cfg.hash(),
    }
    if old is not None:
        was, now = old.to_dict(), cfg.to_dict()
        entry["changed"] = sorted(
            f"{k}: {was[s][k]!r} -> {now[s][k]!r}"
            for s in now
            if isinstance(now[s], dict)
            for k in now[s]
            if was[s].get(k) != now[s][k] and k not in ("node_rank",)
        )
    append_jsonl(job_runs_path(out), entry)


def end_job_run(out: Path, how: str) -> None:
    """Record how this job run ended: finished, preempted or failed."""
    number = current_job_run(out)[0]
    append_jsonl(job_runs_path(out), {"job_run": number, "ended_at": time.time(), "how": how})
