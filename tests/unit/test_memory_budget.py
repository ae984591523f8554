from __future__ import annotations

import pytest
from torch import nn

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch.memory import check_memory_budget
from scaletrain.strategies.fsdp import unit_bytes


def model() -> nn.Module:
    # 4 MB + 4 KB + 0.4 MB of fp32 parameters; the largest unit is the first Linear.
    return nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 100))


def cfg(**overrides) -> RunConfig:
    return with_overrides(RunConfig(), overrides)


def test_unit_bytes():
    total, largest = unit_bytes(model())
    assert total == 4 * (1000 * 1000 + 1000 + 1000 * 100 + 100)
    assert largest == 4 * (1000 * 1000 + 1000)


def test_estimates_per_strategy():
    p, largest = unit_bytes(model())
    est = check_memory_budget(cfg(optimizer="adam"), model(), world_size=4)
    assert est["ddp"] == est["local_sgd"] == 4 * p  # params, grads, two Adam buffers
    assert est["diloco"] == 6 * p  # plus global params and outer momentum
    assert est["fsdp"] == 4 * p // 4 + 2 * largest
    assert check_memory_budget(cfg(momentum=0.0), model(), 4)["ddp"] == 2 * p


def test_over_budget_names_the_estimate_and_what_fits():
    budget = 10_000_000  # ddp with Adam needs ~17.6 MB; fsdp over 4 ranks ~12.4 MB
    with pytest.raises(ValueError) as error:
        check_memory_budget(cfg(optimizer="adam", max_memory_per_rank=budget), model(), 4)
    message = str(error.value)
    assert message.startswith("max_memory_per_rank: ddp needs about 17.6 MB per rank with 4 ranks")
    assert "no strategy fits with 4 ranks" in message
    with pytest.raises(ValueError, match=r"strategies that fit with 4 ranks: fsdp \(12.4 MB\)"):
        check_memory_budget(cfg(optimizer="adam", max_memory_per_rank=15_000_000), model(), 4)
    fits = cfg(strategy="fsdp", optimizer="adam", max_memory_per_rank=15_000_000)
    assert check_memory_budget(fits, model(), 4)["fsdp"] <= 15_000_000
