"""Where per-step metrics go: DIR/metrics.jsonl, one JSON object per step per rank, and
TensorBoard scalars under DIR/events/rank<R>/ (metrics/tensorboard.py).

All ranks append to the same file, one record per write (scaletrain.io.JsonlWriter), so
lines of different ranks never interleave mid-line. The launcher tails this file to draw the
progress bar.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.io import JsonlWriter

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
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "loss_scale": "optim/loss_scale",
    "test_accuracy": "eval/accuracy",
    "test_loss": "eval/loss",
}


class StepSinks:
    """A rank's step records: the JSONL line and its TensorBoard scalars (plus samples/s)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        from scaletrain.metrics.tensorboard import EventWriter

        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
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
