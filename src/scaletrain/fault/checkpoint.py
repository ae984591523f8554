"""Atomic files and checkpoints: a reader sees the old file or the new one, never half.

Writes go to a temporary file in the same directory, are fsynced, renamed over the target,
and the directory is fsynced so the rename itself survives a crash. Checkpoints are
``step-<N>.pt`` files listed with their sha256 in ``index.json``; loading takes the newest one
whose bytes still match, with ``weights_only=True``. What goes into a checkpoint is the
trainer's business (trainer.py); sharded state through DCP is the fault-tolerance issue's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


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
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def atomic_torch_save(path: Path, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


CHECKPOINT_INDEX = "index.json"


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as step-<step>.pt and record it, with its sha256, in index.json.

    The index is rewritten atomically after the checkpoint file is in place, so it only ever
    names complete files; it keeps the newest ``keep`` entries and older files are removed.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = directory / f"step-{step:08d}.pt"
    atomic_write_bytes(path, data)
    entries = [e for e in read_index(directory) if e["step"] != step]
    entries.append({"step": step, "file": path.name, "sha256": hashlib.sha256(data).hexdigest()})
    entries.sort(key=lambda e: e["step"])
    kept, dropped = entries[-keep:], entries[:-keep]
    atomic_write_json(directory / CHECKPOINT_INDEX, kept)
    for entry in dropped:
        (directory / entry["file"]).unlink(missing_ok=True)
    return path


def read_index(directory: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((directory / CHECKPOINT_INDEX).read_text()))
    except FileNotFoundError:
        return []


def load_latest(directory: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest checkpoint whose bytes match its recorded sha256, loaded with
    weights_only=True, and a note for every newer one that was skipped as damaged."""
    skipped = []
    for entry in reversed(read_index(directory)):
        path = directory / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            skipped.append(f"{path}: unreadable ({e.strerror})")
            continue
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            skipped.append(f"{path}: sha256 differs from {CHECKPOINT_INDEX}")
            continue
        return torch.load(io.BytesIO(data), weights_only=True), skipped
    return None, skipped
