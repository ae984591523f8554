"""scaletrain: train your own PyTorch model across many processes and hosts."""

from __future__ import annotations

__version__ = "0.1.0"

from scaletrain.config import RunConfig  # noqa: E402
from scaletrain.task import Task  # noqa: E402

__all__ = ["RunConfig", "Task", "__version__", "run"]


def run(cfg: RunConfig, *, show_progress: bool = True) -> dict:  # type: ignore[type-arg]
    """Launch this node's workers for ``cfg``, wait, and return summary.json's contents.

    Raises ValueError for bad input and scaletrain.launch.WorkerFailed when a worker fails.
    """
    from scaletrain import launch

    return launch.run(cfg, show_progress=show_progress)
