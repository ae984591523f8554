"""In-place recovery, launcher side: host torchft's lighthouse, start one worker process per
replica, and when one dies restart only that one (up to --max-restarts times each) while the
others keep training (the in-place strategy of the one loop: strategies/inplace.py). torch's
elastic agent cannot do this: it stops and restarts the whole group on any failure.

Each death is recorded in logs/incidents.jsonl and, at the end, in summary.json's
``recoveries`` with times read back from metrics.jsonl: ``detected_s``, from the death to the
survivors' next quorum without the dead replica (the lighthouse notices a missing heartbeat
after HEARTBEAT_TIMEOUT_MS); ``resumed_s``, from there to their first committed step; and for
a restarted replica ``rejoined_step`` and ``rejoin_s`` (relaunch to its first committed step,
most of it a fresh Python importing torch). ``lost_steps`` is 0 by construction: nothing rolls
back; a step that was in flight is not applied and its samples are trained in the next one.

With --checkpoint-every, the replica at quorum rank 0 of a step writes its checkpoint
(checkpointing.ReplicaCheckpointing) and the same command after the whole job was lost
continues from the newest (lifecycle.FleetWorld.resume); a preemption signal asks the
replicas to checkpoint and leave (launch.fleet_stopper), and the launcher then raises
Preempted (exit 3).

A replica heals from a peer that holds the training state: one that started with the job
run, or a restarted one once it has committed a step. When a replica dies and no other one
holds the state (every replica lost at once, or the last holder died while the others were
still healing), there is nobody to heal from: on one node the supervisor then does what the
same command would, without waiting for anyone to type it. It ends the job run ("lost every
replica") and begins the next one in the same launcher, with a fresh lighthouse: every
replica starts again from the newest checkpoint (from the start without one, as the restart
mode's group does), which costs each replica one of its --max-restarts. The steps trained
after that checkpoint are redone and accounted as a job's resume is (summary.json's
``recoveries``). Across nodes a replica of another node may still hold the state, which this
node cannot see: there the job run fails as before and the same command continues it.

Replica groups (HSDP in place: ``--strategy fsdp --replica-size R``): a replica is a group
of R consecutive ranks that shard the model among themselves with FSDP over a process group
of their own, whose store listens on a port the supervisor holds for the group
(net.holding_socket; env.GROUP_PORT). A rank that dies leaves its group's collectives hung,
so the supervisor ends its group mates at once (each recorded as stopped with its group) and
restarts the whole group, on a fresh port, each rank spending one of its --max-restarts;
the other groups train on, and the restarted one heals its shards, rank by rank, from a
live group (strategies/inplace_hsdp.py).

Across nodes (``--nnodes N``), node i's supervisor runs replicas ``i*nproc ..``; node 0 hosts
the lighthouse at --rdzv-endpoint (listening on --bind, by default that address), and every
replica listens on, and advertises, its node's address (env.ADDR). The run directory is
shared (replicas write their steps and finals there); node 0 writes summary.json. A replica
of another node that leaves the quorum without its node recording a death (the node died, or
its network did) is recorded from metrics.jsonl as ``cause: "left"``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from scaletrain import env
from scaletrain.config import RunConfig
from scaletrain.fault.checkpoint import read_index
from scaletrain.fault.jobs import current_job_run
from scaletrain.fault.preempt import preemption_request
from scaletrain.fault.recoveries import inplace_recoveries, run_recoveries
from scaletrain.io import read_jsonl
from scaletrain.launch.errors import Preempted
from scaletrain.launch.fleet import JobFleet
from scaletrain.lifecycle import read_finals
from scaletrain.metrics.logs import tail
from scaletrain.metrics.summary import SummaryParts, write_summary
from scaletrain.net import route_address, url_host

# The lighthouse drops a replica whose heartbeats (every 100 ms) stop for this long.
HEARTBEAT_TIMEOUT_MS = 500
# How long a quorum waits for replicas that are alive (heartbeating) but have not asked to
# join yet: a replica still computing, healing or starting. A dead replica stops beating and
# is not waited for past HEARTBEAT_TIMEOUT_MS, so this bounds only the wait for live ones.
# It was 100 ms: at 32 replicas on 2 cores the requests of one step spread over more than
# that, the lighthouse formed each quorum with the first majority (17 of 32), and the other
# 15 healed from a peer at every step, never contributing a gradient (torchft's own default
# is 60 s). It stays below the replicas' quorum timeout (--timeout-s), which would fail them.
JOIN_TIMEOUT_MS = 5000

log = logging.getLogger(__name__)


def join_timeout_ms(timeout_s: float) -> int:
    return int(min(JOIN_TIMEOUT_MS, timeout_s * 1000 / 4))


class InplaceFailed(RuntimeError):
    """Every replica failed for good."""


class Supervisor(JobFleet):
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        # The lighthouse logs every quorum at INFO from Rust, into the launcher's terminal.
        os.environ.setdefault("RUST_LOG", "warn")
        super().__init__(cfg, run_dir)
        self.started_at = time.time()
        self._clear_finals()
        self.spent = [0] * self.world  # restarts used in this launcher's earlier job runs
        self.lighthouse: Any = None
        # HSDP in place: groups of this many ranks restart together, each with a store.
        self.grouped = cfg.train.strategy == "fsdp"
        self.group_size = cfg.parallel.replica_size if self.grouped else 1
        self.group_ports: dict[int, Any] = {}  # group -> the socket holding its store's port
        self._stopped_with: dict[int, int] = {}  # a group mate ended -> the rank that died
        if self.nnodes == 1:
            self.host, self.port, self.addr = "127.0.0.1", 0, "127.0.0.1"
        else:
            host, _, port_text = cfg.launch.rdzv_endpoint.rpartition(":")
            self.host, self.port = host.strip("[]"), int(port_text)
            self.addr = cfg.launch.local_addr or route_address(self.host, self.port)
        self._start_lighthouse()

    def _clear_finals(self) -> None:
        """A job run's finals are its own: an earlier run's would end it."""
        if self.is_head:
            shutil.rmtree(self.run_dir / "logs" / "final", ignore_errors=True)

    def _start_lighthouse(self) -> None:
        from torchft.coordination import LighthouseServer

        port = self.port
        if self.is_head:
            if self.lighthouse is not None:
                self.lighthouse.shutdown()
            self.lighthouse = LighthouseServer(
                bind=f"{url_host(self.cfg.launch.bind or self.host)}:{port}",
                min_replicas=1,
                join_timeout_ms=join_timeout_ms(self.cfg.launch.timeout_s),
                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
            )
            port = int(self.lighthouse.address().rpartition(":")[2])
        # torchft's address() names this machine's hostname; the others dial the address.
        self.lighthouse_url = f"http://{url_host(self.host)}:{port}"

    def env(self, rank: int) -> dict[str, str]:
        extra = {}
        if self.grouped:
            group = rank // self.group_size
            if group not in self.group_ports:
                self._new_group_port(group)
            extra[env.GROUP_PORT] = str(self.group_ports[group].getsockname()[1])
        return {
            **super().env(rank),
            env.LIGHTHOUSE: self.lighthouse_url,
            env.ADDR: self.addr,
            env.MODE: "inplace",
            **extra,
        }

    # -- replica groups (HSDP in place) ------------------------------------------------------
    def group_of(self, rank: int) -> list[int]:
        first = rank - rank % self.group_size
        return list(range(first, first + self.group_size))

    def _new_group_port(self, group: int) -> None:
        """A fresh port for ``group``'s store: the old one may still be in TIME_WAIT, or held
        by a store that a killed rank's children have not let go of yet."""
        from scaletrain.net import holding_socket

        old = self.group_ports.pop(group, None)
        if old is not None:
            old.close()
        self.group_ports[group] = holding_socket()

    def _stop_mates(self, rank: int) -> list[tuple[int, int]]:
        """End the live ranks of ``rank``'s group (their collectives wait on it in vain):
        each (mate, exit code), out of the fleet's watch."""
        stopped = []
        for mate in self.group_of(rank):
            proc = self.procs.pop(mate, None) if mate != rank else None
            if proc is None:
                continue
            proc.kill()
            code = proc.wait()
            stopped.append((mate, -9 if code is None else code))
            self._stopped_with[mate] = rank
        return stopped

    def cause_of(self, rank: int, code: int) -> str:
        died = self._stopped_with.pop(rank, None)
        if died is not None:
            return f"stopped with its replica group: rank {died} of the group died"
        return super().cause_of(rank, code)

    def may_restart(self, rank: int) -> bool:
        # Once a replica has finished, the run is over: nothing to rejoin. Restarts spent in
        # the earlier job runs of this launcher count (attempts restart at 0 in each).
        used = self.spent[rank] + self.attempts[rank]
        return used < self.max_restarts and not self.finished

    # -- every replica lost at once: the next job run, in this launcher ----------------------
    def _died(self, rank: int, code: int) -> None:
        mates = self._stop_mates(rank) if self.grouped else []
        # Across nodes, the other nodes' launchers hold replicas this one cannot see.
        healing = self._healing_without(rank) if self.nnodes == 1 else None
        if healing is not None and self._may_begin_again(healing):
            self._begin_job_run(rank, code, healing, mates)
            return
        if self.grouped:
            self._new_group_port(rank // self.group_size)
        for r, exit_code in [(rank, code), *mates]:
            super()._died(r, exit_code)

    def _healing_without(self, rank: int) -> set[int] | None:
        """The live replicas outside ``rank``'s (its group's ranks under HSDP), when none of
        them holds the training state (each is a restarted one that has not committed a step
        yet: it is still healing); None when one holds it (it started with the job run, or
        committed a step since)."""
        group = set(self.group_of(rank))
        alive = {r for r, proc in self.procs.items() if r not in group and proc.poll() is None}
        if any(self.attempts[r] == 0 for r in alive):
            return None
        healed = {(r["rank"], r["attempt"]) for r in self.job_run_records()}
        if any((r, self.attempts[r]) in healed for r in alive):
            return None
        return alive

    def _charge(self, rank: int, healing: set[int]) -> int:
        """The restarts beginning again costs ``rank``: one, and those of this job run; a
        replica still healing from its restart is started again in that restart's stead."""
        return self.attempts[rank] + (0 if rank in healing else 1)

    def _may_begin_again(self, healing: set[int]) -> bool:
        limit = self.max_restarts
        return not self.finished and all(
            self.spent[r] + self._charge(r, healing) <= limit for r in self.local
        )

    def _begin_job_run(
        self, rank: int, code: int, healing: set[int], mates: list[tuple[int, int]]
    ) -> None:
        from scaletrain.launch.fleet import describe_exit
        from scaletrain.launch.jobs import JobRun, end_job_run, next_attempt, start_job_run

        # It, its group mates ended with it, and the others found dead in the same pass
        # (killed together).
        lost = [(rank, code), *mates] + [
            (r, died) for r, proc in self.procs.items()
            if r != rank and (died := proc.poll()) is not None and died != 0
        ]  # fmt: skip
        for r, exit_code in lost:
            self._record_death(r, exit_code, restarted=True, job_lost=True)
        log.warning(
            "rank %d died (%s) and no replica holds the training state: the job run begins "
            "again from the newest checkpoint", rank, describe_exit(code),
        )  # fmt: skip
        for r in self.local:
            self.spent[r] += self._charge(r, healing)
        self.stop_all()  # replicas restarted before it that had not healed yet
        number = current_job_run(self.run_dir)[0]
        end_job_run(self.run_dir, "lost every replica at once (continued by its launcher)")
        job = JobRun(number=number + 1, attempt_base=next_attempt(self.run_dir),
                     resumed_from="unfinished")  # fmt: skip
        start_job_run(self.run_dir, job, self.cfg, None)
        for r in self.local:
            self.attempts[r] = 0
        self.deaths = []  # this job run's; the lost one's are in logs/incidents.jsonl
        self.started_at = time.time()
        self._clear_finals()
        self._start_lighthouse()  # a fresh one, as the same command would start
        for group in list(self.group_ports):
            self._new_group_port(group)
        for r in self.local:
            self.start(r)

    def kind(self, rank: int) -> str:
        return "inplace"

    def run(self, ranks: range | list[int] | None = None) -> None:
        try:
            super().run(ranks)
        finally:
            if self.lighthouse is not None:
                self.lighthouse.shutdown()
            for held in self.group_ports.values():
                held.close()
        request = preemption_request(self.run_dir)
        if request is not None:  # every replica left after checkpointing (fleet_stopper)
            index = read_index(self.run_dir / "checkpoints")
            step = index[-1]["step"] if index else 0
            raise Preempted(
                f"preempted by {request['signal']}: the replicas left after step {step}, "
                f"checkpointed in {self.run_dir / 'checkpoints'}; run the same command (--out "
                f"{self.run_dir}) to continue the job"
            )
        if not self.finished:
            last = self.deaths[-1] if self.deaths else {"rank": 0, "cause": "no replica finished"}
            log = self.run_dir / "logs" / f"rank{last['rank']}.log"
            raise InplaceFailed(
                f"every replica failed; the last, rank {last['rank']}, {last['cause']}. "
                f"Last lines of {log}:\n" + "\n".join(tail(log))
            )

    def recoveries(self) -> list[dict[str, Any]]:
        """Each death, timed from the steps in metrics.jsonl: this node's, those other nodes'
        supervisors recorded (logs/incidents.jsonl), and replicas of other nodes that left
        with no death recorded (their node died, or its network did)."""
        records = self.job_run_records()
        incidents = self.run_dir / "logs" / "incidents.jsonl"
        trained = {(r["rank"], r["attempt"]) for r in records}
        remote = [  # a replica restarted there that never trained again adds nothing here
            i
            for i in read_jsonl(incidents)
            if i["kind"] == "inplace" and i["rank"] not in self.local
            and (i["rank"], i["attempt"]) in trained and i["detected_at"] >= self.started_at
        ]  # fmt: skip
        deaths = [*self.deaths, *remote]
        last_step = max((r["step"] for r in records), default=0)
        for rank in sorted({r["rank"] for r in records} - set(self.local)):
            mine = [r for r in records if r["rank"] == rank]
            last = max(mine, key=lambda r: r["unix_time"])
            recorded = any(d["rank"] == rank and d["attempt"] == last["attempt"] for d in deaths)
            if last["step"] < last_step and not recorded:
                deaths.append({"rank": rank, "attempt": last["attempt"], "restarted": False,
                               "died_at": last["unix_time"], "cause": "left: its node "
                               "stopped answering (down, or cut off)"})  # fmt: skip
        return inplace_recoveries(deaths, records, self.world)

    def job_run_records(self) -> list[dict[str, Any]]:
        """This job run's steps (every job run's replicas count their attempts from 0)."""
        job_run = current_job_run(self.run_dir)[0]
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        return [r for r in records if r.get("job_run", 0) == job_run]

    def wait_for_remote_finals(self, timeout_s: float = 30.0) -> None:
        """Replicas of other nodes that reached the last step write their finals a moment
        after this node's: wait for those (not for replicas that left)."""
        path = self.run_dir / "metrics.jsonl"
        if len(self.local) == self.world or not path.exists():
            return
        records = read_jsonl(path)
        last_step = max((r["step"] for r in records), default=0)
        ending = {r["rank"] for r in records if r["step"] == last_step} - set(self.local)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ending <= {f.rank for f in read_finals(self.run_dir)}:
                return
            time.sleep(0.2)

    def summary(self) -> dict[str, Any]:
        self.wait_for_remote_finals()
        finals = read_finals(self.run_dir)
        # The replica that trained longest (a restarted one joined late).
        main = max(finals, key=lambda f: (f.step, f.wall_s))
        cfg = self.cfg
        extras: dict[str, Any] = {"recovery": "inplace"}
        if self.grouped:
            extras["hsdp"] = {"replica_size": self.group_size,
                              "replica_groups": self.world // self.group_size}  # fmt: skip
        if main.checkpointing.get("mode", "none") != "none":
            # The saves of every replica that wrote some (the writer changes with the quorum).
            extras["checkpointing"] = {
                **main.checkpointing,
                "saves": sum(f.checkpointing.get("saves", 0) for f in finals),
            }
        return write_summary(cfg, self.run_dir, SummaryParts(
            finals=finals,
            steps=main.step,
            samples=main.samples_trained,
            # The job's resumes from a checkpoint (FleetWorld.resume), then this run's deaths.
            recoveries=run_recoveries(self.run_dir, []) + self.recoveries(),
            checkpoint_s=max(f.checkpoint_s for f in finals),
            params_hash=main.params_sha256,
            wall_s=main.wall_s,
            data_world_size=self.world,
            steps_per_epoch=main.steps_per_epoch,
            backend="gloo",
            world_size=self.world,
            extras=extras,
        ))  # fmt: skip


def run_inplace(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    supervisor = Supervisor(cfg, run_dir)
    supervisor.run()
    if not supervisor.is_head:
        return {}  # node 0 writes summary.json
    return supervisor.summary()


def run_inplace_mode(cfg: RunConfig, run_dir: Path, show_progress: bool) -> dict[str, Any]:
    """--recovery inplace: our own supervisor instead of the elastic agent."""
    from scaletrain.launch.errors import WorkerFailed
    from scaletrain.launch.worker_env import set_launch_env
    from scaletrain.metrics.progress import ProgressView

    set_launch_env(cfg, local_only=not cfg.launch.rdzv_endpoint)
    try:
        with ProgressView(run_dir / "metrics.jsonl", enabled=show_progress):
            summary = run_inplace(cfg, run_dir)
    except InplaceFailed as e:
        raise WorkerFailed(str(e)) from None
    summary["run_dir"] = str(run_dir)
    return summary
