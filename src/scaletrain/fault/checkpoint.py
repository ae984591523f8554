"""Checkpoints: ``step-<N>.pt`` files listed with their sha256 in ``index.json``, each
written atomically (scaletrain.io: a reader sees the old file or the new one, never half);
loading takes the newest one whose bytes still match, with ``weights_only=True``. What goes
into a checkpoint is the trainer's business (trainer.py); ``AsyncCheckpointer`` writes it in
the background.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scaletrain.io import atomic_write_bytes, atomic_write_json, fsync_dir, torch_bytes

CHECKPOINT_INDEX = "index.json"
PREVIOUS_INDEX = "index.prev.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one stands."""


def tree_sha256(root: Path) -> str:
    """One digest over every file under ``root`` (relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def publish_dir(tmp: Path, final: Path) -> str:
    """Move a finished sharded checkpoint (a DCP directory) into place atomically; its digest."""
    digest = tree_sha256(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return digest


def save_checkpoint(
    directory: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    shards: dict[str, str] | None = None,
) -> Path:
    """Write ``state`` as step-<step>.pt and record it, with its sha256, in index.json.
    ``shards`` ({"dir": name, "sha256": digest}) names a sharded part published beside it.

    The index is rewritten atomically after the checkpoint file is in place, so it only ever
    names complete files; it keeps the newest ``keep`` entries and older files are removed.
    """
    data = torch_bytes(state)
    path = directory / f"step-{step:08d}.pt"
    entries = [e for e in read_index(directory) if e["step"] != step]
    try:
        atomic_write_bytes(path, data)
        entry = {"step": step, "file": path.name, "sha256": hashlib.sha256(data).hexdigest()}
        if shards:
            entry["shards"] = shards
        entries.append(entry)
        entries.sort(key=lambda e: e["step"])
        kept, dropped = entries[-keep:], entries[:-keep]
        index = directory / CHECKPOINT_INDEX
        if index.exists():  # the previous generation: the fallback for a damaged index
            atomic_write_bytes(directory / PREVIOUS_INDEX, index.read_bytes())
        atomic_write_json(index, kept)
    except OSError as e:
        previous = max((e["step"] for e in entries if e["file"] != path.name), default=None)
        intact = f"step {previous}" if previous is not None else "none yet"
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} to {directory}: {e.strerror} "
            f"({len(data) / 1e6:.1f} MB); the previous checkpoint ({intact}) is intact. "
            "Free space on that file system or choose another --out."
        ) from None
    for old in dropped:
        (directory / old["file"]).unlink(missing_ok=True)
        if "shards" in old:
            shutil.rmtree(directory / old["shards"]["dir"], ignore_errors=True)
    return path


def remove_unfinished(directory: Path) -> None:
    """Delete sharded checkpoints a failed attempt left half-written (never published). Call
    only when no save can be in flight: at the start of an attempt, before the first step."""
    for stale in directory.glob(".step-*.dcp.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def snapshot(obj: Any) -> Any:
    """A copy of a checkpoint state that training can no longer change: every tensor cloned to
    CPU memory, containers rebuilt, everything else shared (it is immutable or not touched)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class AsyncCheckpointer:
    """--checkpoint-async: the step waits only for ``snapshot`` (taken by the caller); the
    write (serializing, fsync, index update) runs in a background thread. One write is in
    flight at a time: a new one first waits for the previous (so a slow disk cannot pile up
    snapshots in memory). A write that fails (disk full) is reported by the next ``submit``
    or by ``wait``, and, as the writes are atomic, leaves the previous checkpoint intact."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # re-raised in the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="scaletrain-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight is on disk; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def rng_path(directory: Path, step: int, rank: int) -> Path:
    """Where rank ``rank`` keeps its own state for the checkpoint of ``step``: its RNG states
    and any per-rank part of the strategy's (a local-SGD replica between synchronizations).
    Each rank writes its own file: no collective on the checkpoint path, and rank 0's
    checkpoint keeps its own states as the fallback for a rank whose file is missing."""
    return directory / "rng" / f"step-{step:08d}-rank{rank}.pt"


_DIGEST = b"sha256:"


def save_rank_state(path: Path, state: Any) -> None:
    """A per-rank state file that carries its own checksum: "sha256:<hex>\n" then torch.save
    bytes (rank 0 cannot list every rank's digest in index.json without a collective)."""
    data = torch_bytes(state)
    atomic_write_bytes(path, _DIGEST + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)


class DamagedFile(ValueError):
    """A checkpoint file whose bytes do not match its checksum."""


def load_rank_state(path: Path) -> Any:
    """What save_rank_state wrote; FileNotFoundError when absent, DamagedFile when its bytes
    do not match its digest (torn, truncated, flipped)."""
    raw = path.read_bytes()
    head, _, data = raw.partition(b"\n")
    if not head.startswith(_DIGEST) or hashlib.sha256(data).hexdigest() != head[7:].decode(
        errors="replace"
    ):
        raise DamagedFile(f"{path}: sha256 does not match its contents")
    return torch.load(io.BytesIO(data), weights_only=True)


def prune_rng_files(directory: Path) -> None:
    """Remove the per-rank files of checkpoints dropped from the index: those older than its
    oldest entry. Never newer ones: a rank may be steps ahead of rank 0 (local SGD between
    synchronizations has no collective to hold it) and have written its files for
    checkpoints rank 0 has not recorded yet; deleting them made that rank resume from rank
    0's replica instead of its own."""
    steps = [e["step"] for e in read_index(directory)]
    if not steps:
        return
    for path in (directory / "rng").glob("step-*-rank*.pt"):
        if int(path.name.split("-")[1]) < min(steps):
            path.unlink(missing_ok=True)


def _parse_index(path: Path) -> list[dict[str, Any]]:
    """The entries of an index file; [] when absent; DamagedFile when it is not a list of
    {step, file, sha256} entries (torn or edited)."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedFile(f"{path}: not JSON ({e})") from None
    ok = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("step"), int) and isinstance(e.get("file"), str)
        and isinstance(e.get("sha256"), str) for e in entries
    )  # fmt: skip
    if not ok:
        raise DamagedFile(f"{path}: not a list of checkpoint entries")
    return list(entries)


def read_index(directory: Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The checkpoints index.json lists, oldest first. A damaged index is read as the
    previous generation (index.prev.json, written before each update), and failing that as
    empty; each file it names is still checked against its sha256 before it is loaded.
    ``notes`` collects what was found damaged."""
    for name in (CHECKPOINT_INDEX, PREVIOUS_INDEX):
        try:
            return _parse_index(directory / name)
        except DamagedFile as e:
            if notes is not None:
                notes.append(str(e))
    return []


def load_latest(
    directory: Path, below: int | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest checkpoint (of a step before ``below``, when given) whose bytes match its
    recorded sha256, loaded with weights_only=True, and a note for every newer one that was
    skipped as damaged (a damaged index too)."""
    skipped: list[str] = []
    for entry in reversed(read_index(directory, skipped)):
        if below is not None and entry["step"] >= below:
            continue
        path = directory / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            skipped.append(f"{path}: unreadable ({e.strerror})")
            continue
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            skipped.append(f"{path}: sha256 differs from {CHECKPOINT_INDEX}")
            continue
        shards = entry.get("shards")
        if shards:
            shard_dir = directory / shards["dir"]
            if not shard_dir.is_dir() or tree_sha256(shard_dir) != shards["sha256"]:
                skipped.append(f"{shard_dir}: shards missing or sha256 differs")
                continue
        state = torch.load(io.BytesIO(data), weights_only=True)
        if shards:  # the strategy loads its sharded part from here (every rank reads it)
            state["strategy"] = {"dcp": str(directory / shards["dir"])}
        return state, skipped
    return None, skipped
