"""Strategy registry: name -> Strategy class. Unknown names raise ValueError listing the known."""

from __future__ import annotations

from scaletrain.config import RunConfig
from scaletrain.registry import lookup
from scaletrain.runtime import DistContext
from scaletrain.strategies.base import Batch, StepResult, Strategy
from scaletrain.strategies.ddp import DDPStrategy
from scaletrain.strategies.diloco import DiLoCoStrategy
from scaletrain.strategies.fsdp import FSDPStrategy
from scaletrain.strategies.local_sgd import LocalSGDStrategy
from scaletrain.strategies.pipeline import PipelineStrategy
from scaletrain.strategies.tensor import TensorStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDPStrategy,
    "local_sgd": LocalSGDStrategy,
    "diloco": DiLoCoStrategy,
    "fsdp": FSDPStrategy,
    "pipeline": PipelineStrategy,
    "tensor": TensorStrategy,
}


def build_strategy(name: str, ctx: DistContext, cfg: RunConfig) -> Strategy:
    return lookup(STRATEGIES, name, "strategy", "strategies")(ctx, cfg)


__all__ = ["STRATEGIES", "Batch", "StepResult", "Strategy", "build_strategy"]
