"""Strategy registry: name -> Strategy class. Unknown names raise ValueError listing the known."""

from __future__ import annotations

from scaletrain.config import RunConfig
from scaletrain.registry import lookup
from scaletrain.runtime import DistContext
from scaletrain.strategies.base import Batch, StepResult, Strategy
from scaletrain.strategies.ddp import DDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDPStrategy,
}


def build_strategy(name: str, ctx: DistContext, cfg: RunConfig) -> Strategy:
    return lookup(STRATEGIES, name, "strategy", "strategies")(ctx, cfg)


__all__ = ["STRATEGIES", "Batch", "StepResult", "Strategy", "build_strategy"]
