"""A worker that dies leaving an empty error file, as a worker SIGTERMed by the agent while
torch's own ErrorHandler was writing used to: rank 0 of the first attempt, before training.
Later attempts train the built-in task."""

from __future__ import annotations

import os

from scaletrain import RunConfig, Task
from scaletrain.task import build_builtin_task


def build_task(cfg: RunConfig) -> Task:
    if os.environ["RANK"] == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").close()
        os._exit(1)
    return build_builtin_task(cfg)
