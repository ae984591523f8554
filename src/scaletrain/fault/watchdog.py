"""Hang detection: heartbeats in the job's store, and a watchdog thread per worker that turns
"no progress for --hang-timeout-s" into an error naming the rank, the step and the collective
it did not reach, then ends the worker, so the elastic agent recovers as from a death.

Each worker's trainer marks what it is doing (``enter(step, phase, collective)``); a thread
publishes that mark once a second to the worker group's TCPStore (a client connection of its
own: the server thread lives in rank 0 and answers even while rank 0's Python is blocked in a
collective). When a worker's mark has not changed for the timeout, its watchdog reads every
rank's heartbeat and names the culprits (``diagnose``, pure):

- ranks whose heartbeat stopped (a frozen process: no Python thread runs any more; or a host
  whose network is gone), and
- ranks busy outside any collective while others wait in one (the injected hang, a deadlock
  in a data loader, a stuck file system).

It writes the report to its log, to the agent's error file (so the launcher prints it) and to
DIR/logs/incidents.jsonl (which the next attempt turns into summary.json's recoveries entry),
and exits with status 75. Every waiting rank reaches the timeout at about the same time and
does the same, so a hang ends even when the stuck rank cannot act. Without --max-restarts the
run then fails with that report instead of sitting in a collective until gloo's own timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from scaletrain.io import append_jsonl, atomic_write_json

log = logging.getLogger("scaletrain.watchdog")

HANG_EXIT_CODE = 75
BEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Beat:
    step: int
    phase: str
    collective: str  # the collective this phase ends in, or "" when it has none
    since: float  # wall-clock time the phase began
    published: float = 0.0  # wall-clock time of the last heartbeat


@dataclass(frozen=True)
class Diagnosis:
    culprits: list[int]
    step: int
    collective: str
    message: str
    since: float  # wall-clock time the stall began (the culprits' last progress)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def diagnose(beats: dict[int, Beat | None], now: float, timeout_s: float) -> Diagnosis:
    """Who stalls the job. ``beats`` holds every rank's last heartbeat (None: never seen)."""
    silent = sorted(
        r for r, b in beats.items() if b is None or now - b.published > 3 * BEAT_INTERVAL_S + 1
    )
    alive = {r: b for r, b in beats.items() if b is not None and r not in silent}
    waiting = {r: b for r, b in alive.items() if b.collective}
    busy = sorted(r for r, b in alive.items() if not b.collective)
    culprits = sorted(silent + busy) if waiting else silent
    if waiting:
        step, collective = max((b.step, b.collective) for b in waiting.values())
    else:
        step = min((b.step for b in alive.values()), default=0)
        collective = "its next collective"
    stalled = max((now - b.since for b in alive.values()), default=timeout_s)
    since = min(
        [b.published if r in silent else b.since for r in culprits if (b := beats[r])]
        or [now - stalled]
    )
    if not culprits:
        return Diagnosis(
            [], step, collective,
            f"hang detected: {_ranks(sorted(waiting))} have waited {stalled:.0f} s in the "
            f"{collective} of step {step}, which never completed; no rank is missing from it "
            "(a network or backend problem?)", since,
        )  # fmt: skip
    parts = []
    for r in culprits:
        b = beats[r]
        if b is None:
            parts.append(f"rank {r} never sent a heartbeat")
        elif r in silent:
            parts.append(f"rank {r} stopped sending heartbeats {now - b.published:.0f} s ago "
                         f"(at step {b.step}, {b.phase}): the process is frozen "
                         "or its host unreachable")  # fmt: skip
        else:
            parts.append(f"rank {r} has been in '{b.phase}' of step {b.step} for "
                         f"{now - b.since:.0f} s")  # fmt: skip
    others = sorted(waiting)
    verb = "waits" if len(others) == 1 else "wait"
    tail = f" while {_ranks(others)} {verb} in it" if others else ""
    return Diagnosis(
        culprits, step, collective,
        f"hang detected: {_ranks(culprits)} did not reach the {collective} of step {step}{tail}: "
        + "; ".join(parts) + f" (--hang-timeout-s {timeout_s:g})", since,
    )  # fmt: skip


