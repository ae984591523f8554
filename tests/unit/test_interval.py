"""--checkpoint-every auto's arithmetic (Young/Daly), and its config."""

from __future__ import annotations

import math

import pytest

from scaletrain.config import RunConfig, with_overrides
from scaletrain.fault.interval import interval_steps, optimal_interval_s, predicted_overhead


def test_the_optimum_balances_checkpoint_cost_against_rework():
    cost, mtbf = 0.5, 100.0
    tau = optimal_interval_s(cost, mtbf)
    assert tau == pytest.approx(10.0)  # sqrt(2 x 0.5 x 100)
    best = predicted_overhead(cost, tau, mtbf)
    assert best == pytest.approx(0.05 + 0.05)
    # Any other interval loses more (the first-order model's minimum).
    for other in (1.0, 5.0, 20.0, 50.0):
        assert predicted_overhead(cost, other, mtbf) > best
    assert interval_steps(cost, 0.25, mtbf) == 40
    assert interval_steps(0.0, 0.25, mtbf) == 1  # free checkpoints: every step
    assert predicted_overhead(cost, 0.0, mtbf) == math.inf


def test_checkpoint_every_takes_a_number_or_auto_with_an_mtbf():
    cfg = with_overrides(RunConfig(), {"checkpoint_every": 20})
    assert cfg.fault.checkpoint_interval == 20 and not cfg.fault.checkpoint_auto
    auto = with_overrides(RunConfig(), {"checkpoint_every": "auto", "mtbf_s": 3600.0})
    assert auto.fault.checkpoint_auto and auto.fault.checkpoints_on
    with pytest.raises(ValueError, match="--checkpoint-every auto needs --mtbf-s"):
        with_overrides(RunConfig(), {"checkpoint_every": "auto"})
    with pytest.raises(ValueError, match="checkpoint_every: must be a number of steps"):
        with_overrides(RunConfig(), {"checkpoint_every": "often"})
