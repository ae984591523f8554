"""--max-memory-per-rank: estimate each strategy's per-rank training state before any worker
starts, and refuse a configuration that would not fit, naming the strategies that would.

The estimate counts parameters, gradients and optimizer state (each strategy's
``estimate_state_bytes``), not activations, data or the framework itself: it is the part that
sharding divides. Optimizer state: SGD with momentum keeps one parameter-sized buffer, without
momentum none, Adam and AdamW two.
"""

from __future__ import annotations

from torch import nn

from scaletrain.config import RunConfig


def optimizer_copies(cfg: RunConfig) -> int:
    if cfg.optim.optimizer == "sgd":
        return 1 if cfg.optim.momentum > 0 else 0
    return 2


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def check_memory_budget(cfg: RunConfig, model: nn.Module, world_size: int) -> dict[str, int]:
    """Every strategy's estimate (leaving out those that cannot run this model, e.g. pipeline
    on a model that is not Sequential); ValueError when the configured one exceeds the budget."""
    from scaletrain.strategies import all_strategies
    from scaletrain.strategies.base import model_bytes

    params = model_bytes(model)
    copies = optimizer_copies(cfg)
    estimates = {
        name: estimate
        for name, cls in all_strategies().items()
        if (estimate := cls.estimate_state_bytes(model, copies, cfg, world_size)) is not None
    }
    budget = cfg.train.max_memory_per_rank
    chosen = cfg.train.strategy
    if budget and chosen in estimates and estimates[chosen] > budget:
        fits = [f"{n} ({mb(e)})" for n, e in sorted(estimates.items(), key=lambda x: x[1])
                if e <= budget]  # fmt: skip
        advice = (
            f"strategies that fit with {world_size} ranks: {', '.join(fits)}"
            if fits
            else f"no strategy fits with {world_size} ranks; add ranks or raise the budget"
        )
        raise ValueError(
            f"max_memory_per_rank: {chosen} needs about {mb(estimates[chosen])} per rank "
            f"with {world_size} ranks > budget {mb(budget)} (the whole model: parameters "
            f"{mb(params)}, gradients {mb(params)}, optimizer state {mb(params * copies)}); "
            f"{advice}"
        )
    return estimates
