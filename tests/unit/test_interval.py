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


class _SaveRecorder:
    """The auto interval's bookkeeping (checkpointing.Checkpointing) with the save itself
    recorded instead of written, over a trainer that resumed at ``resumed_at``."""

    def __init__(self, resumed_at: int):
        from types import SimpleNamespace

        from scaletrain.checkpointing import Checkpointing

        cfg = with_overrides(RunConfig(), {"checkpoint_every": "auto", "mtbf_s": 3600.0})
        # Built before the resume, as the loop builds it (progress still 0).
        self.trainer = SimpleNamespace(cfg=cfg, progress=SimpleNamespace(step=0),
                                       ctx=SimpleNamespace(world_size=1))  # fmt: skip
        self.saved: list[int] = []
        checkpoints = Checkpointing(self.trainer)  # type: ignore[arg-type]

        def save(*, background=False, periodic=False):
            self.saved.append(self.trainer.progress.step)
            return 0.05

        checkpoints.save = save  # type: ignore[method-assign]
        self.checkpoints = checkpoints
        self.trainer.progress.step = resumed_at

    def train(self, steps: int) -> list[int]:
        for _ in range(steps):
            self.trainer.progress.step += 1
            self.checkpoints.maybe_save()
        return self.saved


@pytest.mark.parametrize("resumed_at", [0, 40])
def test_auto_measures_before_its_first_save_after_a_resume_too(resumed_at):
    """The first save comes AUTO_FIRST_STEPS steps into this process's training, whether it
    started at step 0 or resumed at 40; the next is planned from measured step times, never
    from none (which made it save at two steps in a row after a resume)."""
    from scaletrain.checkpointing import AUTO_FIRST_STEPS

    saved = _SaveRecorder(resumed_at).train(3 * AUTO_FIRST_STEPS)
    assert saved[0] == resumed_at + AUTO_FIRST_STEPS
    gaps = [b - a for a, b in zip(saved, saved[1:], strict=False)]
    assert all(gap > 1 for gap in gaps), saved


def test_no_step_time_yet_means_every_step_and_a_short_interval_is_still_finite():
    assert interval_steps(5.0, 0.0, 3600.0) == 1  # no step measured: save at every step
    assert interval_steps(0.0, 0.5, 3600.0) == 1  # free checkpoints: still at least one step
    assert predicted_overhead(0.1, 0.5, 100.0) == pytest.approx(0.1 / 0.5 + 0.5 / 200.0)
    assert predicted_overhead(0.1, 0.0, 100.0) == math.inf
