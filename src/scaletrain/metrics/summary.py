"""Per-rank totals, their aggregation over ranks, and summary.json.

summary.json (written by rank 0 at the end) holds the contract other tools read: strategy,
world_size, steps, samples, wall_s, samples_per_s, final_loss, test_accuracy,
time_breakdown {compute_s, comm_s, wait_s, data_s, checkpoint_s}, recoveries and
params_sha256, plus the extras documented in docs/reference/run-directory.md. ``steps`` and
``samples`` count the whole job; so do wall_s and samples_per_s (from its first run's start,
through failures and resumes, metrics/goodput.py, with goodput and time_lost); train_wall_s and
train_samples_per_s, and the times, the last attempt's training loop. Time totals in
time_breakdown are the mean over ranks of each rank's sum over its steps; per_rank lists
every rank's own totals.
"""

from __future__ import annotations

import hashlib
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.config import clip_scope
from scaletrain.metrics.phases import startup_summary
from scaletrain.metrics.timers import overlap_ratio


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def params_sha256(model: nn.Module) -> str:
    """Hash of every parameter's name, dtype, shape and bytes, in name order. Buffers are left
    out on purpose: BatchNorm running statistics legitimately differ between DDP ranks."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


TIME_KEYS = ("compute_s", "comm_s", "wait_s", "data_s")


@dataclass(kw_only=True)
class RankTotals:
    rank: int
    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wait_s: float = 0.0
    data_s: float = 0.0
    comm_bytes: int = 0
    dense_bytes: int = 0
    last_loss: float = float("nan")
    last_samples: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # Strategy.memory_bytes() at the end
    peak_rss_bytes: int = 0
    # Pipeline stages: seconds computing and idle, leaving out the attempt's first step (it
    # also infers the shapes between stages).
    stage_busy_s: float = 0.0
    stage_idle_s: float = 0.0
    # The hash of this rank's whole replica at the end ("" where a rank holds only a part of
    # the model: fsdp, tensor, pipeline). Data-parallel replicas must agree bit for bit.
    params_sha256: str = ""
    # The end of this process's run: its attempt, the loop's progress (step, samples trained
    # over all ranks), its wall time from the first step, and its share of the evaluation
    # (test samples it scored and how many it got right; 0, 0 when it scored none).
    attempt: int = 0
    step: int = 0
    samples_trained: int = 0
    wall_s: float = 0.0
    test_correct: float = 0.0
    test_total: float = 0.0
    device: str = "cpu"
    steps_per_epoch: int = 0  # under this process's last membership
    compiled_graphs: int = 0  # --compile: the graphs torch.compile captured
    open_fds: int = 0  # file descriptors held at the end
    phases: dict[str, float] = field(default_factory=dict)  # start-up marks (phases.py)
    # A fleet's process: its checkpoints' account (Checkpointing.describe), "" elsewhere.
    checkpointing: dict[str, Any] = field(default_factory=dict)
    checkpoint_s: float = 0.0  # seconds this process blocked on checkpoints

    def add(self, record: dict[str, Any]) -> None:
        self.steps += 1
        self.samples += record["samples"]
        self.step_s += record["step_s"]
        for key in TIME_KEYS:
            setattr(self, key, getattr(self, key) + record[key])
        self.comm_bytes += record["comm_bytes"]
        self.dense_bytes += record["dense_bytes"]
        self.last_samples = record["samples"]
        if record["samples"]:
            self.last_loss = record["loss"]
        if "stage_busy_s" in record and self.steps > 1:
            self.stage_busy_s += record["stage_busy_s"]
            self.stage_idle_s += record["stage_idle_s"]


def accuracy(counts: list[tuple[float, float]]) -> float | None:
    """Test accuracy from the (correct, total) counts of every part of the evaluation."""
    total = sum(t for _, t in counts)
    return sum(c for c, _ in counts) / total if total > 0 else None


def run_info(cfg: Any, *, data_world_size: int, steps_per_epoch: int | None) -> dict[str, Any]:
    """summary.json's description of the run, the same in every mode."""
    from scaletrain.version import __version__

    return {
        "strategy": cfg.train.strategy,
        "batch_size_per_worker": cfg.train.batch_size,
        "grad_accum": cfg.train.grad_accum,
        # Samples per optimizer step over all data-parallel ranks.
        "global_batch_size": cfg.samples_per_step * data_world_size,
        "precision": cfg.train.precision,
        "epochs": cfg.train.epochs,
        "steps_per_epoch": steps_per_epoch,
        "clip_grad_norm": (
            {"max_norm": cfg.optim.clip_grad_norm, "scope": clip_scope(cfg)}
            if cfg.optim.clip_grad_norm
            else None
        ),
        "config_hash": cfg.hash(),
        "scaletrain_version": __version__,
        "torch_version": torch.__version__,
    }


