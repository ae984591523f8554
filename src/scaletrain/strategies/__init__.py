"""Strategy registry: name -> Strategy class. Unknown names raise ValueError listing the known.

Each strategy's module is imported only when it is asked for: a worker imports the one it
runs (torch.distributed.pipelining alone adds about a second to a worker's start on 2 cores,
and every restart pays a worker's start). ``all_strategies()`` (for the launcher's
checks) imports every one.
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
    "ps": "scaletrain.strategies.param_server.worker:PSWorkerStrategy",
}
# local_sgd and diloco in place: rounds with the quorum at each synchronization.
_INPLACE_ROUNDS = "scaletrain.strategies.inplace_rounds:InplaceRoundsStrategy"
# fsdp in place: replica groups (HSDP), the quorum across them.
_INPLACE_HSDP = "scaletrain.strategies.inplace_hsdp:InplaceHSDPStrategy"
# What a mode runs in place of the strategy the user named (the launcher checks the pair).
_MODE_CLASSES: dict[str, str] = {
    "inplace": "scaletrain.strategies.inplace:InplaceStrategy",
}


def strategy_class(name: str) -> type[Strategy]:
    module, _, cls = lookup(_CLASSES, name, "strategy", "strategies").partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def stepping_class(cfg: RunConfig, mode: str) -> type[Strategy]:
    """The strategy a worker of ``mode`` steps with: the one the user named, or the one the
    mode runs in its place (torchft's for in-place recovery)."""
    target = _MODE_CLASSES.get(mode)
    if mode == "inplace" and cfg.train.strategy in ("local_sgd", "diloco"):
        target = _INPLACE_ROUNDS
    if mode == "inplace" and cfg.train.strategy == "fsdp":
        target = _INPLACE_HSDP
    if target is None:
        return strategy_class(cfg.train.strategy)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def build_strategy(cfg: RunConfig, ctx: DistContext) -> Strategy:
    return stepping_class(cfg, ctx.mode)(ctx, cfg)


def all_strategies() -> dict[str, type[Strategy]]:
    """Every strategy's class (imports every module: for the launcher's checks)."""
    return {name: strategy_class(name) for name in _CLASSES}


__all__ = [
    "all_strategies",
    "Batch",
    "StepResult",
    "Strategy",
    "StrategyChecks",
    "build_strategy",
    "stepping_class",
    "strategy_class",
]
