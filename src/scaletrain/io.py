"""Files every layer writes and reads: atomic whole files, and JSON lines appended by many
processes at once.

Atomic writes go to a temporary file in the same directory, are fsynced, renamed over the
target, and the directory is fsynced so the rename itself survives a crash: a reader sees the
old file or the new one, never half. JSONL files (metrics.jsonl, logs/incidents.jsonl,
logs/ps_events.jsonl, ...) are appended one record per ``os.write`` on an O_APPEND
descriptor, which the kernel keeps whole for writes of this size on a local file system, so
lines of different processes never interleave mid-line; a process killed mid-append can still
leave a torn last line, which ``read_jsonl`` skips.

This is the bottom of the package: it imports nothing of scaletrain (and torch only inside
``atomic_torch_save``).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; run files are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def read_json(path: Path) -> Any:
    """A JSON file's contents, or None when it is missing or unreadable (files here are
    written atomically, so unreadable means damaged, not half-written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def torch_bytes(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def atomic_torch_save(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, torch_bytes(obj))


class JsonlWriter:
    """An open JSONL file for a process that appends many records (a rank's steps)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One record appended in one write (opened and closed here: for occasional records,
    such as incidents, that processes on several nodes may append at once)."""
    writer = JsonlWriter(path)
    try:
        writer.write(record)
    finally:
        writer.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file; [] when it does not exist. A line that is not
    a JSON object (a torn last line: its writer died mid-append) is skipped. Every reader of
    metrics.jsonl, incidents.jsonl and the ps event logs goes through here."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
