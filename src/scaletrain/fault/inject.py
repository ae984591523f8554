"""Fault injection, a first-class utility: ``--inject kill:rank=1:step=7``, ``killnode:...``.

Specs are ``KIND:key=value:...``, several separated by commas. Kinds live in a registry, like
strategies. An injector fires in the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so a
restarted worker group does not fail again at the same place. Parsing is pure (no torch), so
config validation can use it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Kill:
    """SIGKILL rank ``rank`` just before it runs global step ``step``: no cleanup, no error
    file, peers blocked in the next collective, as when a machine dies."""

    rank: int
    step: int

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        if attempt == 0 and rank == self.rank and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class KillNode(Kill):
    """SIGKILL the elastic agent of rank ``rank``'s node, then the rank itself, before global
    step ``step``: the whole node is gone (its other workers follow their agent, see
    runtime.die_with_parent), as when a machine loses power."""

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        if attempt == 0 and rank == self.rank and step == self.step:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


INJECTORS: dict[str, Callable[..., Kill]] = {"kill": Kill, "killnode": KillNode}


def parse_inject(spec: str) -> list[Kill]:
    """'kill:rank=1:step=7,kill:rank=0:step=20' -> injectors. ValueError says what is valid."""
    injectors = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in INJECTORS:
            raise ValueError(
                f"inject: unknown fault {kind!r}; known: {', '.join(sorted(INJECTORS))} "
                "(e.g. kill:rank=1:step=7)"
            )
        try:
            options = {k: int(v) for k, v in (pair.split("=", 1) for pair in pairs)}
            injector = INJECTORS[kind](**options)
        except (ValueError, TypeError):
            raise ValueError(
                f"inject: cannot parse {item!r}; expected kill:rank=R:step=S"
            ) from None
        if injector.rank < 0 or injector.step < 1:
            raise ValueError(f"inject: {item!r} needs rank >= 0 and step >= 1")
        injectors.append(injector)
    return injectors
