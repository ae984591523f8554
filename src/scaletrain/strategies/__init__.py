"""Strategy registry: name -> Strategy class. Unknown names raise ValueError listing the known.

Each strategy's module is imported only when it is asked for: a worker imports the one it
runs (torch.distributed.pipelining alone adds about a second to a worker's start on 2 cores,
and every restart pays a worker's start). ``STRATEGIES`` (all of them, for the launcher's
checks) imports every module on first use.
"""

from __future__ import annotations

import importlib

from scaletrain.config import RunConfig
from scaletrain.registry import lookup
from scaletrain.runtime import DistContext
from scaletrain.strategies.base import Batch, StepResult, Strategy, StrategyChecks

_CLASSES: dict[str, str] = {
    "ddp": "scaletrain.strategies.ddp:DDPStrategy",
    "local_sgd": "scaletrain.strategies.local_sgd:LocalSGDStrategy",
    "diloco": "scaletrain.strategies.diloco:DiLoCoStrategy",
    "fsdp": "scaletrain.strategies.fsdp:FSDPStrategy",
    "pipeline": "scaletrain.strategies.pipeline:PipelineStrategy",
    "tensor": "scaletrain.strategies.tensor:TensorStrategy",
    "ps": "scaletrain.strategies.param_server:ParameterServer",
}


def strategy_class(name: str) -> type[StrategyChecks]:
    module, _, cls = lookup(_CLASSES, name, "strategy", "strategies").partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def build_strategy(name: str, ctx: DistContext, cfg: RunConfig) -> Strategy:
    cls = strategy_class(name)
    assert issubclass(cls, Strategy), f"{name} runs its own loop ({cls.launcher})"
    return cls(ctx, cfg)


def __getattr__(attr: str) -> dict[str, type[StrategyChecks]]:
    if attr == "STRATEGIES":
        return {name: strategy_class(name) for name in _CLASSES}
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = [
    "STRATEGIES",
    "Batch",
    "StepResult",
    "Strategy",
    "StrategyChecks",
    "build_strategy",
    "strategy_class",
]
