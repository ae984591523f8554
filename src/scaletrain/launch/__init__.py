"""The launcher: RunConfig -> the processes of this node, in the run's mode.

- restart (agent.py): torch's elastic agent; the group restarts from the newest checkpoint
  when a worker dies or hangs.
- inplace (inplace.py): torchft; survivors go on, a restarted replica heals from a live peer.
- ps (ps.py): parameter servers and workers, each restarted on its own.

Every mode runs the same checks first (checks.py, modes.py: bad input is refused before any
process starts, exit status 2), prepares the run directory, and starts one
``python -m scaletrain.worker RUN_DIR`` per rank, which runs the one training loop
(trainer.py) or, for a parameter server, its update loop. fleet.py holds the processes of the
modes that restart them one by one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig, dumps_toml, parse_nnodes
from scaletrain.launch.agent import free_port
from scaletrain.launch.checks import check_names, check_strategy, prepare_run_dir
from scaletrain.launch.errors import InternalFailure, LaunchFailed, Preempted, WorkerFailed
from scaletrain.launch.worker_env import gloo_interface

__all__ = [
    "InternalFailure",
    "LaunchFailed",
    "Preempted",
    "WorkerFailed",
    "check_names",
    "check_strategy",
    "describe_plan",
    "free_port",
    "run",
]


def coordination(cfg: RunConfig, endpoint: str) -> str:
    """What the processes of ``cfg``'s mode meet through, at ``endpoint``."""
    from scaletrain.launch.modes import mode_of

    mode = mode_of(cfg)
    if mode == "inplace":
        return f"coordination: torchft's lighthouse at {endpoint} (the quorums; no rendezvous)"
    if mode == "ps":
        return f"coordination: the parameter server's store at {endpoint} (links, membership)"
    return f"rendezvous: c10d at {endpoint}, id {cfg.launch.rdzv_id or '<generated>'}"


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
        f"  {coordination(cfg, endpoint)}; {host}",
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


def runner(mode: str) -> Callable[[RunConfig, Path, bool], dict[str, Any]]:
    """The launcher of ``mode``: run(cfg, run_dir, show_progress) -> summary.json's contents."""
    if mode == "inplace":
        from scaletrain.launch.inplace import run_inplace_mode

        return run_inplace_mode
    if mode == "ps":
        from scaletrain.launch.ps import run_ps

        return run_ps
    from scaletrain.launch.agent import run_restart

    return run_restart


def fleet_stopper(cfg: RunConfig, run_dir: Path) -> Callable[[int, Any], None]:
    """What a preemption signal does under --recovery inplace or --strategy ps. In place with
    checkpoints, what it does in the restart mode: a request in the run directory, after
    which every replica leaves at its next step, the last step's writer checkpointing it
    (lifecycle.FleetWorld.preempted), and the launcher exits 3 (launch/inplace.py). Under a
    parameter server the same request: every worker leaves after its step, then each server
    checkpoints its slice (and server 0 the data plan) with nothing in flight, and the
    launcher exits 3 (launch/ps.py). In place without checkpoints a job cannot be continued
    once it trained (launch/jobs.py), so the launcher stops its processes now (the fleet's
    clean-up) and says so; before the first step the same command starts the job again,
    which is a preemption like any other."""
    from scaletrain.launch.modes import mode_of

    def stop(signum: int, frame: Any) -> None:
        import signal

        from scaletrain.fault.preempt import request_preemption

        name = signal.Signals(signum).name
        if not (run_dir / "metrics.jsonl").exists():
            raise Preempted(
                f"preempted by {name} before the first step; nothing was trained, so running "
                "the same command starts the job"
            )
        if mode_of(cfg) == "ps" or cfg.fault.checkpoints_on:
            request_preemption(run_dir, name)
            return
        raise LaunchFailed(
            f"stopped by {name}: the workers were stopped. This job cannot be continued after "
            "a preemption (pass --checkpoint-every N to make it continuable)"
        )

    return stop


def run(cfg: RunConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Launch this node's workers for ``cfg`` and wait for them.

    Returns summary.json's contents (empty when rank 0 ran on another node). Raises ValueError
    for bad input (before any worker starts) and WorkerFailed when a worker fails for good.
    """
    from scaletrain.launch.jobs import JobComplete, end_job_run
    from scaletrain.launch.modes import mode_of
    from scaletrain.launch.signals import GUARD

    check_names(cfg)
    check_strategy(cfg)
    GUARD.check("before the job started")
    try:
        cfg, run_dir = prepare_run_dir(cfg)
    except JobComplete as done:
        return done.summary
    head = cfg.launch.node_rank == 0  # node 0 keeps the job's record of its runs
    mode = mode_of(cfg)
    try:
        GUARD.check("before any worker started")
        if mode == "restart":  # its agent responds to preemption signals (agent.py)
            summary = runner(mode)(cfg, run_dir, show_progress)
        else:
            with GUARD.responding(fleet_stopper(cfg, run_dir)):
                summary = runner(mode)(cfg, run_dir, show_progress)
    except Preempted:
        if head:
            end_job_run(run_dir, "preempted")
        raise
    except BaseException:
        if head:
            end_job_run(run_dir, "failed")
        raise
    if head:
        end_job_run(run_dir, "finished")
    summary["run_dir"] = str(run_dir)
    return summary
