from __future__ import annotations

import pytest

from scaletrain.metrics.timers import CommTimer, overlap_ratio, sent_bytes, union_length


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


def test_comm_timer_counts_dense_bytes_and_blocked_time():
    timer = CommTimer()
    timer.record(0.0, 1.0, 10, dense_bytes=40)
    timer.record(0.5, 1.5, 20)  # uncompressed: dense == sent
    timer.blocked(0.25)
    stats = timer.collect()
    assert (stats.bytes, stats.dense_bytes, stats.blocked_s) == (30, 60, 0.25)
    assert timer.collect().bytes == 0


@pytest.mark.parametrize(
    ("collective", "world", "expected"),
    [
        ("all_reduce", 1, 0),
        ("all_reduce", 2, 1000),  # ring: 2 (W-1)/W of the payload
        ("all_reduce", 4, 1500),
        ("all_gather", 2, 1000),  # (W-1) payloads
        ("all_gather", 4, 3000),
    ],
)
def test_sent_bytes(collective, world, expected):
    assert sent_bytes(collective, 1000, world) == expected


def test_sent_bytes_rejects_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        sent_bytes("scatter", 1, 2)


@pytest.mark.parametrize(
    ("compute", "comm", "step", "expected"),
    [
        (1.0, 0.0, 1.0, 0.0),  # nothing to hide
        (1.0, 0.5, 1.5, 0.0),  # fully serial
        (1.0, 0.5, 1.0, 1.0),  # fully hidden
        (1.0, 0.5, 1.25, 0.5),
        (0.2, 1.0, 1.0, 1.0),  # compute entirely under communication
        (1.0, 0.5, 2.0, 0.0),  # slower than serial (noise): clipped
    ],
)
def test_overlap_ratio(compute, comm, step, expected):
    assert overlap_ratio(compute, comm, step) == pytest.approx(expected)
