"""What a checkpoint holds, and resuming from one after the elastic agent restarts workers.

A checkpoint is the strategy's state (weights, optimizer), the sampler's (epoch, cursor), the
loop's progress (step, epoch, samples trained, recoveries so far), rank 0's RNG states (torch,
numpy, python) and the config hash. It is written by rank 0 after the optimizer step it
describes, so the cursor in it never counts a sample whose update is not in the weights.

Restart recovery: when any worker dies, torch's elastic agent stops the group and starts it
again (``--max-restarts``), possibly with another world size (``--nnodes MIN:MAX``); every
worker then loads the newest valid checkpoint and the sampler re-plans the rest of the epoch
over the ranks there are now. All ranks restore rank 0's RNG state: they were seeded alike and
draw alike in the loop, so this is exact for the built-in models; per-rank RNG (dropout that
must differ between ranks) is left to the fault-tolerance issue, with DCP for sharded state.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.fault.checkpoint import load_latest
from scaletrain.metrics.sinks import read_jsonl
from scaletrain.strategies.base import Strategy

log = logging.getLogger("scaletrain.recovery")


@dataclass(kw_only=True)
class Progress:
    step: int = 0
    epoch: int = 0
    samples_trained: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)


def rng_state() -> dict[str, Any]:
    numpy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = numpy_state
    return {
        "torch": torch.get_rng_state(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def checkpoint_state(
    strategy: Strategy, sampler: GlobalBatchSampler, progress: Progress, config_hash: str
) -> dict[str, Any]:
    return {
        "strategy": strategy.state_dict(),
        "sampler": sampler.state_dict(),
        "progress": asdict(progress),
        "rng": rng_state(),
        "config_hash": config_hash,
    }


def resume(
    checkpoints: Path,
    strategy: Strategy,
    sampler: GlobalBatchSampler,
    *,
    config_hash: str,
    attempt: int,
    metrics: Path,
) -> Progress | None:
    """Load the newest valid checkpoint into ``strategy`` and ``sampler``; None if there is
    none. The restart is recorded in the returned progress's recoveries."""
    state, skipped = load_latest(checkpoints)
    for note in skipped:
        log.warning("skipping damaged checkpoint %s", note)
    if state is None:
        return None
    if state["config_hash"] != config_hash:
        raise ValueError(
            f"the checkpoints in {checkpoints} were written by another configuration "
            f"(config hash {state['config_hash']}, this run {config_hash})"
        )
    strategy.load_state_dict(state["strategy"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    progress = Progress(**state["progress"])
    reached = max((r["step"] for r in read_jsonl(metrics)), default=0) if metrics.exists() else 0
    progress.recoveries.append(
        {
            "kind": "restart",
            "attempt": attempt,
            "world_size": sampler.world_size,
            "step": progress.step,
            "lost_steps": max(0, reached - progress.step),
            "skipped_checkpoints": len(skipped),
        }
    )
    log.info(
        "resumed at step %d, epoch %d, cursor %d", progress.step, progress.epoch, sampler.cursor
    )
    return progress
