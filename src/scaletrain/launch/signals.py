"""Preemption signals from the first line of ``scaletrain run`` to its exit.

A cluster that takes a job away warns it with SIGTERM or SIGUSR1 (SLURM's --signal,
Kubernetes' termination grace period) at a moment of its own choosing: while the launcher
still checks the input, while the workers rendezvous, mid-step, during a checkpoint, or after
the job finished and the launcher is cleaning up. Whatever the moment, the command must end
in a way a requeue loop can act on: exit 3 when the same command continues the job, 0 when
the job had finished.

The command line installs ``GUARD`` first (``install``); from then on a signal is never the
default "die with 143". What it does depends on the phase the launcher is in:

- before any process starts (checks, the run directory): it is recorded, and the launcher
  stops at its next phase boundary (``check``) with ``Preempted``; nothing was trained, so
  the same command starts the job again;
- while a mode's launcher runs, that launcher's ``responding`` handler acts (the restart
  mode asks the workers to checkpoint and stop: agent.preemption_signals). A signal that came
  before the handler was put in place is handed to it at once, so none falls between phases;
- after the job finished: it is recorded and changes nothing (the exit status stays 0).

A caller of the Python API installs nothing: ``responding`` then puts its handler in place
for its phase only and restores the caller's afterwards.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from scaletrain.launch.errors import Preempted

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
Responder = Callable[[int, FrameType | None], Any]


class PreemptionGuard:
    def __init__(self) -> None:
        self.received: str = ""  # the first preemption signal's name, "" before any
        self.installed = False
        self._responder: Responder | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum).name
        if self._responder is not None:
            self._responder(signum, frame)

    def install(self) -> None:
        """From now on until the process ends, this guard receives the preemption signals."""
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)
        self.installed = True

    def check(self, what: str) -> None:
        """At a phase boundary before anything trained: stop here if a signal came."""
        if self.received:
            raise Preempted(
                f"preempted by {self.received} {what}; nothing was trained, so running the "
                "same command starts the job"
            )

    @contextlib.contextmanager
    def responding(self, responder: Responder) -> Iterator[None]:
        """``responder`` acts on the preemption signals while the block runs; a signal that
        came earlier is handed to it on entry."""
        saved = {}
        if not self.installed:
            saved = {sig: signal.signal(sig, self._handle) for sig in PREEMPT_SIGNALS}
        previous, self._responder = self._responder, responder
        try:
            if self.received:
                responder(signal.Signals[self.received].value, None)
            yield
        finally:
            self._responder = previous
            for sig, old in saved.items():
                signal.signal(sig, old)
            if not self.installed:  # a Python API caller's next run starts unasked
                self.received = ""


GUARD = PreemptionGuard()
