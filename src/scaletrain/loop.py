"""What the training loop shows the code plugged into it: the few parts of its state that a
``World`` (lifecycle.py) and the checkpoints (checkpointing.py) read, as a Protocol. They
depend on these, not on the ``Trainer`` class, which imports them (trainer.py); so nothing
here loops back to the trainer, and a reader sees at a glance what a world may touch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from scaletrain.config import RunConfig
from scaletrain.fault.inject import Fault
from scaletrain.fault.recovery import Progress
from scaletrain.fault.watchdog import NullWatchdog
from scaletrain.runtime import DistContext
from scaletrain.strategies import Strategy


class Loop(Protocol):
    cfg: RunConfig
    ctx: DistContext
    run_dir: Path
    strategy: Strategy
    progress: Progress
    watchdog: NullWatchdog
    faults: list[Fault]

    def training_state(self, *, sharded: bool = False) -> dict[str, Any]:
        """What a checkpoint holds (checkpointing.py)."""
        ...

    def restore_checkpoint(self, state: dict[str, Any], rank_part: dict[str, Any] | None) -> None:
        """Load what ``training_state`` gave, on resume (lifecycle.py)."""
        ...
