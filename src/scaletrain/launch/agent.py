"""The restart mode: torch's elastic agent (what torchrun runs), locally or across nodes.

The launcher process *is* the elastic agent of its node: it rendezvouses with the other
nodes' agents (c10d backend, rendezvous.py), forks one worker per local rank from its fork
server (launch/forkserver.py: torch imported once, not once a worker), watches them,
restarts the group on failure up to --max-restarts, and stops every worker (SIGTERM, then
SIGKILL after a grace period) when one fails for good. Workers also ask the kernel to kill
them if the agent dies (runtime.die_with_parent), so no orphans remain.

Measured on torch 2.13: with the default shared rendezvous store, restarted workers sometimes
read stale gloo addresses (pytorch #135712); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
workers a store of their own and made restarts reliable there.

While the agent runs, a thread tails DIR/metrics.jsonl to draw rank 0's progress bar in this
terminal (metrics/progress.py): workers' own output goes to DIR/logs/rank<R>.log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from scaletrain import env
from scaletrain.config import RunConfig, parse_nnodes
from scaletrain.fault.preempt import preemption_request
from scaletrain.io import read_jsonl
from scaletrain.launch.errors import InternalFailure, LaunchFailed, Preempted, WorkerFailed
from scaletrain.launch.worker_env import set_launch_env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Node 0 listens for the rendezvous on HOST:PORT; fail early, and clearly, if it cannot."""
    from scaletrain.net import listen_socket

    try:
        listen_socket(host, port).close()
    except ValueError as e:
        if "in use" in str(e):
            raise ValueError(
                f"rdzv_endpoint: port {port} is already in use on this machine (another "
                "scaletrain or torchrun job?); pick a free port with --rdzv-endpoint HOST:PORT "
                "or stop the other job"
            ) from None
        raise


def build_launch_config(cfg: RunConfig, run_dir: Path) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from scaletrain.launch import forkserver
    from scaletrain.metrics.logs import RunLogsSpecs, tolerate_unreadable_error_files

    tolerate_unreadable_error_files()
    min_nodes, max_nodes = parse_nnodes(cfg.launch.nnodes)
    is_host = cfg.launch.node_rank == 0
    endpoint = cfg.launch.rdzv_endpoint
    local_only = not endpoint
    if local_only:
        endpoint = f"127.0.0.1:{free_port()}"
    elif is_host:
        host, _, port = endpoint.rpartition(":")
        check_port_free(cfg.launch.bind or host.strip("[]"), int(port))
    timeout = int(cfg.launch.timeout_s)
    from scaletrain.launch import rendezvous

    rendezvous.register()
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=cfg.launch.nproc_per_node,
        run_id=cfg.launch.rdzv_id or f"scaletrain-{uuid.uuid4().hex[:12]}",
        rdzv_backend=rendezvous.BACKEND_NAME,  # torch's c10d, bound and timed (rendezvous.py)
        rdzv_endpoint=endpoint,
        rdzv_configs={
            "is_host": is_host,
            "timeout": timeout,
            "join_timeout": timeout,
            # Every call to node 0's store waits this long (torch's default: 60 s): a node
            # whose cable is cut gives up on the job after it, instead of a minute per call.
            "read_timeout": timeout,
            "bind": cfg.launch.bind or ("127.0.0.1" if local_only else ""),
            # torch's default is 30 s: every re-rendezvous after a lost node waits that long
            # for nodes that may still come, when fewer than MAX are left.
            "last_call_timeout": cfg.launch.rdzv_last_call_s,
            "keep_alive_interval": cfg.launch.rdzv_keep_alive_s,
        },
        max_restarts=cfg.launch.max_restarts,
        logs_specs=RunLogsSpecs(run_dir),
        local_addr="127.0.0.1" if local_only else (cfg.launch.local_addr or None),
        shutdown_timeout=5,
        signals_to_handle=TORCH_SIGNALS,  # SIGTERM and SIGUSR1 preempt (preemption_signals)
        start_method=forkserver.START_METHOD,  # workers forked from one import of torch
    )


