"""scaletrain: train your own PyTorch model across many processes and hosts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaletrain.config import RunConfig
from scaletrain.version import __version__

if TYPE_CHECKING:
    from scaletrain.task import Task

__all__ = ["RunConfig", "Task", "__version__", "run"]


def __getattr__(name: str) -> Any:
    # Task imports torch (1.5 s): only when asked for, so that the command line can put its
    # signal handlers in place before that (launch/signals.py).
    if name == "Task":
        from scaletrain.task import Task

        return Task
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")


def run(cfg: RunConfig, *, show_progress: bool = True) -> dict:  # type: ignore[type-arg]
    """Launch this node's workers for ``cfg``, wait, and return summary.json's contents.

    Raises ValueError for bad input and scaletrain.launch.WorkerFailed when a worker fails.
    """
    from scaletrain import launch

    return launch.run(cfg, show_progress=show_progress)
