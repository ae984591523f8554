"""The launcher's failures, by whose they are: the input's (ValueError, exit 2), a worker's
(WorkerFailed), the launch's (LaunchFailed), scaletrain's own (InternalFailure); and a
preemption, which is none of those (Preempted)."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A worker process failed; the message says which rank, why, and its last log lines."""


class LaunchFailed(RuntimeError):
    """The agent could not start or keep the job: rendezvous timeout, a signal, ..."""


class InternalFailure(RuntimeError):
    """scaletrain (or torch under it) failed after the input was accepted: never the user's
    mistake, so never exit status 2 (a JSONDecodeError is a ValueError, and once was)."""


class Preempted(RuntimeError):
    """The job was asked to stop (SIGTERM, SIGUSR1) and did, after a checkpoint: exit status
    fault.preempt.PREEMPTED_EXIT_CODE; the same command continues it."""
