"""What a checkpoint holds, and resuming from one after the elastic agent restarts workers.

A checkpoint is the strategy's state (weights, optimizer), the sampler's (epoch, cursor), the
loop's progress (step, epoch, samples trained, recoveries so far), every rank's RNG states
(torch, numpy, python; each rank writes its own file beside rank 0's checkpoint, which keeps
rank 0's as the fallback) and the config hash.
It is written by rank 0 after the optimizer step it describes, so the cursor in it never
counts a sample whose update is not in the weights.

Restart recovery: when any worker dies, torch's elastic agent stops the group and starts it
again (``--max-restarts``), possibly with another world size (``--nnodes MIN:MAX``); every
worker then loads the newest valid checkpoint and the sampler re-plans the rest of the epoch
over the ranks there are now. The recovery entry (fault/recoveries.py, which builds every
mode's) is made from DIR/logs/incidents.jsonl, where
the launcher notes each death the agent detects and the watchdog each hang it detects:
which rank, at which step (or, when a node vanished with its agent, ``cause: node-lost`` and
the ranks that node had), when it was detected (``detected_s``: from the rank's last sign of
progress to detection) and, once the first step after the restart completes, ``resumed_s``
(from detection to that step). Each rank restores its own RNG state, so per-rank randomness
(dropout masks that differ between ranks) continues exactly.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from scaletrain.fault.checkpoint import load_latest, load_rank_state, rng_path
from scaletrain.fault.recoveries import (
    failure_details,
    job_resume_details,
    note_recovery,
    read_incidents,
    run_recoveries,
)
from scaletrain.io import read_jsonl

log = logging.getLogger("scaletrain.recovery")


@dataclass(kw_only=True)
class Progress:
    step: int = 0
    epoch: int = 0
    samples_trained: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)


def rng_state() -> dict[str, Any]:
    numpy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = numpy_state
    return {
        "torch": torch.get_rng_state(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def checkpoint_state(
    training: dict[str, Any],
    progress: Progress,
    config_hash: str,
    rng_states: list[dict[str, Any]],
    world_size: int,
    math_hash: str,
) -> dict[str, Any]:
    """``training``: the loop's training state ({"strategy": ..., "sampler": the plan's});
    ``rng_states``: rank 0's rng_state() (the fallback; each rank also writes its own);
    ``math_hash``: what a run must share with it to resume from it (RunConfig.math_hash)."""
    return {
        **training,
        "progress": asdict(progress),
        "rng": rng_states,
        "config_hash": config_hash,
        "math_hash": math_hash,
        # Every rank of this world writes its own state file beside the checkpoint; one that
        # is missing means that rank never got there (checked at resume).
        "world_size": world_size,
    }


def progress_step(state: dict[str, Any]) -> int:
    return int(state["progress"]["step"])


def own_state(
    checkpoints: Path, step: int, rank: int, state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """This rank's own state saved with checkpoint ``state`` of ``step``: (RNG states, the
    strategy's per-rank part or None, ""), so each rank continues its own random stream and
    replica. The third item, when not empty, says why the checkpoint must not be used: this
    rank's file is damaged, or missing although the world that wrote the checkpoint had this
    rank (it died before that step: between local-SGD synchronizations rank 0 can be steps
    ahead, and its checkpoint would count samples this rank never trained). A rank beyond
    that world (the world grew) starts from rank 0's RNG states and no per-rank part."""
    fallback_rng = state["rng"][0]
    path = rng_path(checkpoints, step, rank)
    try:
        own = load_rank_state(path)
    except FileNotFoundError:
        if rank < state.get("world_size", 0):
            return fallback_rng, None, f"{path}: missing (rank {rank} never reached step {step})"
        return fallback_rng, None, ""
    except Exception as e:  # DamagedFile, or bytes torch cannot read
        return fallback_rng, None, f"{path}: {e}"
    return own["rng"], own.get("strategy"), ""


def resume(
    checkpoints: Path,
    restore: Callable[[dict[str, Any], dict[str, Any] | None], None],
    *,
    data_world_size: int,
    rank: int,
    math_hash: str,
    attempt: int,
    metrics: Path,
    job_run: int = 0,
    attempt_base: int = 0,
    all_agree: Callable[[bool], bool] = lambda ok: ok,
    own_rank: int | None = None,
) -> Progress | None:
    """Load the newest valid checkpoint through ``restore(state, rank_part)`` (the loop's
    training state, and this process's own part, global rank ``rank``, or None). None on a
    new job's first attempt without one; a restarted attempt, or a later run of the job
    (``job_run`` > 0, whose first attempt is ``attempt_base``), without one starts from step
    0, and either way the restart or the job's resume is recorded in the returned progress's
    recoveries.

    Valid means its file matches index.json's sha256 and every rank's own state file for it
    is whole (see own_state); ``all_agree(ok)`` is True when ``ok`` holds on every rank (a
    collective: every rank calls it equally often, since all read the same files).
    ``own_rank``: the rank this process's own files are named by, when not ``rank`` (a rank
    of an in-place replica group reads the shards of its rank in the group)."""
    below: int | None = None
    skipped: list[str] = []
    while True:
        state, damaged = load_latest(checkpoints, below)
        skipped += damaged
        if state is None:
            break
        step = progress_step(state)
        # ``rank`` is the process's global rank, as the files are named: the sampler's is
        # its data-parallel position, shared by the stages of a pipeline.
        own = rank if own_rank is None else own_rank
        rng, rank_part, problem = own_state(checkpoints, step, own, state)
        if all_agree(not problem):
            break
        skipped.append(problem or f"step {step}: another rank's own state file is unusable")
        below = step
    for note in skipped:
        log.warning("skipping damaged checkpoint %s", note)
    first_of_job = attempt == attempt_base
    if state is None and first_of_job and job_run == 0:
        return None
    if state is not None and state.get("math_hash") != math_hash:
        raise ValueError(
            f"the checkpoints in {checkpoints} were written by a run with other math settings "
            f"(hash {state.get('math_hash')}, this run {math_hash})"
        )
    if state is not None:
        restore(state, rank_part)
        set_rng_state(rng)
        progress = Progress(**state["progress"])
    else:  # died before the first checkpoint: everything is redone from the start
        progress = Progress()
    records = read_jsonl(metrics)
    reached = max((r["step"] for r in records), default=0)
    earlier = run_recoveries(metrics.parent, progress.recoveries)
    started_at = next((e["step"] for e in earlier if e["attempt"] == attempt - 1), 0)
    details = (
        job_resume_details(metrics.parent, records, job_run)
        if first_of_job
        else failure_details(read_incidents(metrics.parent), records, attempt - 1, started_at)
    )
    progress.recoveries.append(
        {
            "kind": "resume" if first_of_job else "restart",
            "attempt": attempt,
            "job_run": job_run,
            "world_size": data_world_size,
            "step": progress.step,
            "lost_steps": max(0, reached - progress.step),
            "skipped_checkpoints": len(skipped),
            **details,
        }
    )
    if rank == 0:
        note_recovery(metrics.parent, progress.recoveries[-1])
    log.info("resumed at step %d, epoch %d", progress.step, progress.epoch)
    return progress
