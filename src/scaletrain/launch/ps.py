"""The parameter server, launcher side: host the store, start W workers and K servers, restart
each on its own when it dies, and build summary.json when the workers are done.

The launcher hosts the TCPStore through which links are set up (transport.py) and servers
announce their incarnations. Every death is published there at once (transport.death_key),
so that the peers of a process that died mid-message stop waiting for the rest of it. It
starts every process itself (fault/fleet.py) rather than through torch's elastic agent,
which would restart all of them on any death: under asp and ssp the survivors must not even
pause. A dead process is restarted up to --max-restarts times: a worker rejoins at the
servers' current version, a server reloads its last checkpointed slice.

When every worker has finished (or failed for good, as long as one finished) the launcher
sets ``ps/finish``; each server writes its final slice and exits. The launcher assembles the
model from the slices, scores the test split itself, and writes checkpoints/final.pt and
summary.json: the common contract (metrics/summary.py) plus ``ps`` (consistency, servers,
workers, partition) and
``staleness_histogram`` (applied gradients by staleness). Deaths, drops, rejoins and server
restores (logs/ps_events.jsonl) become ``recoveries``.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain import env
from scaletrain.config import RunConfig
from scaletrain.fault.preempt import preemption_request
from scaletrain.fault.recoveries import ps_job_resumes, ps_recoveries
from scaletrain.io import read_jsonl
from scaletrain.launch.errors import InternalFailure, Preempted
from scaletrain.launch.fleet import JobFleet
from scaletrain.lifecycle import read_finals, save_final_model
from scaletrain.metrics.logs import tail
from scaletrain.metrics.summary import SummaryParts, write_summary
from scaletrain.strategies.param_server import keys
from scaletrain.strategies.param_server.admission import launcher_token

# How long servers get to write their final slices once told to finish.
FINISH_GRACE_S = 60.0
# How long one of the beat thread's store calls may take: on a live link they answer in
# milliseconds; a refused or unreachable store is an error within this bound (a reply that
# never comes on a cut link is not: see close()).
BEAT_CALL_S = 5.0


log = logging.getLogger(__name__)


class PSFailed(RuntimeError):
    pass


class PSFleet(JobFleet):
    """This node's share of a parameter-server job. Across nodes (``--nnodes N``) the ranks
    are laid out as on one: workers first, the K servers last, node i running ranks
    ``i*nproc .. i*nproc+nproc-1``; node 0 hosts the store at --rdzv-endpoint (on --bind, by
    default that address), and every node publishes there how each of its ranks ended
    (``ps/end/RANK``), so node 0 can tell the servers to finish and wait for their slices.
    The run directory must be on a file system every node shares (the servers' final slices
    and the workers' totals are read from it), as for restart recovery."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        from scaletrain.net import bound_store, loopback_store

        super().__init__(cfg, run_dir)
        self.num_servers = cfg.ps.num_servers
        self.num_workers = self.world - self.num_servers
        # --ps-replicas: servers lost for good -> (the rank serving their slice, since when)
        self.taken_over: dict[int, tuple[int, float]] = {}
        self.lost_both: str | None = None
        self.listener = None
        if self.nnodes == 1:  # the processes are all local: the store listens on loopback only
            self.store, self.listener = loopback_store(cfg.launch.timeout_s)
            self.address = f"127.0.0.1:{self.store.port}"
        else:
            host, _, port = cfg.launch.rdzv_endpoint.rpartition(":")
            if self.is_head:
                self.store, self.listener = bound_store(
                    cfg.launch.bind or host, int(port), cfg.launch.timeout_s
                )
            else:
                self.store = TCPStore(host, int(port), is_master=False,
                                      timeout=timedelta(seconds=cfg.launch.timeout_s))  # fmt: skip
            self.address = cfg.launch.rdzv_endpoint
        self.finish_at: float | None = None
        # Node 0: the servers were told to checkpoint, not to finish (a preemption request
        # before every worker had finished; one that comes later lets the job finish).
        self.preempted = False
        self.started_wall: dict[int, float] = {}  # each rank's process start (wall clock)
        self.silenced: dict[int, str] = {}  # servers killed as frozen: why
        self._frozen_checked = 0.0
        self.token = launcher_token(cfg.launch.join_token_file)
        self._remote: dict[int, str] = {}  # how ranks of other nodes ended
        self._remote_read = 0.0
        # Across nodes, every node but 0 beats in the store once a second (its own thread
        # and connection: a store call on a cut link can block for good). Node 0 counts the
        # ranks of a node silent for --timeout-s as failed, and that node gives up on the job.
        self.silence_s = cfg.launch.timeout_s
        self._beats: dict[int, tuple[str, float]] = {}  # node -> (last beat, seen at)
        self.node_losses: list[dict[str, Any]] = []
        self._pending: dict[int, str] = {}  # ends to publish (by the beat thread)
        self._deaths_to_publish: dict[str, str] = {}  # death notices, likewise
        self._beat_ok = time.monotonic()
        self.cut_off = False
        self._stop_beat = threading.Event()
        self._beat_thread: threading.Thread | None = None
        if self.nnodes > 1 and not self.is_head:
            self._beat_thread = threading.Thread(
                target=self._beat, args=(host, int(port)), daemon=True, name="scaletrain-ps-beat"
            )
            self._beat_thread.start()

    def _beat(self, host: str, port: int) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = None
        while not self._stop_beat.is_set():
            try:
                if store is None:
                    timeout = timedelta(seconds=min(BEAT_CALL_S, self.silence_s))
                    store = TCPStore(host, port, is_master=False, timeout=timeout)
                for key, cause in list(self._deaths_to_publish.items()):
                    store.set(key, cause)
                    del self._deaths_to_publish[key]
                for rank, how in list(self._pending.items()):
                    store.set(keys.end(rank), how)
                    del self._pending[rank]
                # add() waits for node 0's answer; set() alone returns once the bytes are in
                # the local socket buffer, also when the cable is cut.
                store.add(keys.alive(self.cfg.launch.node_rank), 1)
                self._beat_ok = time.monotonic()
            except Exception:  # node 0 unreachable: keep trying; keep_running gives up
                store = None
            self._stop_beat.wait(1.0)

    def close(self) -> None:
        """Stop the beat thread once this node's part is over. It must not outlive the
        launcher: node 0 closes its store when the job ends, and a thread still calling it
        at interpreter exit aborts the process. A thread that does not stop in time is inside
        a call on a cut link that may never return: leaving.mark_stuck has the command line
        exit past it."""
        from scaletrain.launch.leaving import mark_stuck

        self._stop_beat.set()
        if self._beat_thread is not None:
            self._beat_thread.join(2 * BEAT_CALL_S)
            if self._beat_thread.is_alive():
                mark_stuck(self._beat_thread)

    def node_ranks(self, node: int) -> range:
        return range(node * len(self.local), (node + 1) * len(self.local))

    def _check_silent_nodes(self, now: float) -> None:
        """Node 0: the ranks of a node whose beat has not changed for silence_s failed."""
        for node in range(1, self.nnodes):
            key = keys.alive(node)
            beat = self.store.get(key).decode() if self.store.check([key]) else ""
            seen = self._beats.get(node)
            if seen is None or seen[0] != beat:
                self._beats[node] = (beat, now)
            elif now - seen[1] > self.silence_s:
                for rank in self.node_ranks(node):
                    if rank in self._remote:  # it ended, or was counted as lost already
                        continue
                    self._remote[rank] = "failed"
                    self.node_losses.append({
                        "rank": rank, "node": node, "attempt": 0, "restarted": False,
                        "died_at": time.time() - (now - seen[1]),
                        "cause": f"its node {node} went silent for {self.silence_s:g} s "
                                 "(down, or cut off)",
                    })  # fmt: skip

    def is_worker(self, rank: int) -> bool:
        return rank < self.num_workers

    def start(self, rank: int) -> None:
        self.started_wall[rank] = time.time()
        super().start(rank)

    def poll(self) -> None:
        self._end_frozen_servers()
        super().poll()

    def _end_frozen_servers(self) -> None:
        """Kill a local server whose heartbeat (a file its watchdog touches every second)
        has not moved for --hang-timeout-s: it is frozen whole (SIGSTOP, a wedged process)
        where its own watchdog cannot act. It then dies as any dead server does, and is
        restarted from its checkpoint. A server that has not beaten yet in this incarnation
        (still starting) is left alone."""
        from scaletrain.fault.watchdog import beat_age_s
        from scaletrain.strategies.param_server.server import server_beat_path

        now = time.monotonic()
        if now - self._frozen_checked < 0.5:
            return
        self._frozen_checked = now
        limit = self.cfg.hang_timeout_s
        for rank, proc in list(self.procs.items()):
            if self.is_worker(rank) or rank in self.silenced or proc.poll() is not None:
                continue
            beat = server_beat_path(self.run_dir, rank)
            started = self.started_wall[rank]
            if not beat.exists() or beat.stat().st_mtime < started:
                continue
            age = beat_age_s(beat, started)
            if age > limit:
                self.silenced[rank] = (
                    f"silent for {age:.0f} s (its heartbeat stopped: frozen, or wedged where "
                    f"its own watchdog cannot act), killed by its launcher after "
                    f"--hang-timeout-s {limit:g}"
                )
                log.warning("server rank %d: %s", rank, self.silenced[rank])
                proc.kill()

    def cause_of(self, rank: int, code: int) -> str:
        return self.silenced.pop(rank, None) or super().cause_of(rank, code)

    def env(self, rank: int) -> dict[str, str]:
        return {
            **super().env(rank),
            env.MODE: "ps",
            env.PS_ROLE: "worker" if self.is_worker(rank) else "server",
            env.PS_STORE: self.address,
            env.JOIN_TOKEN: self.token,
        }

    def kind(self, rank: int) -> str:
        return "ps-worker" if self.is_worker(rank) else "ps-server"

    def died(self, rank: int, attempt: int, cause: str) -> None:
        """Tell the dead process's peers (transport.PeerDied): node 0 at once, another node
        through its beat thread (a store call on a cut link can block for good)."""
        from scaletrain.strategies.param_server.transport import death_key  # imports torch

        if self.nnodes > 1 and not self.is_head:
            self._deaths_to_publish[death_key(rank, attempt)] = cause
        else:
            self.store.set(death_key(rank, attempt), cause)

    def ended(self, rank: int, how: str) -> None:
        if self.nnodes > 1 and not self.is_head:
            self._pending[rank] = how  # node 0 reads its own ranks' ends directly

    def ends(self) -> tuple[set[int], set[int]]:
        """(finished, failed for good): this node's ranks, and the others' as published."""
        now = time.monotonic()
        if now - self._remote_read > 0.5:
            self._remote_read = now
            for rank in set(range(self.world)) - set(self.local) - set(self._remote):
                if self.store.check([keys.end(rank)]):
                    self._remote[rank] = self.store.get(keys.end(rank)).decode()
            self._check_silent_nodes(now)
        finished = self.finished | {r for r, how in self._remote.items() if how == "finished"}
        self.internal |= {r for r, how in self._remote.items() if how == "internal"}
        failed = (
            self.failed | self.internal | {r for r, how in self._remote.items() if how == "failed"}
        )
        return finished, failed

    def keep_running(self) -> bool:
        if not self.is_head:  # node 0 decides when the job ends; here, run what is ours
            if self.nnodes > 1 and time.monotonic() - self._beat_ok > self.silence_s:
                self.cut_off = True
                return False
            servers = set(range(self.num_workers, self.world))
            if self._pending and not self.procs:
                return True  # until the beat thread has published how they ended
            return bool(self.procs) and not servers & self.failed and not self.internal
        finished, failed = self.ends()
        if self.internal:  # a bug, not a death: no restart or takeover can help
            return False
        workers = set(range(self.num_workers))
        servers = set(range(self.num_workers, self.world))
        if servers & failed and not self._take_over(servers & failed, failed):
            return False
        servers -= set(self.taken_over)
        if workers & failed == workers:
            return False
        if workers <= finished | failed and self.finish_at is None:
            # Preempted: the workers left after their steps; the servers checkpoint instead
            # of writing their final slices (server.py), and the launcher exits 3.
            self.preempted = preemption_request(self.run_dir) is not None
            self.store.set(keys.PREEMPT if self.preempted else keys.FINISH, "1")
            self.finish_at = time.monotonic()
        if self.finish_at is not None:
            waiting = servers - finished
            return bool(waiting) and time.monotonic() - self.finish_at < FINISH_GRACE_S
        return True

    def _take_over(self, lost: set[int], failed: set[int]) -> bool:
        """--ps-replicas: each server lost for good (no restart left, its node gone) has its
        slice served by its backup's process from then on (ps/promote/K). False when one's
        backup is lost too, or was before (a slice served there has no backup left)."""
        from scaletrain.strategies.param_server.replica import backup_of, promote_key, stale_key

        if not self.cfg.ps.ps_replicas:
            return False
        for rank in sorted(lost - set(self.taken_over)):
            k = rank - self.num_workers
            backup = self.num_workers + backup_of(k, self.num_servers)
            if backup in failed or backup in self.taken_over:
                self.lost_both = f"server {k}'s backup (rank {backup}) is lost too"
                return False
            log.warning("server %d (rank %d) is lost for good; its backup on rank %d serves "
                        "its slice from now on", k, rank, backup)  # fmt: skip
            self.store.set(promote_key(k), str(backup))
            self.taken_over[rank] = (backup, time.time())
        # A process serving a taken-over slice must not die: the slice has no copy left.
        for rank, (host, since) in self.taken_over.items():
            k = rank - self.num_workers
            if self.store.check([stale_key(k)]):
                self.lost_both = f"server {k}'s backup (rank {host}) held no current copy"
                return False
            if any(d["rank"] == host and d["died_at"] > since for d in self.deaths):
                self.lost_both = f"rank {host}, which served server {k}'s slice, died too"
                return False
        return True

    def check(self) -> None:
        """After run(): raise PSFailed unless the run completed (on node 0: the whole job;
        on another node: its own servers)."""
        if self.cut_off:
            raise PSFailed(
                f"this node lost node 0's store at {self.address}: no answer for "
                f"{self.silence_s:g} s (its network is down, or node 0 is gone); its processes "
                "were stopped"
            )
        finished, failed = self.ends() if self.is_head else (self.finished, self.failed)
        servers = set(range(self.num_workers, self.world))
        workers = set(range(self.num_workers))
        if not self.is_head:
            servers &= set(self.local)
            workers = set()
        if self.lost_both is None:  # a slice taken over by its backup's process is served
            servers -= set(self.taken_over)
        if self.internal:
            self._raise_internal()
        dead_server = sorted(servers & failed)
        if dead_server or (workers and not workers & finished) or not servers <= finished:
            rank = (
                dead_server[0]
                if dead_server
                else (sorted(failed)[-1] if failed else min(servers - finished))
            )
            death = next((d for d in reversed(self.deaths) if d["rank"] == rank), None)
            log = self.run_dir / "logs" / f"rank{rank}.log"
            what = "server" if rank in servers else "worker"
            cause = death["cause"] if death else "did not finish"
            if self.lost_both:
                cause += f", and both copies of a slice are gone: {self.lost_both}"
            raise PSFailed(
                f"the parameter server run failed: {what} rank {rank} {cause} (restarts "
                f"used: {self.attempts[rank]} of --max-restarts {self.cfg.launch.max_restarts})."
                f" Last lines of {log}:\n" + "\n".join(tail(log))
            )

    def _raise_internal(self) -> None:
        rank = min(self.internal)
        what = "worker" if self.is_worker(rank) else f"server {rank - self.num_workers}"
        log = self.run_dir / "logs" / f"rank{rank}.log"
        raise InternalFailure(
            f"the parameter server run stopped: {what} (rank {rank}) hit a bug in scaletrain "
            f"and ended the job at once rather than leave the others waiting. Last lines of "
            f"{log}:\n" + "\n".join(tail(log))
        )


def recoveries(fleet: PSFleet) -> list[dict[str, Any]]:
    """Each death, with what the servers saw of it (logs/ps_events.jsonl) and how long until
    the restarted process was serving or training again."""
    events = read_jsonl(fleet.run_dir / "logs" / "ps_events.jsonl")
    records = read_jsonl(fleet.run_dir / "metrics.jsonl")
    # Deaths on other nodes, from the incidents their fleets appended to the shared run dir.
    incidents = read_jsonl(fleet.run_dir / "logs" / "incidents.jsonl")
    kinds = ("ps-worker", "ps-server")
    remote = [i for i in incidents if i["kind"] in kinds and i["rank"] not in fleet.local]
    deaths = [*fleet.deaths, *remote, *fleet.node_losses]
    resumes = ps_job_resumes(fleet.run_dir, records, events, fleet.num_workers)
    return resumes + ps_recoveries(deaths, events, records, fleet.num_workers)


def assemble(cfg: RunConfig, run_dir: Path, num_servers: int) -> tuple[Any, list[dict[str, Any]]]:
    """The task with its model holding the servers' final slices; and the slices' records."""
    import torch

    from scaletrain.task import build_task

    finals = [torch.load(run_dir / "checkpoints" / f"final-server{k}.pt", weights_only=True)
              for k in range(num_servers)]  # fmt: skip
    task = build_task(cfg)
    flat = torch.cat([f["param"] for f in finals])
    torch.nn.utils.vector_to_parameters(flat, list(task.model.parameters()))
    return task, finals


def cut_summary(run_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """asp and ssp with checkpoints: the cuts taken (strategies/param_server/cuts.py), the
    abandoned ones, and how long each held the workers (median, total)."""
    if cfg.ps.consistency == "bsp" or not cfg.fault.checkpoint_interval:
        return None
    events = read_jsonl(run_dir / "logs" / "ps_events.jsonl")
    paused = [e["paused_s"] for e in events if e["event"] == "cut"]
    return {
        "taken": len(paused),
        "abandoned": sum(e["event"] == "cut_abandoned" for e in events),
        "median_pause_s": statistics.median(paused) if paused else None,
        "pause_s": round(sum(paused), 4),
    }


def finish_summary(fleet: PSFleet) -> dict[str, Any]:
    """summary.json from the workers' finals (the loop's, logs/final/) and the servers' final
    slices, assembled into the model and scored here, with the evaluation every mode uses."""
    import torch

    from scaletrain.metrics.evaluation import score
    from scaletrain.metrics.summary import params_sha256
    from scaletrain.strategies.param_server.consistency import (
        shard_ranges,
        split_tensors,
        staleness_histogram,
    )

    cfg, run_dir = fleet.cfg, fleet.run_dir
    task, finals = assemble(cfg, run_dir, fleet.num_servers)
    checkpoint_s = save_final_model(run_dir, task.model)
    workers = read_finals(run_dir)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("committed")]
    test = None
    if task.test_data is not None and task.eval_fn is not None:
        test = [score(task.model, task.test_data, task.eval_fn, torch.device("cpu"))[:2]]
    main = finals[0]
    numels = [f["param"].numel() for f in finals]
    found = recoveries(fleet)
    lost = sum(r.get("lost_acknowledged_updates", 0) for r in found)
    if lost:
        log.warning(
            "%d acknowledged updates were lost by restarted servers (summary.json's "
            "recoveries say which): a slice came back from its checkpoint",
            lost,
        )
    sizes = [p.numel() for p in task.model.parameters()]
    held = split_tensors(sizes, shard_ranges(sum(sizes), fleet.num_servers))
    return write_summary(cfg, run_dir, SummaryParts(
        finals=workers,
        steps=main["version"],
        samples=main["samples_trained"],
        recoveries=found,
        checkpoint_s=checkpoint_s,
        params_hash=params_sha256(task.model),
        test_counts=test or [],
        data_world_size=fleet.num_workers,
        steps_per_epoch=None,
        backend="gloo",
        world_size=fleet.world,
        extras={
            "ps": {
                "consistency": cfg.ps.consistency,
                "staleness_bound": cfg.ps.staleness if cfg.ps.consistency == "ssp" else None,
                "num_servers": fleet.num_servers,
                "num_workers": fleet.num_workers,
                "server_numel": numels,
                # Parameter tensors each server holds all or part of (a large one is split).
                "server_tensors": [len(h) for h in held],
                "server_updates": [f["applied"] for f in finals],
                # Each server process's peak resident memory (its slice, optimizer state,
                # buffers, and the torch it imported).
                "server_peak_rss_bytes": [f.get("peak_rss_bytes") for f in finals],
                "cuts": cut_summary(run_dir, cfg),
                # --ps-replicas: each server's forwards to the backup of its slice (their
                # count and seconds, spent inside the workers' round trips) and the copies
                # it gave a restarted primary (strategies/param_server/replica.py).
                "replicas": cfg.ps.ps_replicas,
                # Updates workers had seen acknowledged that a restarted server lacked.
                "lost_acknowledged_updates": lost,
                "replication": [f.get("replication") for f in finals]
                if cfg.ps.ps_replicas else None,
                "transport": "gloo point-to-point, one two-rank group per worker-server link",
            },
            "staleness_histogram": staleness_histogram(r["staleness"] for r in records),
            "max_staleness": max((r["staleness"] for r in records), default=0),
        },
    ))  # fmt: skip


def run_ps(cfg: RunConfig, run_dir: Path, show_progress: bool) -> dict[str, Any]:
    from scaletrain.launch.errors import WorkerFailed
    from scaletrain.launch.worker_env import set_launch_env
    from scaletrain.metrics.progress import ProgressView

    set_launch_env(cfg, local_only=not cfg.launch.rdzv_endpoint)
    fleet = PSFleet(cfg, run_dir)
    try:
        with ProgressView(run_dir / "metrics.jsonl", enabled=show_progress):
            fleet.run()
    finally:
        fleet.close()
    try:
        fleet.check()
    except PSFailed as e:
        raise WorkerFailed(str(e)) from None
    request = preemption_request(run_dir)
    # Every worker left, every server checkpointed (fleet_stopper); on another node, node 0
    # decided (its launcher was signalled too: the request is in the shared run directory).
    if request is not None and (fleet.preempted or not fleet.is_head):
        raise Preempted(
            f"preempted by {request['signal']}: the workers left after their steps and the "
            f"servers checkpointed their slices in {run_dir / 'checkpoints'}; run the same "
            f"command (--out {run_dir}) to continue the job"
        )
    if not fleet.is_head:
        return {"run_dir": str(run_dir)}  # node 0 writes summary.json
    summary = finish_summary(fleet)
    summary["run_dir"] = str(run_dir)
    return summary
