"""Per-rank log files and the launcher's account of a failed worker.

Workers redirect their own stdout/stderr into DIR/logs/rank<R>.log (runtime.redirect_output),
so one file per rank holds Python and C++ output of every attempt. torch's DefaultLogsSpecs
would instead nest files under <run_id>/attempt_<n>/<local_rank>/ and truncate per attempt;
``RunLogsSpecs`` only places the error files the agent reads (DIR/logs/errors/rank<R>.json).

Error files and torch's agent race: when one worker dies the agent SIGTERMs the others at
once, and a survivor may be inside torch's ``ErrorHandler.record_exception`` (open "w", then
write) at that moment. The agent then finds an empty file, ``json.load`` raises inside its
monitor loop, and the whole job ended with "Expecting value: line 1 column 1" instead of a
restart. Two fixes, each sufficient for its half: workers write the file atomically
(``AtomicErrorHandler``: whole or absent), and the launcher reads an unreadable file as no
file at all (``tolerate_unreadable_error_files``), whatever wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

from scaletrain.env import AGENT_PID
from scaletrain.io import atomic_write_bytes

log = logging.getLogger("scaletrain.logs")


class AtomicErrorHandler(ErrorHandler):
    """torch's handler, except that the error file appears whole (temporary file, then rename)
    or not at all, even when the process is killed while writing it."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        atomic_write_bytes(Path(path), json.dumps(data).encode())


_torch_post_init = ProcessFailure.__post_init__
# Error file -> exit code of each failed worker the agent saw since the launcher last took
# them (take_exit_codes): the agent logs only its first failure, and names a survivor it
# SIGTERMed as readily as the rank that died.
_EXIT_CODES: dict[str, int] = {}
# Error file -> the failure the agent saw in this node's current attempt (RunLogsSpecs.reify
# forgets them when the next attempt starts): when the agent restarts the workers and then
# finds the rendezvous closed by another node, no ChildFailedError carries them.
_ATTEMPT_FAILURES: dict[str, ProcessFailure] = {}


def take_exit_codes() -> dict[str, int]:
    """The exit codes noted so far, by error file; forgotten once taken."""
    codes = dict(_EXIT_CODES)
    _EXIT_CODES.clear()
    return codes


def attempt_failures() -> dict[int, ProcessFailure]:
    """The failures of this node's workers in its current attempt, by global rank (the error
    file names it), as describe_failure takes them."""
    stems = {path: Path(path).stem.removeprefix("rank") for path in _ATTEMPT_FAILURES}
    return {int(stem): _ATTEMPT_FAILURES[path] for path, stem in stems.items() if stem.isdigit()}


def _tolerant_post_init(self: ProcessFailure) -> None:
    _EXIT_CODES[str(self.error_file)] = self.exitcode
    _ATTEMPT_FAILURES[str(self.error_file)] = self
    try:
        _torch_post_init(self)
    except Exception as e:  # torch re-raises whatever json.load raised
        log.warning("unreadable error file %s (%s): read as none", self.error_file, e)
        self._set_no_reply_file()
        self.message = f"exit code {self.exitcode}; its error file was unreadable"


def tolerate_unreadable_error_files() -> None:
    """Make torch's agent read an empty or torn error file as a missing one (the failure is
    still a failure; only its message is lost), so the job restarts as for any death. Every
    failure's exit code is also noted, for take_exit_codes."""
    ProcessFailure.__post_init__ = _tolerant_post_init  # type: ignore[method-assign]


class RunLogsSpecs(LogsSpecs):
    def __init__(self, run_dir: Path) -> None:
        super().__init__(log_dir=str(run_dir / "logs"))
        self._logs = self.root = run_dir / "logs"
        self.ranks: dict[int, int] = {}  # local rank -> global rank, in the current attempt

    @property
    def root_log_dir(self) -> str:
        return str(self._logs)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        errors = self._logs / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        _ATTEMPT_FAILURES.clear()  # a new attempt: the last one's failures are handled
        dest = LogsDest()
        for local_rank, env in envs.items():
            error_file = errors / f"rank{env['RANK']}.json"
            error_file.unlink(missing_ok=True)  # a stale file would be read as this attempt's error
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            # A forked worker's environment is the fork server's, plus these: the launcher's
            # own as it is now (launch/forkserver.py), and who its agent is.
            for key, value in os.environ.items():
                env.setdefault(key, value)
            env[AGENT_PID] = str(os.getpid())
            self.ranks[local_rank] = int(env["RANK"])
            dest.stdouts[local_rank] = ""  # "": inherit; the worker redirects itself
            dest.stderrs[local_rank] = ""
            dest.error_files[local_rank] = str(error_file)
        return dest


def tail(path: Path, lines: int = 12) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _reason(failure: Any) -> str:
    message = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(message, dict):
        message = message.get("message")
    if isinstance(message, str) and message and message != "<NONE>":  # torch's "no file"
        return message.strip().splitlines()[-1]
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"killed by {name}"
    return f"exited with code {failure.exitcode} without a Python exception"


# What a rank reports when a *peer* died: symptoms, not causes.
COLLATERAL = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh",
    "killed by SIGTERM",
    # torch's store client, when the process hosting the store (rank 0's worker store) died:
    # a rank still in its group's rendezvous when rank 0 died raised this, before the agent
    # stopped it, and was named the cause (one CI run in several).
    "Connection was likely closed",
)


def _root_cause_order(failure: Any) -> tuple[bool, int]:
    """Sort key: causes before symptoms, then the earliest. The agent's own timestamps have
    one-second resolution, so the error file's modification time (written by @record as the
    exception leaves the worker) orders exceptions within a second."""
    collateral = any(pattern in _reason(failure) for pattern in COLLATERAL)
    try:
        when = os.stat(failure.error_file).st_mtime_ns
    except (OSError, TypeError):
        when = int(failure.timestamp * 1e9)
    return collateral, when


def with_error_files(failures: Mapping[int, Any], logs: RunLogsSpecs) -> dict[int, Any]:
    """``failures`` (by global rank) and every other rank of this node that wrote an error file
    in this attempt: torch's agent reports the first failed worker only when it forks them
    (launch/forkserver.py), and a peer's collective error often comes first."""
    out = dict(failures)
    for local_rank, rank in logs.ranks.items():
        path = logs.root / "errors" / f"rank{rank}.json"
        if rank not in out and path.exists():  # exit 1: the worker's exit after an exception
            out[rank] = ProcessFailure(local_rank=local_rank, pid=-1, exitcode=1,
                                       error_file=str(path))  # fmt: skip
    return out


def describe_failure(failures: Mapping[int, Any], run_dir: Path) -> str:
    """One paragraph: the rank whose failure caused the others', why, its last log lines,
    where the rest is."""
    first = min(failures, key=lambda r: _root_cause_order(failures[r]))
    failure = failures[first]
    log_path = run_dir / "logs" / f"rank{first}.log"
    others = sorted(r for r in failures if r != first)
    lines = [
        f"rank {first} failed (exit code {failure.exitcode}): {_reason(failure).rstrip('.')}.",
    ]
    if others:
        listed = "; ".join(f"rank {r}: {_reason(failures[r]).rstrip('.')}" for r in others)
        lines.append(f"Other ranks: {listed}.")
    lines.append("The remaining workers were stopped.")
    last = tail(log_path)
    if last:
        lines.append(f"Last lines of {log_path}:")
        lines += ["    " + line for line in last]
    lines.append(f"All logs: {run_dir / 'logs'}")
    return "\n".join(lines)
