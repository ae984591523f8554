"""Workers forked from one process that imported torch once, not each started afresh.

A fresh Python spends over a second importing torch (1.3 s of CPU on the 2-core host the
suite runs on), and a launcher starts its workers together: 32 of them importing at once on
2 cores took 37 s before the first could build its model (make scale, W=32), and every
restart of the group paid it again. Python's fork server (multiprocessing's "forkserver"
start method, which torch's elastic agent offers for a function entrypoint; the fleets of
the in-place and parameter-server modes use it through ``ForkedProcess``) is a process the
launcher starts once, with this package and torch imported, that forks a worker on request:
the fork shares the imported modules, copy-on-write, and starts in milliseconds.

What holds a forked worker to what a started one had:
- The server is a clean process: it has imported modules, run no torch operation, opened no
  thread pool, initialized no device and holds none of the launcher's sockets (it is started
  with only its own descriptors), so forking it is safe, CUDA included.
- Its environment is the launcher's when it started; each worker's is the launcher's as it
  is at the worker's start (RunLogsSpecs adds it to the agent's per-rank variables, which the
  agent's wrapper sets in the child; a fleet's child replaces its environment with the one
  the fleet gives it).
- Its command line is the server's: it renames itself to the one a started worker had
  (``python -m scaletrain.worker RUN_DIR``, and its rank), so ``ps`` and the tests that look
  for a run's processes find it.
- Its parent is the server, not the agent: a worker that must reach its agent (the node-loss
  fault) finds it in SCALETRAIN_AGENT_PID; a killed launcher leaves no orphans still, since
  the server ends when the launcher's end closes its pipe, and the workers die with it
  (runtime.die_with_parent).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Final

import setproctitle

# A worker names itself after its run (worker.forked: tests and operators find a run's
# processes by their command line). setproctitle finds the memory of the command line on its
# first call, and cannot once the agent has rewritten the worker's environment: the server
# makes that call here, as it imports this module first.
setproctitle.getproctitle()

START_METHOD: Final = "forkserver"

# Imported by the server once: what a worker imports before its first step.
PRELOAD = [
    "scaletrain.launch.forkserver",
    "scaletrain.worker",
    "scaletrain.trainer",
    "scaletrain.task",
    "scaletrain.strategies",
    "scaletrain.fault.inject",
    "scaletrain.checkpointing",
    "torch._dynamo",  # 0.85 s, on a worker's first optimizer step or DDP wrap otherwise
]


class _SpawnView:
    """``multiprocessing.spawn`` as popen_forkserver calls it, except that the preparation
    data of a scaletrain process does not name the caller's ``__main__``. multiprocessing
    sends every forked child the caller's main script to run again (as ``__mp_main__``), so
    that a target defined there can be unpickled. A worker's target is scaletrain's own, and
    a script that calls ``scaletrain.run`` at module level, without a main guard, would then
    run again in every worker, launching a job of its own; from ``python -`` the child
    failed to open ``<stdin>``. Other processes forked from the server keep the standard
    behaviour."""

    def __getattr__(self, name: str) -> Any:
        from multiprocessing import spawn

        return getattr(spawn, name)

    def get_preparation_data(self, name: str) -> dict[str, Any]:
        from multiprocessing import spawn

        data: dict[str, Any] = spawn.get_preparation_data(name)
        if getattr(_LAUNCHING, "ours", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data


_LAUNCHING = threading.local()


def _runs_scaletrain(process: Any) -> bool:
    """Whether a Process runs a function of scaletrain's: its target (a fleet's), or one
    its arguments wrap (torch's agent passes its wrappers, our entrypoint inside)."""

    def mentions(obj: Any, depth: int) -> bool:
        if getattr(obj, "__module__", None) and callable(obj):
            return str(obj.__module__).startswith("scaletrain.")
        if depth and isinstance(obj, (tuple, list)):
            return any(mentions(item, depth - 1) for item in obj)
        if depth and isinstance(obj, dict):
            return any(mentions(item, depth - 1) for item in obj.values())
        return False

    target = getattr(process, "_target", None)
    return mentions(target, 0) or mentions(getattr(process, "_args", ()), 3)


def _keep_callers_main_out() -> None:
    from multiprocessing import popen_forkserver

    if isinstance(popen_forkserver.spawn, _SpawnView):  # type: ignore[attr-defined]
        return
    launch = popen_forkserver.Popen._launch  # type: ignore[attr-defined]

    def _launch(self: Any, process: Any) -> None:
        _LAUNCHING.ours = _runs_scaletrain(process)
        try:
            launch(self, process)
        finally:
            _LAUNCHING.ours = False

    popen_forkserver.spawn = _SpawnView()  # type: ignore[attr-defined]
    popen_forkserver.Popen._launch = _launch  # type: ignore[attr-defined]


def prepare() -> None:
    """The fork server, when the agent first starts workers (after the rendezvous), will
    import PRELOAD. Not sooner: started with the launcher, its imports competed with the
    launchers' rendezvous on a loaded host, and a node late by more than --rdzv-last-call-s
    grew the world in a second attempt (test_recovery.py's lost node, under xdist)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    # Should anything the server imports ask whether CUDA is available, torch answers from
    # NVML instead of initializing the CUDA driver, which a forked child could not use.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    _start_with_group_signals_blocked()
    _keep_callers_main_out()


def _start_with_group_signals_blocked() -> None:
    """Wrap the fork server's start (multiprocessing starts it on the first fork it is asked
    for, in whichever thread asks): the thread that starts it blocks the preemption signals
    (runtime.GROUP_SIGNALS says why) for the moment of the spawn, so the server inherits
    them blocked; a signal that arrives then stays pending for the launcher, not lost. This
    reaches into multiprocessing's one ForkServer instance (its ``ensure_running``, which
    every fork request calls first)."""
    from multiprocessing import forkserver as mp_forkserver
    from multiprocessing import resource_tracker

    from scaletrain.runtime import GROUP_SIGNALS

    server = mp_forkserver._forkserver  # type: ignore[attr-defined]
    if getattr(server, "scaletrain_guarded", False):
        return
    start = server.ensure_running

    def ensure_running() -> None:
        # The fork server's start first starts multiprocessing's resource tracker, if none
        # runs yet, and that start unblocks SIGTERM (and SIGINT) in the calling thread
        # after spawning it: the fork server then started with SIGTERM unblocked and died
        # of a SIGTERM to the launcher's group, and every worker with it (a preempted
        # parameter-server job ended as a failure). So the tracker first, then the mask.
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
        try:
            start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    server.ensure_running = ensure_running  # type: ignore[method-assign]
    server.scaletrain_guarded = True  # type: ignore[attr-defined]


class ForkedProcess:
    """A fleet's process (launch/fleet.py), forked by the fork server: it answers what the
    fleet asks of a subprocess.Popen (``pid``, ``poll``, ``wait``, ``returncode``: an exit
    code, or minus the signal that killed it)."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        prepare()
        context = multiprocessing.get_context(START_METHOD)
        # Not daemonic: a daemonic process may not start processes of its own (a data
        # loader's workers). The fleet kills every process it started before it returns.
        self._process = context.Process(target=target, args=args, daemon=False)
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode  # reaps it, without waiting
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self.poll()

    def kill(self) -> None:
        """SIGKILL it and the processes of its session. Making that session is the child's
        first act (worker.forked), so it can be killed before it has one: by its pid too.
        (Killing its group alone once left a replica restarted milliseconds earlier alive:
        it trained on alone, from scratch, and wrote checkpoints.)"""
        for send in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError):
                send(self.pid, signal.SIGKILL)
