"""Fault injection, a first-class utility: ``--inject kill:rank=1:step=7``, and so on.

Specs are ``KIND:key=value:...``, several separated by commas. Kinds live in a registry, like
strategies:

- ``kill:rank=R:step=S``: SIGKILL rank R just before global step S, as when a machine dies.
- ``kill-before-reply:rank=R:step=S``: under --strategy ps with --ps-replicas 1, SIGKILL
  server rank R once its backup acknowledged its S-th update (or the first forwarded one
  after it) and before the reply that tells a worker of it: the push must be sent again and
  applied once. It fires nowhere else.
- ``break-backup-link:rank=R:step=S``: likewise, server rank R's link to the backup of its
  slice breaks after its S-th update is forwarded, both processes alive.
- ``kill-during-copy:rank=R:step=S``: likewise, SIGKILL server rank R as it begins to copy
  its slice (at version S or later) to its restarted backup.
- ``killnode:rank=R:step=S``: SIGKILL rank R's elastic agent, then the rank (a node is gone).
- ``hang:rank=R:step=S``: rank R stops before step S, alive and silent, never reaching the
  step's collective (a deadlock, a stuck file system); the watchdog must notice.
- ``slow:rank=R:factor=F``: every step of rank R takes F times its measured compute time
  (slower hardware); in every attempt, since a slow machine stays slow.
- ``corrupt-checkpoint:step=S``: damage the checkpoint of step S on disk right after it is
  written (bit rot, a torn write); resuming must detect it and use an older one. With
  ``:rank=R``, damage rank R's own state file of that checkpoint instead (its RNG states):
  every rank must then skip that checkpoint together.

Under --strategy ps a worker's step S is its own S-th step, and a server rank's step S is
its S-th update (so ``kill`` can take a server down too).
The process faults (kill, killnode, hang) fire once per job: the first time their rank
reaches their step. Every worker process names its run's directory (``record_fired_in``), and
a marker file there says a fault fired, so a restarted worker group goes past that place,
and a later fault of the spec still fires in a later attempt (three kills at steps 6, 14 and
22 are three failures, whatever the restarts between them). Without a directory they fire in
a process's first attempt only (TORCHELASTIC_RESTART_COUNT 0), as corrupt-checkpoint always
does. Parsing is pure (no torch), so config validation can use it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FIRED_IN: list[Path] = []  # the run's directory of markers, once a worker names it


def record_fired_in(directory: Path) -> None:
    """This process's one-shot faults fire once per job, recorded under ``directory``."""
    _FIRED_IN[:] = [directory]


def first_time(kind: str, rank: int, step: int, attempt: int) -> bool:
    """Whether a one-shot fault of ``kind`` at (``rank``, ``step``) fires now, and if so,
    record that it did (before it does: a kill leaves no time after)."""
    if not _FIRED_IN:
        return attempt == 0
    marker = _FIRED_IN[0] / f"{kind}-rank{rank}-step{step}"
    if marker.exists():
        return False
    from scaletrain.io import atomic_write_bytes

    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(marker, f"{time.time()}\n".encode())
    return True


class Fault:
    """Hooks the trainer calls; each fault overrides the ones it needs."""

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        return None

    def after_step(self, step: int, rank: int, attempt: int, compute_s: float) -> float:
        """Seconds this fault added to the step."""
        return 0.0

    def before_copy(self, version: int, rank: int, attempt: int) -> None:
        """A parameter server with a backup, at ``version``, about to send its whole slice
        to a backup process that (re)started and holds no copy."""
        return None

    def breaks_link(self, version: int, rank: int, attempt: int) -> bool:
        """A parameter server with a backup, after a forward at ``version``: whether its link
        to the backup breaks now (both processes live on)."""
        return False

    def before_reply(self, version: int, rank: int, attempt: int) -> None:
        """A parameter server with a backup (--ps-replicas 1), once the backup acknowledged
        every update up to ``version`` and before the reply that tells a worker of it."""
        return None

    def after_checkpoint(self, step: int, path: Path, attempt: int) -> None:
        """Rank 0, once checkpoint ``path`` of ``step`` is written."""
        return None

    def after_rank_state(self, step: int, rank: int, path: Path, attempt: int) -> None:
        """Every rank, once its own state file ``path`` of ``step`` is written."""
        return None

    def validate(self) -> str | None:
        """What is wrong with the options, or None."""
        return None


@dataclass(frozen=True)
class Kill(Fault):
    rank: int
    step: int

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        if rank == self.rank and step == self.step and first_time("kill", rank, step, attempt):
            os.kill(os.getpid(), signal.SIGKILL)

    def validate(self) -> str | None:
        return None if self.rank >= 0 and self.step >= 1 else "needs rank >= 0 and step >= 1"


