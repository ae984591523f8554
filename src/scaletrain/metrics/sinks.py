"""Where per-step metrics go: DIR/metrics.jsonl, one JSON object per step per rank, and
TensorBoard scalars under DIR/events/rank<R>/ (metrics/tensorboard.py).

All ranks of a node append to the same file. Each record is written with a single
``os.write`` on an O_APPEND descriptor, which the kernel keeps whole for writes of this size
on a local file system, so lines of different ranks never interleave mid-line. The launcher
tails this file to draw the progress bar.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# metrics.jsonl keys that become TensorBoard scalars, under these tags.
SCALARS = {
    "loss": "train/loss",
    "step_s": "time/step_s",
    "compute_s": "time/compute_s",
    "comm_s": "time/comm_s",
    "wait_s": "time/wait_s",
    "data_s": "time/data_s",
    "checkpoint_s": "time/checkpoint_s",
    "overlap": "comm/overlap",
    "comm_bytes": "comm/bytes_sent",
    "participants": "fault/participants",
    "stage_idle_s": "pipeline/stage_idle_s",
}


class StepSinks:
    """A rank's step records: the JSONL line and its TensorBoard scalars (plus samples/s)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        from scaletrain.metrics.tensorboard import EventWriter

        self.jsonl = JsonlSink(run_dir / "metrics.jsonl")
        self.events = EventWriter(run_dir / "events" / f"rank{rank}")

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        values = {tag: float(record[key]) for key, tag in SCALARS.items()
                  if record.get(key) is not None}  # fmt: skip
        if record.get("step_s"):
            values["train/samples_per_s"] = record["global_samples"] / record["step_s"]
        self.events.scalars(record["step"], values, record.get("unix_time"))

    def close(self) -> None:
        self.jsonl.close()
        self.events.close()


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