def _connect_store(timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def beat_age_s(path: Path, since: float) -> float:
    """Seconds since ``path`` was last touched, or since ``since`` (a process's start, wall
    clock) when it was not touched after it."""
    try:
        last = max(path.stat().st_mtime, since)
    except OSError:
        last = since
    return time.time() - last


class NullWatchdog:
    """Where no group store holds heartbeats (processes the launcher supervises one by one:
    in-place replicas, parameter-server workers), the loop marks its phases all the same."""

    def enter(self, step: int, phase: str, collective: str = "") -> None:
        return None

    def start(self) -> NullWatchdog:
        return self

    def stop(self) -> None:
        return None


class SelfWatchdog(NullWatchdog):
    """A process's own watchdog, where the launcher supervises each process on its own
    (in-place replicas, parameter-server workers): no store of the group's heartbeats, no
    group to diagnose. A process whose mark has not moved for ``timeout_s`` outside any
    collective is the one stuck (waiting inside a collective, it is a peer's fault: the
    collective's own timeout, the same value, ends that wait and its replica goes on without
    the peer); it names itself in its log and exits with HANG_EXIT_CODE, and its launcher
    restarts it (a replica heals from a live peer; a worker's leases go to the others).
    Inside a collective it waits three times as long before ending itself, in case that
    timeout never fires. In the phase IDLE (a parameter server waiting for pushes: it owes
    nobody anything) it never does."""

    IDLE = "idle"

    def __init__(self, *, rank: int, timeout_s: float, beat_path: Path | None = None) -> None:
        """``beat_path``: a file this thread touches every BEAT_INTERVAL_S, for a supervisor
        to see that the process still runs (a frozen process stops touching it)."""
        self.rank, self.timeout_s, self.beat_path = rank, timeout_s, beat_path
        self._beat = Beat(0, "starting", "", time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scaletrain-watchdog")

    def enter(self, step: int, phase: str, collective: str = "") -> None:
        self._beat = Beat(step, phase, collective, time.time())

    def start(self) -> SelfWatchdog:
        """Starts the thread; the first beat is now, before the caller goes on: a process
        frozen before the thread's first beat would never count as having beaten, and its
        supervisor would take it for one still starting (a parameter server frozen 0.3 s
        after it began to serve was never ended)."""
        self.enter(0, "starting")  # the clock starts with the loop, not with the set-up
        if self.beat_path is not None:
            touch(self.beat_path)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        interval = BEAT_INTERVAL_S / 4
        checked = touched = time.monotonic()  # start() beat
        grace_until = 0.0
        while not self._stop.wait(interval):
            now = time.monotonic()
            if self.beat_path is not None and now - touched >= BEAT_INTERVAL_S:
                touch(self.beat_path)
                touched = now
            if now - checked > 4 * interval + 1.0:
                # This thread did not run for a while: the whole process was frozen (SIGSTOP,
                # a suspended VM), not its loop alone. Give the loop a full timeout to move.
                grace_until = now + self.timeout_s
            checked = now
            beat = self._beat  # read once: the trainer may move on while we look
            if beat.phase == self.IDLE:
                continue
            limit = self.timeout_s * (3 if beat.collective else 1)
            stalled = time.time() - beat.since
            if stalled > limit and now >= grace_until:
                where = (f"waiting in the {beat.collective}" if beat.collective
                         else "outside any collective")  # fmt: skip
                log.error(
                    "hang detected: rank %d has been in '%s' of step %d for %.0f s, %s "
                    "(--hang-timeout-s %g): it ends itself, and its launcher restarts it",
                    self.rank, beat.phase, beat.step, stalled, where, self.timeout_s,
                )  # fmt: skip
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(HANG_EXIT_CODE)


class Watchdog(NullWatchdog):
    def __init__(
        self, *, rank: int, world_size: int, attempt: int, timeout_s: float, run_dir: Path
    ) -> None:
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.timeout_s = timeout_s
        self.run_dir = run_dir
        self._beat = Beat(0, "starting", "", time.time())
        self._stop = threading.Event()
        # Two threads: store calls can block for good (torch's TCPStore client waits in recv()
        # without a timeout when the store's host is cut off), the timeout check must not.
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scaletrain-watchdog")
        self._publisher = threading.Thread(
            target=self._publish_loop, daemon=True, name="scaletrain-heartbeat"
        )
        self._store: Any = None

    def enter(self, step: int, phase: str, collective: str = "") -> None:
        """Mark the start of a phase (one attribute assignment: cheap enough for every step)."""
        self._beat = Beat(step, phase, collective, time.time())

    def start(self) -> Watchdog:
        self._thread.start()
        self._publisher.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _key(self, rank: int) -> str:
        return f"scaletrain/beat/{self.attempt}/{rank}"

    def _publish(self) -> None:
        beat = self._beat
        payload = json.dumps({**asdict(beat), "published": time.time()})
        try:
            if self._store is None:
                self._store = _connect_store(5.0)
            self._store.set(self._key(self.rank), payload)
        except Exception as e:  # the store's host may be gone; diagnose without it
            log.debug("heartbeat not published: %s", e)

    def _read_beats(self) -> dict[int, Beat | None]:
        """Every rank's heartbeat (None: it published none this attempt). Raises when the
        store fails: a host whose cable is cut gets an error at once (the network is down),
        and must not take the silence it reads for the other ranks' fault."""
        if self._store is None:
            raise ConnectionError("this rank never reached the heartbeat store")
        beats: dict[int, Beat | None] = {}
        for rank in range(self.world_size):
            beats[rank] = None
            if self._store.check([self._key(rank)]):
                beats[rank] = Beat(**json.loads(self._store.get(self._key(rank))))
        if beats[self.rank] is None:  # our own view never depends on the store
            beats[self.rank] = Beat(**{**asdict(self._beat), "published": time.time()})
        return beats

    def _publish_loop(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            self._publish()

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            since = self._beat.since  # read once: the trainer may move on while we report
            if time.time() - since > self.timeout_s:
                self._fire(since)

    def _beats_within(self, limit_s: float) -> dict[int, Beat | None] | None:
        """Every rank's heartbeat, or None when the store fails or does not answer in
        ``limit_s``."""
        result: list[dict[int, Beat | None]] = []

        def read() -> None:
            try:
                result.append(self._read_beats())
            except Exception as e:
                log.warning("heartbeats unreadable: %s", e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(limit_s)
        return result[0] if result else None

    def _fire(self, waited_since: float) -> None:
        beats = self._beats_within(3 * BEAT_INTERVAL_S)
        unreachable = beats is None
        if beats is None:
            own = Beat(**{**asdict(self._beat), "published": time.time()})
            beats = {r: (own if r == self.rank else None) for r in range(self.world_size)}
        diagnosis = diagnose(beats, time.time(), self.timeout_s)
        if unreachable:
            diagnosis = dataclasses.replace(
                diagnosis,
                message=diagnosis.message + " (the heartbeat store, on rank 0's host, did not "
                "answer: that host, or this one, may be cut off)",
            )
        log.error("%s", diagnosis.message)
        self._record(diagnosis, unreachable, waited_since)
        write_error_file(diagnosis.message)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(HANG_EXIT_CODE)

    def _record(self, diagnosis: Diagnosis, unreachable: bool, waited_since: float) -> None:
        incident = {
            "kind": "hang",
            "attempt": self.attempt,
            "reported_by": self.rank,
            # Seen without the store (this rank may be the one cut off): its culprits are a
            # guess, and a report of a rank that could read every heartbeat wins over it.
            "store_unreachable": unreachable,
            "ranks": diagnosis.culprits,
            "step": diagnosis.step,
            "collective": diagnosis.collective,
            "stalled_since": diagnosis.since,
            # This rank's own last progress: it fired --hang-timeout-s after this. Its wait can
            # begin before the fault (a collective entered before a cable was cut).
            "waited_since": waited_since,
            "detected_at": time.time(),
            "message": diagnosis.message,
        }
        append_incident(self.run_dir, incident)


def append_incident(run_dir: Path, incident: dict[str, Any]) -> None:
    append_jsonl(run_dir / "logs" / "incidents.jsonl", incident)


def write_error_file(message: str) -> None:
    """The agent's error file, in the format torch's @record writes, so the launcher's
    failure report shows ``message`` instead of a bare exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))},
        }
    }
    # Whole or absent: the agent reads it the moment this process is gone (see
    # metrics/logs.AtomicErrorHandler).
    atomic_write_json(Path(path), data)