class _DeathRecorder(logging.Handler):
    """Turns the agent's "failed (exitcode ...) local_rank ..." log record, emitted once per
    failed attempt when the agent notices the failure, into a line of DIR/logs/incidents.jsonl,
    which the next attempt reads for summary.json's recoveries (fault/recovery.py).
    ``logs`` knows this node's global ranks in the current attempt (they change when the
    membership does)."""

    def __init__(self, run_dir: Path, logs: Any) -> None:
        super().__init__(level=logging.ERROR)
        self.run_dir, self.logs = run_dir, logs
        self.restarts = 0  # this node's failures so far: the attempt where no round is known

    @property
    def attempt(self) -> int:
        """The attempt that failed: the rendezvous round its world formed in (it is still
        set: the agent logs the failure before it re-rendezvouses)."""

        from scaletrain.fault.jobs import current_job_run

        base = current_job_run(self.run_dir)[1]
        return base + int(os.environ.get(env.ATTEMPT, self.restarts))

    def root_causes(
        self, reported: int, exit_codes: dict[str, int], stopped: Collection[int] = ()
    ) -> list[int]:
        """The agent reports the failure it saw first, often a survivor whose collective
        failed ("Connection closed by peer") a moment before the agent noticed the dead rank.
        The ranks whose error file is missing (a signal, or still running) or names a cause
        rather than a symptom are the candidates. Of those, two kinds are not, when another
        candidate is left: a rank that ended by the SIGTERM the agent sends when it stops the
        group (``exit_codes``: by error file, as take_exit_codes gives them), and a rank that
        torch stopped or had not yet stopped when the agent logged (``stopped``, global ranks:
        see stopped_ranks). Empty when every rank of this node failed as a symptom (the
        cause is on another node)."""
        from scaletrain.metrics.logs import COLLATERAL

        candidates, bystanders = [], []
        for rank in sorted(self.logs.ranks.values()):
            path = self.run_dir / "logs" / "errors" / f"rank{rank}.json"
            text = path.read_text(errors="replace") if path.exists() else ""
            if not any(pattern in text for pattern in COLLATERAL):
                candidates.append(rank)
                if exit_codes.get(str(path)) == -signal.SIGTERM or rank in stopped:
                    bystanders.append(rank)
        if bystanders and len(bystanders) < len(candidates):
            candidates = [rank for rank in candidates if rank not in bystanders]
        return sorted(candidates, key=lambda r: r != reported)

    def stopped_ranks(self, record: logging.LogRecord) -> set[int]:
        """The global ranks that torch stopped, not ones that died, when the agent logged
        ``record``: still running, or ended by SIGTERM. Forked workers (torch's
        MultiprocessContext) are reported as the one failure the agent met first; torch has
        already SIGTERMed the others (its ProcessContext.join), and a rank that was blocked
        in a collective with the dead one has no error file, like a SIGKILLed one. The
        context is the ``self`` of the frame that caught the failure; none found (another
        torch), none known."""
        traceback = record.exc_info[2] if record.exc_info else None
        context = traceback.tb_frame.f_locals.get("self") if traceback else None
        processes = getattr(getattr(context, "_pc", None), "processes", None) or []
        return {
            self.logs.ranks[local_rank]
            for local_rank, process in enumerate(processes)
            if local_rank in self.logs.ranks and process.exitcode in (None, -signal.SIGTERM)
        }

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 3:
            return
        exitcode, local_rank, pid = args[:3]
        from scaletrain.fault.watchdog import append_incident
        from scaletrain.metrics.logs import take_exit_codes

        reported = self.logs.ranks.get(int(str(local_rank)), -1)
        causes = self.root_causes(reported, take_exit_codes(), self.stopped_ranks(record))
        append_incident(
            self.run_dir,
            {"kind": "death", "attempt": self.attempt, "ranks": causes or [reported],
             "collateral": not causes, "node_ranks": sorted(self.logs.ranks.values()),
             "reported_rank": reported, "exitcode": exitcode, "pid": pid,
             "detected_at": record.created},
        )  # fmt: skip
        self.restarts += 1


class _GrowthRecorder(logging.Handler):
    """Turns the agent's "Detected N new nodes ... will restart worker group" record (a node
    joined: the agent stops a healthy world to form a larger one) into a line of
    DIR/logs/incidents.jsonl, so the restart's recoveries entry says why it happened."""

    def __init__(self, run_dir: Path, logs: Any) -> None:
        super().__init__(level=logging.INFO)
        self.run_dir, self.logs = run_dir, logs

    def emit(self, record: logging.LogRecord) -> None:
        if "new nodes from group_rank" not in str(record.msg):
            return
        from scaletrain.fault.jobs import current_job_run
        from scaletrain.fault.watchdog import append_incident

        args = record.args if isinstance(record.args, tuple) else ()
        base = current_job_run(self.run_dir)[1]
        attempt = base + int(os.environ[env.ATTEMPT]) if env.ATTEMPT in os.environ else -1
        append_incident(
            self.run_dir,
            {"kind": "node-joined", "attempt": attempt,
             "ranks": [], "waiting": args[1] if len(args) > 1 else None,
             "node_ranks": sorted(self.logs.ranks.values()), "detected_at": record.created},
        )  # fmt: skip


