"""scaletrain: train your own PyTorch model across many processes and hosts."""

from __future__ import annotations

__version__ = "0.1.0"

from scaletrain.config import RunConfig  # noqa: E402
from scaletrain.task import Task  # noqa: E402

__all__ = ["RunConfig", "Task", "__version__", "launch"]


def launch(cfg: RunConfig) -> dict:  # type: ignore[type-arg]
    """Run ``cfg`` with local/elastic workers and return the summary (see launch.run)."""
    from scaletrain.launch import run

    return run(cfg)
