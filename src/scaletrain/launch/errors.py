"""The launcher's failures, by whose they are: the input's (ValueError, exit 2), a worker's
(WorkerFailed), the launch's (LaunchFailed) or scaletrain's own (InternalFailure)."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A worker process failed; the message says which rank, why, and its last log lines."""


class LaunchFailed(RuntimeError):
    """The agent could not start or keep the job: rendezvous timeout, a signal, ..."""


class InternalFailure(RuntimeError):
    """scaletrain (or torch under it) failed after the input was accepted: never the user's
    mistake, so never exit status 2 (a JSONDecodeError is a ValueError, and once was)."""
