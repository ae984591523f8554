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


def test_one_descheduled_step_does_not_speak_for_the_window():
    meter = RateMeter()
    for busy_s in (0.5, 5.0, 0.5):  # the host took the CPU away for one step
        meter.add(30, busy_s)
    assert meter.take() == 60.0
    meter.add(0, 0.2)  # a stand-in step (no samples): no rate
    assert meter.take() == 0.0


def test_where_a_step_is_fixed_cost_a_lowered_share_is_not_walked_further():
    # Busy 10 ms a step whatever the samples: a rank's rate follows its share. Rank 0's
    # share was lowered by a noisy window; its busy time is the others', so nobody waits and
    # the split stays (a rate-proportional re-plan would lower it again, window by window).
    shares = [0.25, 0.375, 0.375]
    rates = [s * 48 / 0.010 for s in shares]
    assert next_shares(shares, rates, None)[0] is None
    # A rank at the floor that is slow stays there; the others are not re-planned among
    # themselves for its sake.
    floor = MIN_SHARE / 3
    shares = [(1 - floor) / 2, floor, (1 - floor) / 2]
    rates = [shares[0] * 48 / 0.010, floor * 48 / 0.030, shares[2] * 48 / 0.011]
    assert next_shares(shares, rates, None)[0] is None


def test_a_rank_that_got_fast_again_gets_its_samples_back():
    floor = MIN_SHARE / 3
    shares = [(1 - floor) / 2, floor, (1 - floor) / 2]
    # Samples cost time again and rank 1 is as fast as the others: it is the least busy.
    again, _ = next_shares(shares, [300.0, 300.0, 300.0], None)
    assert again == pytest.approx([1 / 3, 1 / 3, 1 / 3])
