"""Checkpoints of one moment on every server: what a parameter-server job continues from
after it was killed whole.

Each server checkpoints its own slice. A job whose processes all died continues only from
checkpoints that hold the same updates on every server, with server 0's data plan of those
updates; otherwise a slice would hold pushes the others lack, and the plan would deal again
samples that a slice trained, or never deal samples that a slice lacks.

- bsp applies each global step once on every server, so every server's checkpoint of the
  same global step (``released_step``) is of the same updates.
- asp and ssp apply each push on arrival, each server in its own order, so two servers'
  periodic checkpoints would be of different pushes. Their checkpoints are **cuts**
  instead, taken every --checkpoint-every of server 0's updates, in two phases over the
  launcher's store:

  1. server 0 publishes the cut; every server *freezes* (holds each push that arrives,
     unapplied) and reports the pushes it has applied: each live worker's last clock;
  2. server 0 publishes the newest of each worker's pushes that any server applied; every
     server applies the held pushes up to those (they were sent to every server, since a
     worker sends its push to all at once), copies its state, thaws, and says so.

  A worker's next push waits for every server's reply to its last one, so servers differ
  by at most a worker's last push, and phase 2 evens them out: every copy holds the same
  pushes. Pushes are held for the store's round trips (tens of milliseconds), not for a
  slow worker's step: no lease has to come back, and server 0's data plan counts the
  leases still out as requeued. The copies are written after, in the background. A cut
  that a server missed (it restarted meanwhile, or stayed silent for --timeout-s) is
  abandoned: no checkpoint of it exists on every server, so none is continued from.

A cut is named by ``[job run, n]``, n counted by the launcher's store (``store.add``): a
restarted server 0 cannot name a new cut as an old one. A preemption is a cut too, taken
once every worker has left.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from scaletrain.fault.checkpoint import load_latest, read_index

log = logging.getLogger("scaletrain.ps.cuts")


Pushes = dict[int, tuple[int, int]]  # worker: (its process attempt, the clock of its push)


def encode(held: Pushes) -> str:
    return json.dumps({str(w): list(t) for w, t in held.items()})


def decode(text: bytes) -> Pushes:
    return {int(w): (int(t[0]), int(t[1])) for w, t in json.loads(text).items()}


def newest(reports: list[Pushes]) -> Pushes:
    """The pushes a cut holds: of each worker, the newest any server applied (of its
    newest process: an older one's pushes are whatever each server had of them)."""
    out: Pushes = {}
    for report in reports:
        for worker, push in report.items():
            out[worker] = max(out.get(worker, push), push)
    return out


def reached(held: Pushes, live: set[int], sessions: dict[int, int],
            clocks: dict[int, int]) -> bool:  # fmt: skip
    """Whether a server has applied every push of a cut: each worker's last push, unless
    that worker's process is no longer the one the cut names (it died, or left)."""
    return all(
        w not in live or sessions.get(w) != attempt or clocks.get(w, -1) >= clock
        for w, (attempt, clock) in held.items()
    )


def moment(state: dict[str, Any], mode: str) -> tuple[int, ...] | None:
    """What makes two servers' checkpoints of the same updates (None: nothing does)."""
    if mode == "bsp":
        return (int(state["released_step"]),)
    cut = state.get("cut")
    return tuple(int(c) for c in cut) if cut else None


def disagreement(clocks: list[dict[Any, int]]) -> str | None:
    """asp, ssp: how the copies of one cut differ in the pushes they applied (each worker
    live on two servers at their copies must have the same last push on both), or None.
    A worker missing from a copy had left that server, which is no disagreement."""
    for worker in sorted(set().union(*clocks), key=str):
        held = {k: c[worker] for k, c in enumerate(clocks) if worker in c}
        if len(set(held.values())) > 1:
            return f"worker {worker}'s last push applied: " + ", ".join(
                f"{c} on server {k}" for k, c in held.items()
            )
    return None


def consistent_checkpoint(run_dir: Path, num_servers: int, mode: str) -> list[int] | None:
    """Each server's version (its checkpoint's number) of the newest moment every server
    checkpointed intact (files read whole and checksummed) and alike, or None. Under asp and
    ssp the copies of a cut must hold the same pushes (``disagreement``); a cut whose copies
    differ is passed over with a warning that names them."""
    found: list[dict[tuple[int, ...], tuple[int, dict[Any, int]]]] = []
    for k in range(num_servers):
        directory = run_dir / "checkpoints" / f"server{k}"
        moments: dict[tuple[int, ...], tuple[int, dict[Any, int]]] = {}
        for entry in read_index(directory):
            state, _ = load_latest(directory, below=entry["step"] + 1)
            if state is None or state["version"] != entry["step"]:
                continue  # damaged: the one below it was loaded instead
            key = moment(state, mode)
            if key is not None and int(state["version"]) > moments.get(key, (-1, {}))[0]:
                moments[key] = (int(state["version"]), dict(state.get("clocks") or {}))
        found.append(moments)
    common = set.intersection(*(set(m) for m in found)) if found else set()
    for newest in sorted(common, reverse=True):
        differ = disagreement([m[newest][1] for m in found]) if mode != "bsp" else None
        if differ is None:
            return [m[newest][0] for m in found]
        log.warning("the copies of cut %s differ (%s): not continued from", list(newest), differ)
    return None
