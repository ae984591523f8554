"""A fleet of worker processes, each restarted on its own when it dies.

torch's elastic agent stops and restarts the whole group when any worker fails. Two modes
need the opposite, the survivors carrying on: in-place recovery (launch/inplace.py) and the
parameter server (launch/ps.py). Both run one worker process per rank with the environment
the agent would give (RANK, WORLD_SIZE, LOCAL_RANK, ...; TORCHELASTIC_RESTART_COUNT is the
rank's own attempt), and restart a dead rank up to --max-restarts times. Every death goes to
logs/incidents.jsonl. A rank that exits 0 is finished; when the fleet is stopped or fails,
every process left is SIGKILLed (each runs in its own session, and dies with its parent:
runtime.die_with_parent). Each process is forked from the launcher's fork server (launch/
forkserver.py), as the restart mode's workers are: started afresh, each spent over a second
of CPU importing torch, all at once at the start, and again at every restart.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.io import append_jsonl

if TYPE_CHECKING:
    from scaletrain.config import RunConfig
    from scaletrain.launch.forkserver import ForkedProcess


def describe_exit(code: int) -> str:
    from scaletrain.fault.internal import INTERNAL_EXIT_CODE
    from scaletrain.fault.watchdog import HANG_EXIT_CODE

    if code == HANG_EXIT_CODE:
        return "hang: ended by its watchdog after --hang-timeout-s without progress"
    if code == INTERNAL_EXIT_CODE:
        return "internal failure (a bug in scaletrain, not in the input; not restarted)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessFleet:
    def __init__(
        self, run_dir: Path, world: int, max_restarts: int, local: range | None = None
    ) -> None:
        """``local``: the global ranks this node runs (default: all of them)."""
        self.run_dir, self.world, self.max_restarts = run_dir, world, max_restarts
        self.local = local if local is not None else range(world)
        self.attempts = [0] * world
        self.procs: dict[int, ForkedProcess] = {}
        self.deaths: list[dict[str, Any]] = []
        self.finished: set[int] = set()
        self.failed: set[int] = set()  # dead for good
        # Ended by an internal failure (fault/internal.py): never restarted, the job fails.
        self.internal: set[int] = set()

    def env(self, rank: int) -> dict[str, str]:
        """The environment of ``rank``'s process (subclasses add their own)."""
        from scaletrain import env

        return {
            **os.environ,
            env.AGENT_PID: str(os.getpid()),  # its parent is the fork server, not this process
            "RANK": str(rank),
            "LOCAL_RANK": str(rank - self.local.start),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(len(self.local)),
            "TORCHELASTIC_RESTART_COUNT": str(self.attempts[rank]),
        }

    def start(self, rank: int) -> None:
        from scaletrain.launch.forkserver import ForkedProcess
        from scaletrain.worker import forked_in_fleet

        self.procs[rank] = ForkedProcess(forked_in_fleet, str(self.run_dir), self.env(rank))

    def may_restart(self, rank: int) -> bool:
        return self.attempts[rank] < self.max_restarts

    def keep_running(self) -> bool:
        """Whether to keep watching (default: while any process runs)."""
        return bool(self.procs)

    def poll(self) -> None:
        """Reap exited processes, restarting the dead ones that may be restarted."""
        for rank, proc in list(self.procs.items()):
            if self.procs.get(rank) is not proc:
                continue  # replaced during this pass (in place: every replica started again)
            code = proc.poll()
            if code is None:
                continue
            del self.procs[rank]
            if code == 0:
                self.finished.add(rank)
                self.ended(rank, "finished")
            else:
                self._died(rank, code)

    def run(self, ranks: range | list[int] | None = None) -> None:
        try:
            for rank in ranks if ranks is not None else self.local:
                self.start(rank)
            while self.keep_running():
                self.poll()
                time.sleep(0.02)
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()

    def _record_death(self, rank: int, code: int, restarted: bool, **extra: Any) -> dict:
        """``rank``'s death as a line of logs/incidents.jsonl (and the line's fields)."""
        died = time.time()
        death = {"rank": rank, "cause": self.cause_of(rank, code), "attempt": self.attempts[rank],
                 "died_at": died, "restarted": restarted}  # fmt: skip
        append_jsonl(
            self.run_dir / "logs" / "incidents.jsonl",
            {"kind": self.kind(rank), **death, "detected_at": died, **extra},
        )
        return death

    def cause_of(self, rank: int, code: int) -> str:
        """What ended ``rank``'s process, which exited with ``code``."""
        return describe_exit(code)

    def _died(self, rank: int, code: int) -> None:
        from scaletrain.fault.internal import INTERNAL_EXIT_CODE

        internal = code == INTERNAL_EXIT_CODE
        death = self._record_death(rank, code, not internal and self.may_restart(rank))
        self.deaths.append(death)
        self.died(rank, self.attempts[rank], death["cause"])
        if death["restarted"]:
            self.attempts[rank] += 1
            death["restarted_at"] = time.time()
            self.start(rank)
        else:
            self.failed.add(rank)
            if internal:
                self.internal.add(rank)
            self.ended(rank, "internal" if internal else "failed")

    def died(self, rank: int, attempt: int, cause: str) -> None:
        """``rank``'s process ``attempt`` died (before any restart); for subclasses to
        publish."""

    def ended(self, rank: int, how: str) -> None:
        """``rank`` finished, or failed for good (``how``); for subclasses to publish."""

    def kind(self, rank: int) -> str:
        return "death"


class JobFleet(ProcessFleet):
    """This node's share of a job of --nnodes N x --nproc-per-node P processes: node i runs
    the global ranks i*P .. i*P+P-1; node 0 (``is_head``) hosts what the job shares."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        from scaletrain.config import parse_nnodes

        self.nnodes, nproc = parse_nnodes(cfg.launch.nnodes)[0], cfg.launch.nproc_per_node
        first = cfg.launch.node_rank * nproc
        super().__init__(
            run_dir, self.nnodes * nproc, cfg.launch.max_restarts, range(first, first + nproc)
        )
        self.cfg = cfg
        self.is_head = cfg.launch.node_rank == 0