@dataclass(kw_only=True)
class SummaryParts:
    """What a mode knows at the end of a run, for ``write_summary``: the processes' final
    totals, the job's progress, and the sections only that mode has (``extras``: the
    parameter server's, the checkpoints' account, a strategy's)."""

    finals: list[RankTotals]
    steps: int
    samples: int
    recoveries: list[dict[str, Any]]
    checkpoint_s: float
    params_hash: str
    data_world_size: int
    steps_per_epoch: int | None
    backend: str
    world_size: int | None = None  # the job's processes, when not one per final (ps servers)
    wall_s: float | None = None
    test_counts: list[tuple[float, float]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def write_summary(cfg: Any, run_dir: Path, parts: SummaryParts) -> dict[str, Any]:
    """summary.json, for every mode: the one place it is assembled and written (rank 0 of
    the restart mode, the in-place and parameter-server launchers call it)."""
    from scaletrain.io import atomic_write_json

    info = {
        **run_info(cfg, data_world_size=parts.data_world_size,
                   steps_per_epoch=parts.steps_per_epoch),
        "backend": parts.backend,
        **parts.extras,
    }  # fmt: skip
    summary = summarize(
        parts.finals, steps=parts.steps, samples=parts.samples, recoveries=parts.recoveries,
        checkpoint_s=parts.checkpoint_s, params_hash=parts.params_hash, info=info,
        wall_s=parts.wall_s, test_counts=parts.test_counts, run_dir=run_dir,
    )  # fmt: skip
    if parts.world_size is not None:
        summary["world_size"] = parts.world_size
    atomic_write_json(run_dir / "summary.json", summary)
    return summary


def summarize(
    finals: list[RankTotals],
    *,
    steps: int,
    samples: int,
    recoveries: list[dict[str, Any]],
    checkpoint_s: float,
    params_hash: str,
    info: dict[str, Any],
    wall_s: float | None = None,
    test_counts: list[tuple[float, float]] | None = None,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """summary.json from every process's final totals, in every mode: rank 0 of a restart
    mode world gathers them; the launchers of in-place recovery and the parameter server read
    them from logs/final/. ``wall_s``: this attempt's training, default the longest process's;
    ``test_counts``: the evaluation's parts, by default the processes' own. With ``run_dir``
    the job's whole time (metrics/goodput.py) from its records: ``wall_s`` and
    ``samples_per_s`` are the job's, ``train_wall_s`` and ``train_samples_per_s`` this
    attempt's training loop."""
    counts = test_counts if test_counts is not None else [
        (r.test_correct, r.test_total) for r in finals
    ]  # fmt: skip
    summary = build_summary(
        finals,
        wall_s=wall_s if wall_s is not None else max(r.wall_s for r in finals),
        checkpoint_s=checkpoint_s,
        progress=_Totals(step=steps, samples_trained=samples, recoveries=recoveries),
        test_accuracy=accuracy(counts),
        params_hash=params_hash,
        info={**info, "device": finals[0].device},
    )
    summary["train_wall_s"] = summary["wall_s"]
    summary["train_samples_per_s"] = summary["samples_per_s"]
    if run_dir is not None:
        from scaletrain.io import read_jsonl
        from scaletrain.metrics.goodput import job_time

        job = job_time(
            read_jsonl(run_dir / "metrics.jsonl"),
            read_jsonl(run_dir / "logs" / "job_runs.jsonl"),
            recoveries,
            end=time.time(),
        )
        summary["wall_s"] = job["wall_s"]
        summary["samples_per_s"] = samples / job["wall_s"] if job["wall_s"] > 0 else None
        summary["goodput"] = job["goodput"]
        runs = [j for j in read_jsonl(run_dir / "logs" / "job_runs.jsonl") if "started_at" in j]
        launched = runs[-1]["started_at"] if runs else None
        summary["startup"] = startup_summary([r.phases for r in finals], launched)
        summary["time_lost"] = job["lost"]
        summary["job_runs"] = job["job_runs"]
    return summary


@dataclass(kw_only=True)
class _Totals:
    step: int
    samples_trained: int
    recoveries: list[dict[str, Any]]


def build_summary(
    ranks: list[RankTotals],
    *,
    wall_s: float,
    checkpoint_s: float,
    progress: Any,
    test_accuracy: float | None,
    params_hash: str,
    info: dict[str, Any],
) -> dict[str, Any]:
    world = len(ranks)
    steps = progress.step
    samples = progress.samples_trained
    attempt_samples = sum(r.samples for r in ranks)
    last_n = sum(r.last_samples for r in ranks)
    weighted = sum(r.last_loss * r.last_samples for r in ranks if r.last_samples)
    final_loss = weighted / last_n if last_n else None
    breakdown = {key: sum(getattr(r, key) for r in ranks) / world for key in TIME_KEYS}
    breakdown["checkpoint_s"] = checkpoint_s
    step_s = sum(r.step_s for r in ranks) / world
    sent = sum(r.comm_bytes for r in ranks)
    if "pipeline" in info:
        busy = sum(r.stage_busy_s for r in ranks)
        idle = sum(r.stage_idle_s for r in ranks)
        info = {**info, "pipeline": {
            **info["pipeline"],
            "bubble_measured": idle / (busy + idle) if busy + idle > 0 else None,
        }}  # fmt: skip
    dense = sum(r.dense_bytes for r in ranks)
    return {
        **info,
        "world_size": world,
        "steps": steps,
        "samples": samples,
        "wall_s": wall_s,
        "samples_per_s": attempt_samples / wall_s if wall_s > 0 else None,
        "final_loss": final_loss,
        "test_accuracy": test_accuracy,
        "time_breakdown": breakdown,
        "comm_share": breakdown["comm_s"] / step_s if step_s > 0 else 0.0,
        "wait_share": breakdown["wait_s"] / step_s if step_s > 0 else 0.0,
        "overlap": overlap_ratio(
            breakdown["compute_s"],
            breakdown["comm_s"],
            breakdown["compute_s"] + breakdown["wait_s"],
        ),
        "comm_bytes_per_step": sent / world / max(ranks[0].steps, 1),
        "compression_ratio": dense / sent if sent else None,
        "recoveries": progress.recoveries,
        # The largest per-rank training state (params + grads + optimizer state) and process
        # peak RSS (which also counts torch itself, data and activations).
        "max_rank_state_bytes": max((sum(r.memory.values()) for r in ranks), default=0),
        "max_rank_peak_rss_bytes": max(r.peak_rss_bytes for r in ranks),
        "max_rank_open_fds": max(r.open_fds for r in ranks),
        # --compile: graphs torch.compile captured on the rank that captured the fewest
        # (0 means some rank ran eagerly after all).
        "compiled_graphs": min(r.compiled_graphs for r in ranks),
        "params_sha256": params_hash,
        # Every rank's replica hashed alike: True/False; None where ranks hold parts.
        "replicas_agree": (
            len({r.params_sha256 for r in ranks}) == 1
            if all(r.params_sha256 for r in ranks)
            else None
        ),
        "per_rank": [asdict(r) for r in ranks],
    }
