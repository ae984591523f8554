from __future__ import annotations

import pytest

from scaletrain.metrics.timers import CommTimer, union_length


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([], 0.0),
        ([(0, 1)], 1.0),
        ([(0, 1), (2, 3)], 2.0),
        ([(0, 2), (1, 3)], 3.0),
        ([(1, 3), (0, 2), (2.5, 2.7)], 3.0),
        ([(0, 10), (1, 2)], 10.0),
    ],
)
def test_union_length(intervals, expected):
    assert union_length(intervals) == pytest.approx(expected)


def test_comm_timer_collects_and_resets():
    timer = CommTimer()
    timer.record(1.0, 2.0, 100)
    timer.record(1.5, 3.0, 50)
    stats = timer.collect()
    assert stats.busy_s == pytest.approx(2.0)
    assert stats.last_launch == 1.5
    assert stats.last_end == 3.0
    assert stats.bytes == 150
    assert stats.num_collectives == 2
    assert timer.collect().num_collectives == 0
