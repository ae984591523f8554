"""Start-up by phase, from each process's marks: pure."""

from __future__ import annotations

import pytest

from scaletrain.metrics.phases import PHASES, startup_summary


def marks(start: float, *lengths: float) -> dict[str, float]:
    out, t = {}, start
    for phase, length in zip(PHASES, (0.0, *lengths), strict=True):
        t += length
        out[phase] = t
    return out


def test_each_phase_is_the_median_over_processes():
    processes = [marks(101.0, 1.5, 0.2, 1.0, 0.1), marks(101.5, 1.7, 0.1, 1.2, 0.1),
                 marks(101.2, 1.6, 0.3, 1.1, 0.2)]  # fmt: skip
    s = startup_summary(processes, launched_at=100.0)
    assert s["launch_s"] == pytest.approx(1.2)
    assert s["imported_s"] == pytest.approx(1.6) and s["group_s"] == pytest.approx(0.2)
    assert s["model_s"] == pytest.approx(1.1) and s["first_step_s"] == pytest.approx(0.1)
    assert s["slowest_process_to_first_step_s"] == pytest.approx(1.6 + 0.3 + 1.1 + 0.2)


def test_processes_without_every_mark_are_left_out():
    assert startup_summary([{"process": 1.0}], launched_at=0.0) == {}
