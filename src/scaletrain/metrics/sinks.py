"""Where per-step metrics go: DIR/metrics.jsonl, one JSON object per step per rank.

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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file (a trailing partial line is ignored)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