@contextlib.contextmanager
def record_worker_deaths(run_dir: Path, logs: Any) -> Iterator[None]:
    """Worker deaths and worlds stopped to grow, from the agent's log records, become
    incidents (the launcher prints its own account of failures: the records go no further)."""
    watched = [
        (logging.getLogger("torch.distributed.elastic.multiprocessing.api"),
         _DeathRecorder(run_dir, logs), logging.ERROR),
        (logging.getLogger("torch.distributed.elastic.agent.server.api"),
         _GrowthRecorder(run_dir, logs), logging.INFO),
    ]  # fmt: skip
    saved = [(logger.level, logger.propagate) for logger, _, _ in watched]
    for logger, handler, level in watched:
        logger.setLevel(level)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for (logger, handler, _), (level, propagate) in zip(watched, saved, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


# torch's agent turns these into a shutdown of the workers; SIGTERM and SIGUSR1 are ours.
TORCH_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def preemption_signals(run_dir: Path) -> Iterator[None]:
    """SIGTERM or SIGUSR1 to the launcher asks the workers to checkpoint and stop (writes the
    request they look for: fault/preempt.py); a second one stops them now, as torch's agent
    does for the other signals (SIGTERM, then SIGKILL after its grace period). A signal that
    came before the agent started is handed over here (launch/signals.py)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    from scaletrain.fault.preempt import preempt_path, request_preemption
    from scaletrain.launch.signals import GUARD

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if preempt_path(run_dir).exists():
            _terminate_process_handler(signum, frame)  # raises SignalException
        request_preemption(run_dir, name)
        print(f"scaletrain: {name}: the workers checkpoint and stop after their current step "
              "(send it again to stop them now)", file=sys.stderr, flush=True)  # fmt: skip

    with GUARD.responding(handler):
        yield


def ended_elsewhere(run_dir: Path, endpoint: str) -> RuntimeError:
    """This node's agent restarted its workers and found the rendezvous closed: another
    node's agent ended the job (its restarts ran out, or it was stopped). The agents' counts
    of restarts left can differ: torch does not count a restart that a node makes because
    another node waits to rejoin, so after a death, a node that saw its peer waiting before
    its own workers failed keeps a restart its peer has spent, and its next restart meets a
    closed rendezvous. The reason to report is the failure this node restarted after."""
    from scaletrain.metrics.logs import attempt_failures, describe_failure

    failures = attempt_failures()
    if not failures:  # e.g. a node that joins after the job ended
        return LaunchFailed(
            f"the rendezvous at {endpoint} is closed: the job has ended (another node's agent "
            "finished it, ran out of restarts or was stopped: its output says which)"
        )
    return WorkerFailed(
        "the job was ended by another node's agent (out of restarts, or stopped: its output "
        "says which) while this node was restarting its workers after this failure: "
        + describe_failure(failures, run_dir)
    )


def run_restart(cfg: RunConfig, run_dir: Path, show_progress: bool) -> dict[str, Any]:
    """This node's agent for the whole run; summary.json's contents (empty when rank 0 ran on
    another node)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from scaletrain.launch import forkserver
    from scaletrain.metrics.logs import describe_failure, with_error_files
    from scaletrain.metrics.progress import ProgressView
    from scaletrain.worker import forked

    launch_config = build_launch_config(cfg, run_dir)
    set_launch_env(cfg, local_only=not cfg.launch.rdzv_endpoint)
    forkserver.prepare()
    progress = ProgressView(run_dir / "metrics.jsonl", enabled=show_progress)
    from scaletrain.launch.rendezvous import release

    try:
        with (
            progress,
            record_worker_deaths(run_dir, launch_config.logs_specs),
            preemption_signals(run_dir),
        ):
            try:
                elastic_launch(launch_config, forked)(str(run_dir))
            finally:
                release()
    except ChildFailedError as e:
        failures = with_error_files(e.failures, launch_config.logs_specs)
        raise WorkerFailed(describe_failure(failures, run_dir)) from None
    except RendezvousClosedError:
        raise ended_elsewhere(run_dir, launch_config.rdzv_endpoint) from None
    except RendezvousError as e:
        raise LaunchFailed(
            f"rendezvous at {launch_config.rdzv_endpoint} failed: {e}. Check that every node "
            "uses the same --rdzv-endpoint and --rdzv-id and that node 0 is up."
        ) from None
    except SignalException as e:
        raise LaunchFailed(f"stopped by {e.sigval.name}; the workers were stopped") from None
    except Exception as e:
        raise InternalFailure(
            f"the elastic agent failed: {type(e).__name__}: {e}. The workers were stopped; "
            f"the run directory {run_dir} keeps its checkpoints. This is a bug in scaletrain "
            "or torch, not in your input: please report it with DIR/logs."
        ) from e
    summary_path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    request = preemption_request(run_dir)
    if request is not None and not summary:
        records = read_jsonl(run_dir / "metrics.jsonl")
        step = max((r["step"] for r in records), default=0)
        raise Preempted(
            f"preempted by {request['signal']}: every worker finished step {step} and its "
            f"checkpoint is in {run_dir / 'checkpoints'}; run the same command (--out "
            f"{run_dir}) to continue the job"
        )
    summary["run_dir"] = str(run_dir)
    return summary
