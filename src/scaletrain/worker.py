# ruff: noqa: E402 (STARTED, below, is taken before the imports that follow it)
"""Entry point of one worker process: ``forked(RUN_DIR)`` in a process the restart mode's agent
forks from its launcher's fork server (launch/forkserver.py), ``forked_in_fleet`` in one the
in-place and parameter-server fleets fork from it, or ``python -m scaletrain.worker RUN_DIR``.

The agent starts one per local rank with RANK, WORLD_SIZE, ... in the environment.
The worker reads the resolved DIR/config.toml, sends its output to DIR/logs/rank<R>.log,
joins the process group, builds the task and trains. ``record`` writes any exception to the
error file the agent reads (atomically: metrics/logs.AtomicErrorHandler), so the launcher can
tell the user which rank failed and why.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the phases of start-up (metrics/phases.py)

import logging
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from scaletrain import env
from scaletrain.config import load_toml
from scaletrain.metrics.logs import AtomicErrorHandler
from scaletrain.runtime import (
    apply_determinism,
    die_with_parent,
    fleet_context,
    init_distributed,
    redirect_output,
    unblock_group_signals,
)

# Objects that hold process groups (DDP's Reducer) stay referenced until os._exit: see exit_now.
_KEEP_ALIVE: list[object] = []


def main(argv: list[str]) -> None:
    run_dir = Path(argv[0])
    rank = int(os.environ["RANK"])
    die_with_parent()
    redirect_output(run_dir / "logs" / f"rank{rank}.log")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("scaletrain.worker")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log.info(
        "worker start: rank %s of %s, attempt %s (this node's restarts: %s), pid %d",
        rank,
        os.environ["WORLD_SIZE"],
        os.environ.get(env.ATTEMPT, restart),
        restart,
        os.getpid(),
    )
    # Imported here, under @record: an import error (a broken install, a user task's module)
    # then reaches the error file and the launcher's report like any other failure.
    from scaletrain.data.plans import RunEnded
    from scaletrain.fault.inject import record_fired_in
    from scaletrain.fault.jobs import current_job_run
    from scaletrain.metrics.phases import mark
    from scaletrain.task import build_task
    from scaletrain.trainer import Trainer

    mark("process", STARTED)
    mark("imported")
    record_fired_in(run_dir / "logs" / "faults")

    # Which job run this is, as node 0 recorded it (another node's launcher may have
    # started before it wrote the line): every node's workers label their records alike.
    job_run, attempt_base = current_job_run(run_dir)
    os.environ[env.JOB_RUN], os.environ[env.ATTEMPT_BASE] = str(job_run), str(attempt_base)
    cfg = load_toml(run_dir / "config.toml")
    apply_determinism(cfg, int(os.environ["LOCAL_WORLD_SIZE"]))
    mode = os.environ.get(env.MODE, "restart")
    if mode == "ps":
        from scaletrain.strategies.param_server.entry import is_server, serve

        if is_server():  # a parameter server: its own update loop, not the trainer's
            serve(cfg, run_dir)
            return
    # The restart mode's processes form one torch.distributed world; the others (torchft
    # replicas, parameter-server workers) are each supervised on their own (lifecycle.py).
    ctx = init_distributed(cfg) if mode == "restart" else fleet_context(cfg, mode)
    mark("group")
    try:
        try:
            trainer = Trainer(cfg, ctx, build_task(cfg), run_dir)
        except RunEnded as e:  # in place: a replica restarted as the others finished
            log.info("%s", e)
            return
        mark("model")
        _KEEP_ALIVE.append(trainer)
        summary = trainer.fit()
        if summary is not None:
            log.info(
                "done: %s", {k: summary[k] for k in ("steps", "samples_per_s", "test_accuracy")}
            )
    finally:
        if ctx.shared_world:
            dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Leave without running destructors. A gloo ProcessGroup still referenced by DDP's
    Reducer is destroyed, GIL held, when the last reference goes; its destructor joins gloo's
    worker threads, which may be waiting for the GIL to free a finished collective's tensors:
    a deadlock we hit about one run in three (pytorch issue #56297). Everything the run wrote
    is flushed and renamed into place by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(run_dir: str) -> None:
    """The body of a worker process, however it was started. A failure ends the process at
    once (exit 1, after @record wrote the error file for the agent and the traceback went to
    the rank log); a success returns."""
    try:
        record(main, error_handler=AtomicErrorHandler())([run_dir])
    except BaseException:
        traceback.print_exc()
        exit_now(1)


def forked(run_dir: str) -> None:
    """Entry point of a worker forked by the launcher's fork server (launch/forkserver.py),
    which imported torch and scaletrain once for all of them. It returns on success: the
    agent collects a return value from every worker before it lets them exit."""
    global STARTED
    STARTED = time.time()
    from setproctitle import setproctitle

    # A session of its own, as torch's agent gives a started worker (and a fleet stops a
    # process with its group): Linux shares the cores between sessions first (autogroup),
    # so workers left in their launcher's session competed as one task group with
    # everything else there; and a terminal's Ctrl-C reaches the launcher alone, which
    # stops the workers.
    if os.getsid(0) != os.getpid():
        os.setsid()
    unblock_group_signals()  # which the fork server holds blocked for its process group

    # Its command line is the fork server's: name it as a started worker's would read, with
    # what /proc/PID/environ no longer tells (that is the server's): its rank, and its role
    # under a parameter server.
    role = os.environ.get(env.PS_ROLE)
    setproctitle(f"{sys.executable} -m scaletrain.worker {run_dir} (rank {os.environ['RANK']})"
                 + (f" ps {role}" if role else ""))  # fmt: skip
    run_worker(run_dir)
    sys.stdout.flush()
    sys.stderr.flush()


def forked_in_fleet(run_dir: str, environ: dict[str, str]) -> None:
    """Entry point of a fleet's process (in place, parameter server) forked by the launcher's
    fork server, with exactly the environment the fleet gives it, as a started one had. It
    never returns."""
    os.environ.clear()
    os.environ.update(environ)
    forked(run_dir)
    exit_now(0)


if __name__ == "__main__":
    run_worker(sys.argv[1])
    exit_now(0)