@dataclass(frozen=True)
class KillNode(Kill):
    """Its other workers follow their agent (runtime.die_with_parent)."""

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        if rank == self.rank and step == self.step and first_time("killnode", rank, step, attempt):
            from scaletrain import env

            os.kill(env.get_int(env.AGENT_PID) or os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Hang(Kill):
    def before_step(self, step: int, rank: int, attempt: int) -> None:
        if rank == self.rank and step == self.step and first_time("hang", rank, step, attempt):
            while True:  # the watchdog thread keeps running: it is what must end this
                time.sleep(3600)


@dataclass(frozen=True)
class _ReplicationFault(Kill):
    """A fault of a parameter server's replication (--ps-replicas 1): it fires once, at the
    first moment of its kind at version S or later on server rank R, never before a step."""

    def before_step(self, step: int, rank: int, attempt: int) -> None:
        return None

    def due(self, kind: str, version: int, rank: int, attempt: int) -> bool:
        return (
            rank == self.rank
            and version >= self.step
            and first_time(kind, rank, self.step, attempt)
        )


@dataclass(frozen=True)
class KillBeforeReply(_ReplicationFault):
    """Server rank R dies after its backup acknowledged update S (or the first forwarded
    update after it) and before its reply: the worker hears nothing of a push both copies of
    the slice hold, and sends it again to the restarted server, which must apply it once."""

    def before_reply(self, version: int, rank: int, attempt: int) -> None:
        if self.due("kill-before-reply", version, rank, attempt):
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class KillDuringCopy(_ReplicationFault):
    """Server rank R dies as it begins to copy its slice, at version S or later, to its
    restarted backup: the window in which the slice's only current copy is the dying one's."""

    def before_copy(self, version: int, rank: int, attempt: int) -> None:
        if self.due("kill-during-copy", version, rank, attempt):
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class BreakBackupLink(_ReplicationFault):
    """Server rank R's link to the backup of its slice breaks after its forward of update S
    (or the first forwarded one after it), as a network fault would, both processes alive:
    the backup links again under a new name and the primary copies its slice again."""

    def breaks_link(self, version: int, rank: int, attempt: int) -> bool:
        return self.due("break-backup-link", version, rank, attempt)


@dataclass(frozen=True)
class Slow(Fault):
    rank: int
    factor: float

    def after_step(self, step: int, rank: int, attempt: int, compute_s: float) -> float:
        if rank != self.rank:
            return 0.0
        delay = (self.factor - 1) * compute_s
        time.sleep(delay)
        return delay

    def validate(self) -> str | None:
        return None if self.rank >= 0 and self.factor >= 1 else "needs rank >= 0 and factor >= 1"


@dataclass(frozen=True)
class CorruptCheckpoint(Fault):
    step: int
    rank: int = -1  # -1: the checkpoint itself; R: rank R's own state file

    def after_checkpoint(self, step: int, path: Path, attempt: int) -> None:
        if attempt == 0 and step == self.step and self.rank < 0:
            _flip_middle(path)

    def after_rank_state(self, step: int, rank: int, path: Path, attempt: int) -> None:
        if attempt == 0 and step == self.step and rank == self.rank:
            _flip_middle(path)

    def validate(self) -> str | None:
        return None if self.step >= 1 else "needs step >= 1"


def _flip_middle(path: Path) -> None:
    """Flip 64 bytes in the middle of a file: its size stays, its sha256 fails."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


INJECTORS: dict[str, type[Fault]] = {
    "kill": Kill,
    "break-backup-link": BreakBackupLink,
    "kill-before-reply": KillBeforeReply,
    "kill-during-copy": KillDuringCopy,
    "killnode": KillNode,
    "hang": Hang,
    "slow": Slow,
    "corrupt-checkpoint": CorruptCheckpoint,
}
EXAMPLES = (
    "kill:rank=1:step=7, hang:rank=0:step=5, slow:rank=2:factor=3, corrupt-checkpoint:step=10"
)


def _build(kind: str, pairs: list[str]) -> Fault:
    cls = INJECTORS[kind]
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    types = {f.name: f.type for f in fields}
    optional = {f.name for f in fields if f.default is not dataclasses.MISSING}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in types:
            raise ValueError(f"unknown option {pair!r}; {kind} takes {', '.join(types)}")
        kind_of = float if types[key] in ("float", float) else int
        try:
            options[key] = kind_of(text)
        except ValueError:
            raise ValueError(f"{key} must be {'a number' if kind_of is float else 'an integer'}, "
                             f"got {text!r}") from None  # fmt: skip
    missing = set(types) - set(options) - optional
    if missing:
        raise ValueError(f"missing {', '.join(sorted(missing))}; {kind} takes {', '.join(types)}")
    return cls(**options)


def parse_inject(spec: str) -> list[Fault]:
    """'kill:rank=1:step=7,slow:rank=0:factor=2' -> faults. ValueError says what is valid."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in INJECTORS:
            raise ValueError(
                f"inject: unknown fault {kind!r}; known: {', '.join(sorted(INJECTORS))} "
                f"(e.g. {EXAMPLES})"
            )
        try:
            fault = _build(kind, pairs)
        except ValueError as e:
            raise ValueError(f"inject: cannot parse {item!r}: {e}") from None
        problem = fault.validate()
        if problem:
            raise ValueError(f"inject: {item!r} {problem}")
        faults.append(fault)
    return faults
