"""--balance speed's pure parts: a split by shares covers each step once and follows the
shares; the re-plan follows the measured rates, waits out noise, and never starves a rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scaletrain.data.balance import MIN_SHARE, RateMeter, next_shares
from scaletrain.data.partition import rank_slice, split_counts


@given(count=st.integers(0, 500),
       shares=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=12))  # fmt: skip
def test_a_split_by_shares_covers_the_step_in_proportion(count, shares):
    counts = split_counts(count, len(shares), shares)
    assert sum(counts) == count and min(counts) >= 0
    total = sum(shares)
    for c, w in zip(counts, shares, strict=True):  # within one sample of the exact share
        assert abs(c - count * w / total) < 1.0 + 1e-9
    # Contiguous, in rank order: [start, end) split without gap or overlap.
    slices = [rank_slice(10, 10 + count, len(shares), r, shares) for r in range(len(shares))]
    assert slices[0][0] == 10 and slices[-1][1] == 10 + count
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))


def test_even_shares_split_as_without_them():
    for count in range(0, 40):
        assert split_counts(count, 3, [1.0, 1.0, 1.0]) == split_counts(count, 3)
    with pytest.raises(ValueError, match="do not fit a world of 3"):
        split_counts(10, 3, [1.0, 1.0])


def test_shares_follow_the_rates_and_wait_out_noise():
    # One worker 3x slower: shares 3:1:3.
    shares, smoothed = next_shares(None, [300.0, 100.0, 300.0], None)
    assert shares == pytest.approx([3 / 7, 1 / 7, 3 / 7])
    # Rates within a few percent of what the shares expect: no re-plan.
    again, smoothed = next_shares(shares, [310.0, 98.0, 295.0], smoothed)
    assert again is None
    # Even rates from the start: nothing to change.
    assert next_shares(None, [100.0, 102.0], None)[0] is None
    # A rank that measured nothing (its warm-up step) keeps the plan and the smoothed rates.
    assert next_shares(shares, [300.0, 0.0, 300.0], smoothed) == (None, smoothed)
    assert next_shares(None, [0.0, 0.0], None) == (None, [])


def test_no_rank_is_starved():
    shares, _ = next_shares(None, [1000.0, 10.0, 1.0], None)
    assert shares is not None and min(shares) == pytest.approx(MIN_SHARE / 3)
    assert sum(shares) == pytest.approx(1.0) and shares[0] > shares[1] >= shares[2]


def test_the_meter_measures_samples_per_busy_second():
    meter = RateMeter()
    meter.add(30, 0.5)
    meter.add(10, 0.5)
    assert meter.take() == 40.0 and meter.take() == 0.0


def test_the_meter_can_leave_the_warm_up_step_out():
    meter = RateMeter(skip_first=True)
    meter.add(2, 10.0)  # the first step: warm-up, not metered
    meter.add(30, 0.5)
    meter.add(10, 0.5)
    assert meter.take() == 40.0
    meter.add(20, 0.5)  # only the process's first step is left out, not each window's
    assert meter.take() == 40.0
