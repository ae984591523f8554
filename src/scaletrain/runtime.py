"""Per-worker process setup: who am I, which device, process group, seeds, logs.

Everything here runs once at worker start, before the task is built. The elastic agent gives
each worker RANK, WORLD_SIZE, LOCAL_RANK, ... in its environment (see torch.distributed.elastic).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import random
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain import env
from scaletrain.config import RunConfig, threads_per_worker


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int  # this node's restarts (the agent's count)
    attempt: int  # the world's: the same on every rank, one more for every new world
    device: torch.device
    backend: str
    # restart: one torch.distributed world, restarted as a whole by torch's elastic agent;
    # inplace, ps: processes the launcher restarts one by one, with no world group.
    mode: str = "restart"
    job_run: int = 0  # which run of the job (launch/jobs.py)
    attempt_base: int = 0  # this job run's first attempt

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def shared_world(self) -> bool:
        """Whether the job's processes are one torch.distributed world (the restart mode)."""
        return self.mode == "restart"


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its agent dies: a killed launcher leaves no orphans."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def redirect_output(log_path: Path) -> None:
    """Send this process's stdout and stderr (Python and C++ alike) to its rank log, appending,
    so a restarted worker adds to the same file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def pick_device(cfg: RunConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_determinism(cfg: RunConfig, local_world_size: int) -> None:
    seed = cfg.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Thread count changes float summation order, so it is fixed whenever results must repeat.
    torch.set_num_threads(threads_per_worker(cfg.train.num_threads, local_world_size))
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


# The preemption signals (launch/signals.py), which may reach every process of the launcher's
# process group at once: SLURM signals every process of a job step, and `timeout` or
# `kill -TERM -PGID` signal a group. The launcher answers them (checkpoint, then exit 3); the
# fork server, a helper in the launcher's group, must not die of them, or every worker it
# forked dies with it (a preempted job then ended as a failure, exit 1, with no checkpoint of
# its last step). The server starts with them blocked (the mask survives fork and exec:
# launch/forkserver.py), and every process it forks unblocks them as its first act, once in
# a session of its own (unblock_group_signals). SIGINT, a terminal's Ctrl-C to the group,
# the server ignores of its own.
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def unblock_group_signals() -> None:
    """In a process forked by the launcher's fork server (a worker, a probe), once in a
    session of its own: the preemption signals as a started process has them. One that
    reached the launcher's group while this process was still in it (it was forked there)
    is discarded: it was the launcher's to answer."""
    while signal.sigtimedwait(GROUP_SIGNALS, 0) is not None:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


_STORE_LISTENERS: list[socket.socket] = []


def worker_store(timeout_s: float) -> dist.Store:
    """The worker group's TCPStore, as ``init_process_group``'s env:// would make it, except
    that rank 0 listens on one address: $SCALETRAIN_BIND (--bind), else MASTER_ADDR, the
    address the other ranks connect to (env:// would listen on every interface)."""
    from scaletrain import env
    from scaletrain.net import bound_store

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if rank == 0 and not agent_hosts:
        # The agent holds the port for it (net.reserved_port).
        store, listener = bound_store(os.environ.get(env.BIND) or addr, port, timeout_s,
                                      reuse_port=True)  # fmt: skip
        _STORE_LISTENERS.append(listener)
        return store
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)


def fleet_context(cfg: RunConfig, mode: str) -> DistContext:
    """A process the launcher supervises on its own (launch/fleet.py): its rank and attempt
    from the environment the fleet gives it, no process group."""
    local_rank = env.get_int(env.LOCAL_RANK)
    device = pick_device(cfg, local_rank)
    attempt = env.get_int(env.RESTART_COUNT)  # the fleet counts each rank's own attempts
    return DistContext(
        rank=env.get_int(env.RANK),
        world_size=env.get_int(env.WORLD_SIZE),
        local_rank=local_rank,
        local_world_size=env.get_int(env.LOCAL_WORLD_SIZE, 1),
        restart_count=attempt,
        attempt=attempt,
        device=device,
        backend="nccl" if device.type == "cuda" else "gloo",
        mode=mode,
        job_run=env.get_int(env.JOB_RUN),  # its records say which run of the job
    )


def init_distributed(cfg: RunConfig) -> DistContext:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=worker_store(cfg.launch.timeout_s),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=cfg.launch.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    from scaletrain import env

    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        restart_count=restart_count,
        attempt=env.get_int(env.ATTEMPT_BASE) + int(os.environ.get(env.ATTEMPT, restart_count)),
        device=device,
        backend=backend,
        job_run=env.get_int(env.JOB_RUN),
        attempt_base=env.get_int(env.ATTEMPT_BASE),
    )
