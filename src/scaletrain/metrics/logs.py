"""Per-rank log files and the launcher's account of a failed worker.

Workers redirect their own stdout/stderr into DIR/logs/rank<R>.log (runtime.redirect_output),
so one file per rank holds Python and C++ output of every attempt. torch's DefaultLogsSpecs
would instead nest files under <run_id>/attempt_<n>/<local_rank>/ and truncate per attempt;
``RunLogsSpecs`` only places the error files the agent reads (DIR/logs/errors/rank<R>.json).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs


class RunLogsSpecs(LogsSpecs):
    def __init__(self, run_dir: Path) -> None:
        super().__init__(log_dir=str(run_dir / "logs"))
        self._logs = run_dir / "logs"
        self.ranks: dict[int, int] = {}  # local rank -> global rank, in the current attempt

    @property
    def root_log_dir(self) -> str:
        return str(self._logs)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        errors = self._logs / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        dest = LogsDest()
        for local_rank, env in envs.items():
            error_file = errors / f"rank{env['RANK']}.json"
            error_file.unlink(missing_ok=True)  # a stale file would be read as this attempt's error
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
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
