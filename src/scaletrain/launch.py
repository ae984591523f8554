"""RunConfig -> torch's elastic agent (what torchrun runs), locally or across nodes.

The launcher process *is* the elastic agent of its node: it rendezvouses with the other
nodes' agents (c10d backend), starts ``python -m scaletrain.worker RUN_DIR`` once per local
rank, watches them, restarts the group on failure up to --max-restarts, and stops every
worker (SIGTERM, then SIGKILL after a grace period) when one fails for good. Workers also ask
the kernel to kill them if the agent dies (runtime.die_with_parent), so no orphans remain.

Measured on torch 2.13: with the default shared rendezvous store, restarted workers sometimes
read stale gloo addresses (pytorch #135712); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
workers a store of their own and made restarts reliable there.

While the agent runs, a thread tails DIR/metrics.jsonl to draw rank 0's progress bar in this
terminal (metrics/progress.py): workers' own output goes to DIR/logs/rank<R>.log.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.config import (
    RunConfig,
    dumps_toml,
    from_dict,
    parse_nnodes,
    threads_per_worker,
)
from scaletrain.registry import lookup


class WorkerFailed(RuntimeError):
    """A worker process failed; the message says which rank, why, and its last log lines."""


class LaunchFailed(RuntimeError):
    """The agent could not start or keep the job: rendezvous timeout, a signal, ..."""


class InternalFailure(RuntimeError):
    """scaletrain (or torch under it) failed after the input was accepted: never the user's
    mistake, so never exit status 2 (a JSONDecodeError is a ValueError, and once was)."""


def check_names(cfg: RunConfig) -> None:
    """Registry names, and the flags the run's mode honours (modes.py), are checked here,
    before any process starts."""
    from scaletrain.data.datasets import DATASETS
    from scaletrain.models import MODELS
    from scaletrain.modes import check_flags
    from scaletrain.strategies import strategy_class
    from scaletrain.task import OPTIMIZERS

    check_flags(cfg)

    # Only the chosen strategy's module is imported: all of them cost every run ~1.5 s.
    strategy = strategy_class(cfg.train.strategy)
    if cfg.comm.compression != "none" and not strategy.supports_compression:
        from scaletrain.strategies import STRATEGIES

        with_hooks = ", ".join(sorted(n for n, s in STRATEGIES.items() if s.supports_compression))
        raise ValueError(
            f"compression: strategy {cfg.train.strategy!r} does not use gradient hooks; "
            f"--compression applies to: {with_hooks}"
        )
    lookup(OPTIMIZERS, cfg.optim.optimizer, "optimizer")
    if cfg.launch.join_token_file:
        from scaletrain.strategies.param_server.admission import read_token_file

        read_token_file(cfg.launch.join_token_file)
    if cfg.fault.recovery == "inplace" and importlib.util.find_spec("torchft") is None:
        raise ValueError(
            "recovery: inplace needs torchft, which is not installed: pip install 'scaletrain[ft]'"
        )
    if cfg.data.task:
        target = cfg.data.task.rpartition(":")[0]
        if target.endswith(".py") and not Path(target).is_file():
            raise ValueError(f"task: file {target} does not exist")
    else:
        lookup(MODELS, cfg.model.model, "model")
        if cfg.data.data_dir:
            check_shards(Path(cfg.data.data_dir), verify=cfg.data.verify)
        else:
            lookup(DATASETS, cfg.data.dataset, "dataset")


def check_strategy(cfg: RunConfig) -> None:
    """The strategy's own checks (world-size shape, model split) and --max-memory-per-rank,
    for every world size the run may have (each node count of an elastic MIN:MAX)."""
    from scaletrain.strategies import strategy_class

    strategy = strategy_class(cfg.train.strategy)
    lo, hi = parse_nnodes(cfg.launch.nnodes)
    worlds = sorted({cfg.launch.nproc_per_node * n for n in range(lo, hi + 1)})
    model = None
    checks_model = strategy.checks_model(cfg)
    if checks_model or cfg.train.max_memory_per_rank:
        from scaletrain.task import build_task

        model = build_task(cfg).model
    for world in worlds:
        strategy.check_config(cfg, world, model if checks_model else None)
    if cfg.train.max_memory_per_rank and model is not None:
        from scaletrain.memory_budget import check_memory_budget

        check_memory_budget(cfg, model, worlds[-1])


def check_shards(root: Path, *, verify: bool) -> None:
    """Open every split once here, so a missing, truncated or corrupted shard stops the run
    before anything is written, and the (slow) sha256 check runs once, not once per worker."""
    from scaletrain.data.shards import open_split, read_manifest

    for split in read_manifest(root)["splits"]:
        open_split(root, split, verify=verify)


def prepare_run_dir(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Create the run directory, refuse one that already holds a run, write config.toml.

    A node other than node 0 may join a job that is already training (--nnodes MIN:MAX),
    in the run directory the nodes share: it refuses only a finished run, and keeps the
    job's config.toml (the one every worker reads) when it holds the same configuration."""
    out = Path(cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    joining = cfg.launch.node_rank != 0 and bool(cfg.launch.rdzv_endpoint)
    for name in ("summary.json",) if joining else ("summary.json", "metrics.jsonl"):
        if (out / name).exists():
            raise ValueError(
                f"out: {out} already holds a run ({name} exists); pass another --out or remove it"
            )
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot create run directory {out}: {e.strerror}") from None
    data = cfg.to_dict()
    data["out"] = str(out)
    resolved = from_dict(data)
    config = out / "config.toml"
    if joining and config.exists():
        from scaletrain.config import load_toml

        theirs = load_toml(config)
        if theirs.hash() != resolved.hash():
            raise ValueError(
                f"out: {out} holds a job with another configuration (config hash "
                f"{theirs.hash()}, this node's {resolved.hash()}): every node of a job must "
                "be given the same settings"
            )
        return resolved, out
    from scaletrain.fault.checkpoint import atomic_write_bytes

    # Atomic: a worker of a running job may read it while a node joins.
    atomic_write_bytes(config, dumps_toml(resolved.to_dict()).encode())
    return resolved, out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Node 0 listens for the rendezvous on HOST:PORT; fail early, and clearly, if it cannot."""
    from scaletrain.rendezvous import listen_socket

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
    from scaletrain import rendezvous

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
    )


def set_launch_env(cfg: RunConfig, local_only: bool) -> None:
    from scaletrain.rendezvous import BIND_ENV

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Where the workers' own store listens (runtime.init_distributed); "": MASTER_ADDR.
    os.environ[BIND_ENV] = cfg.launch.bind
    # As torchrun does: without it each worker's OpenMP pool would size itself to every core.
    threads = threads_per_worker(cfg.train.num_threads, cfg.launch.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if local_only and sys.platform.startswith("linux"):
        # Keep a local job on loopback even when the hostname resolves to another interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif not local_only and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo would take the interface of the hostname; the address the user named wins.
        iface = gloo_interface(cfg)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def gloo_interface(cfg: RunConfig) -> str | None:
    """The interface of --bind (or --local-addr), for gloo when GLOO_SOCKET_IFNAME is unset."""
    from scaletrain.rendezvous import interface_of

    addr = cfg.launch.bind if cfg.launch.bind not in ("", "0.0.0.0", "::") else ""
    addr = addr or cfg.launch.local_addr
    return interface_of(addr) if addr and sys.platform.startswith("linux") else None


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
        from scaletrain.rendezvous import ATTEMPT_ENV

        return int(os.environ.get(ATTEMPT_ENV, self.restarts))

    def root_causes(self, reported: int, exit_codes: dict[str, int]) -> list[int]:
        """The agent reports the failure it saw first, often a survivor whose collective
        failed ("Connection closed by peer") a moment before the agent noticed the dead rank.
        When it logs, the group is already stopped: the ranks whose error file is missing (a
        signal) or names a cause rather than a symptom are the candidates; of those, a rank
        that ended by the SIGTERM the agent sends when it stops the group is not, when
        another ended otherwise (``exit_codes``: by error file, as take_exit_codes gives
        them). Empty when every rank of this node failed as a symptom (the cause is on
        another node)."""
        from scaletrain.metrics.logs import COLLATERAL

        candidates, stopped = [], []
        for rank in sorted(self.logs.ranks.values()):
            path = self.run_dir / "logs" / "errors" / f"rank{rank}.json"
            text = path.read_text(errors="replace") if path.exists() else ""
            if not any(pattern in text for pattern in COLLATERAL):
                candidates.append(rank)
                if exit_codes.get(str(path)) == -signal.SIGTERM:
                    stopped.append(rank)
        if stopped and len(stopped) < len(candidates):
            candidates = [rank for rank in candidates if rank not in stopped]
        return sorted(candidates, key=lambda r: r != reported)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 3:
            return
        exitcode, local_rank, pid = args[:3]
        from scaletrain.fault.watchdog import append_incident
        from scaletrain.metrics.logs import take_exit_codes

        reported = self.logs.ranks.get(int(str(local_rank)), -1)
        causes = self.root_causes(reported, take_exit_codes())
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
        from scaletrain.fault.watchdog import append_incident
        from scaletrain.rendezvous import ATTEMPT_ENV

        args = record.args if isinstance(record.args, tuple) else ()
        append_incident(
            self.run_dir,
            {"kind": "node-joined", "attempt": int(os.environ.get(ATTEMPT_ENV, "-1")),
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


def run_inplace_mode(cfg: RunConfig, run_dir: Path, show_progress: bool) -> dict[str, Any]:
    """--recovery inplace: our own supervisor instead of the elastic agent (fault/supervisor)."""
    from scaletrain.fault.supervisor import InplaceFailed, run_inplace
    from scaletrain.metrics.progress import ProgressView

    set_launch_env(cfg, local_only=not cfg.launch.rdzv_endpoint)
    try:
        with ProgressView(run_dir / "metrics.jsonl", enabled=show_progress):
            summary = run_inplace(cfg, run_dir)
    except InplaceFailed as e:
        raise WorkerFailed(str(e)) from None
    summary["run_dir"] = str(run_dir)
    return summary


def describe_plan(cfg: RunConfig) -> str:
    """What ``run`` would start on this node, after every check ``run`` makes before starting
    anything (``scaletrain run --dry-run``): for checking a cluster script before a job."""
    check_names(cfg)
    check_strategy(cfg)
    lo, hi = parse_nnodes(cfg.launch.nnodes)
    nproc = cfg.launch.nproc_per_node
    nodes = str(lo) if lo == hi else f"{lo} to {hi} (elastic)"
    first = cfg.launch.node_rank * nproc
    endpoint = cfg.launch.rdzv_endpoint or "127.0.0.1:<a free port> (local)"
    host = "this node hosts it" if cfg.launch.node_rank == 0 else "node 0 hosts it"
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or (
        "lo"
        if not cfg.launch.rdzv_endpoint
        else gloo_interface(cfg) or "the interface of this host's name"
    )
    listen = cfg.launch.bind or (
        "127.0.0.1"
        if not cfg.launch.rdzv_endpoint
        else (
            f"{cfg.launch.rdzv_endpoint.rpartition(':')[0]} (node 0's rendezvous address)"
            if cfg.launch.node_rank == 0
            else f"{cfg.launch.local_addr or 'this host'}'s address"
        )
    )
    out = cfg.out or "runs/<timestamp>"
    lines = [
        "dry run: every check passed; nothing was started or written",
        f"  nodes: {nodes}; this is node {cfg.launch.node_rank}, {nproc} processes per node; "
        f"world size {nproc * lo}" + (f" to {nproc * hi}" if hi != lo else ""),
        f"  this node's ranks: {first} to {first + nproc - 1} (first attempt)",
        f"  rendezvous: c10d at {endpoint}, id {cfg.launch.rdzv_id or '<generated>'}; {host}",
        f"  strategy: {cfg.train.strategy}; device: {cfg.train.device}; gloo interface: {iface}"
        + (
            f"; NCCL interface: {os.environ['NCCL_SOCKET_IFNAME']}"
            if os.environ.get("NCCL_SOCKET_IFNAME")
            else ""
        ),  # fmt: skip
        f"  listens on: {listen}",
        f"  restarts: up to {cfg.launch.max_restarts}; run directory: {out}",
        "resolved configuration:",
        dumps_toml(cfg.to_dict()),
    ]
    return "\n".join(lines)


def run(cfg: RunConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Launch this node's workers for ``cfg`` and wait for them.

    Returns summary.json's contents (empty when rank 0 ran on another node). Raises ValueError
    for bad input (before any worker starts) and WorkerFailed when a worker fails for good.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from scaletrain.metrics.logs import describe_failure
    from scaletrain.metrics.progress import ProgressView

    check_names(cfg)
    check_strategy(cfg)
    cfg, run_dir = prepare_run_dir(cfg)
    if cfg.fault.recovery == "inplace":
        return run_inplace_mode(cfg, run_dir, show_progress)
    from scaletrain.strategies import strategy_class

    own = strategy_class(cfg.train.strategy).launcher  # a strategy with processes of its own
    if own:
        module, _, function = own.partition(":")
        return getattr(importlib.import_module(module), function)(  # type: ignore[no-any-return]
            cfg, run_dir, show_progress
        )
    launch_config = build_launch_config(cfg, run_dir)
    set_launch_env(cfg, local_only=not cfg.launch.rdzv_endpoint)
    progress = ProgressView(run_dir / "metrics.jsonl", enabled=show_progress)
    from scaletrain.rendezvous import release

    try:
        with progress, record_worker_deaths(run_dir, launch_config.logs_specs):
            try:
                elastic_launch(launch_config, sys.executable)(
                    "-m", "scaletrain.worker", str(run_dir)
                )
            finally:
                release()
    except ChildFailedError as e:
        raise WorkerFailed(describe_failure(e.failures, run_dir)) from None
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
    summary["run_dir"] = str(run_dir)
    return summary
