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
over the ranks there are now. The recovery is recorded from DIR/logs/incidents.jsonl, where
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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from scaletrain.fault.checkpoint import load_latest, load_rank_state, rng_path
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
) -> dict[str, Any]:
    """``training``: the loop's training state ({"strategy": ..., "sampler": the plan's});
    ``rng_states``: rank 0's rng_state() (the fallback; each rank also writes its own)."""
    return {
        **training,
        "progress": asdict(progress),
        "rng": rng_states,
        "config_hash": config_hash,
        # Every rank of this world writes its own state file beside the checkpoint; one that
        # is missing means that rank never got there (checked at resume).
        "world_size": world_size,
    }


def read_incidents(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "incidents.jsonl"
    return read_jsonl(path)


def failure_details(
    incidents: list[dict[str, Any]],
    records: list[dict[str, Any]],
    attempt: int,
    started_at: int = 0,
) -> dict[str, Any]:
    """What ended ``attempt``, which started after step ``started_at``: cause, rank(s), step,
    detection time. A hang (named by the watchdog) explains the deaths it caused, so it wins
    over them."""
    mine = [i for i in incidents if i.get("attempt") == attempt]
    # A rank that could not read the heartbeats (it may be the one cut off) only guesses.
    hangs = sorted((i for i in mine if i["kind"] == "hang"),
                   key=lambda i: bool(i.get("store_unreachable")))  # fmt: skip
    if not mine:
        return {"cause": "unknown", "rank": None, "ranks": [], "failed_step": None,
                "detected_at": None, "detected_s": None, "resumed_s": None}  # fmt: skip
    incident = hangs[0] if hangs else mine[0]
    ranks = incident["ranks"]
    lost = lost_ranks(mine, records, attempt) if not hangs else []
    if lost:
        incident = {**min(mine, key=lambda i: i["detected_at"]), "kind": "node-lost"}
        ranks = lost
    if incident["kind"] == "death" and len(ranks) > 1:
        ranks = _stopped_first(ranks, records, attempt)
    last = [r for r in records if r.get("attempt") == attempt and (not ranks or r["rank"] in ranks)]
    if incident["kind"] == "hang":
        failed_step, since = incident["step"], incident["stalled_since"]
    else:
        failed_step = max((r["step"] for r in last), default=started_at) + 1
        since = max((r.get("unix_time", 0.0) for r in last), default=0.0) or None
    detected_at = incident["detected_at"]
    return {
        "cause": incident["kind"],
        "rank": ranks[0] if ranks else None,
        "ranks": ranks,
        "failed_step": failed_step,
        "detected_at": detected_at,
        "detected_s": detected_at - since if since else None,
        "resumed_s": None,
    }


def _stopped_first(ranks: list[int], records: list[dict[str, Any]], attempt: int) -> list[int]:
    """Of the ranks a death report names (every rank that left no error file: the one that
    died, and those the agent then stopped with SIGTERM before they could write one), the
    ones that stopped at the earliest step. A rank that went on training after another one
    stopped did not die first: between local-SGD synchronizations nothing holds the others
    back, and they ran on until the agent stopped them. In lockstep (ddp) all stopped at the
    same step and the agent's order stands."""
    reached = {rank: 0 for rank in ranks}
    for r in records:
        if r.get("attempt") == attempt and r["rank"] in reached:
            reached[r["rank"]] = max(reached[r["rank"]], r["step"])
    earliest = min(reached.values())
    return [rank for rank in ranks if reached[rank] == earliest]


def lost_ranks(
    incidents: list[dict[str, Any]], records: list[dict[str, Any]], attempt: int
) -> list[int]:
    """Ranks of ``attempt`` whose node reported nothing, when every node that did report saw
    only symptoms (its collectives broke): those ranks' node is gone, agent and all, as when
    a machine dies. Empty when some node names a cause of its own."""
    if not incidents or not all(i.get("collateral") for i in incidents):
        return []
    reported = {r for i in incidents for r in i.get("node_ranks", [])}
    trained = {r["rank"] for r in records if r.get("attempt") == attempt}
    return sorted(trained - reported)


def mark_resumed(progress: Progress) -> None:
    """Called after the first step of a restarted attempt: the recovery is complete."""
    entry = progress.recoveries[-1]
    if entry.get("detected_at"):
        entry["resumed_s"] = time.time() - entry["detected_at"]


def note_recovery(run_dir: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to DIR/logs/recoveries.jsonl (rank 0 does, when it resumes and again
    when the recovery completes). A checkpoint carries the recoveries before it, so a restart
    whose world failed again before its next checkpoint is in no checkpoint: this file keeps
    it for summary.json."""
    from scaletrain.io import append_jsonl

    append_jsonl(run_dir / "logs" / "recoveries.jsonl", entry)


def run_recoveries(run_dir: Path, carried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every restart of the run, one entry per attempt in attempt order: those ``carried`` in
    the loop's progress and those only DIR/logs/recoveries.jsonl holds (the later line of an
    attempt wins: it has ``resumed_s``)."""
    by_attempt = {entry["attempt"]: entry for entry in carried}
    for entry in read_jsonl(run_dir / "logs" / "recoveries.jsonl"):
        by_attempt[entry["attempt"]] = entry
    return [by_attempt[a] for a in sorted(by_attempt)]


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
    config_hash: str,
    attempt: int,
    metrics: Path,
    all_agree: Callable[[bool], bool] = lambda ok: ok,
) -> Progress | None:
    """Load the newest valid checkpoint through ``restore(state, rank_part)`` (the loop's
    training state, and this process's own part, global rank ``rank``, or None). None on a first
    attempt without one; a restarted attempt without one starts from step 0, and either way
    the restart is recorded in the returned progress's recoveries.

    Valid means its file matches index.json's sha256 and every rank's own state file for it
    is whole (see own_state); ``all_agree(ok)`` is True when ``ok`` holds on every rank (a
    collective: every rank calls it equally often, since all read the same files)."""
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
        rng, rank_part, problem = own_state(checkpoints, step, rank, state)
        if all_agree(not problem):
            break
        skipped.append(problem or f"step {step}: another rank's own state file is unusable")
        below = step
    for note in skipped:
        log.warning("skipping damaged checkpoint %s", note)
    if state is None and attempt == 0:
        return None
    if state is not None and state["config_hash"] != config_hash:
        raise ValueError(
            f"the checkpoints in {checkpoints} were written by another configuration "
            f"(config hash {state['config_hash']}, this run {config_hash})"
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
    progress.recoveries.append(
        {
            "kind": "restart",
            "attempt": attempt,
            "world_size": data_world_size,
            "step": progress.step,
            "lost_steps": max(0, reached - progress.step),
            "skipped_checkpoints": len(skipped),
            **failure_details(read_incidents(metrics.parent), records, attempt - 1, started_at),
        }
    )
    if rank == 0:
        note_recovery(metrics.parent, progress.recoveries[-1])
    log.info("resumed at step %d, epoch %d", progress.step, progress.epoch)
    return progress
