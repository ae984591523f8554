"""The global-step plan, tested as pure functions (no processes), at sizes up to 22 x 8 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.data import partition
from scaletrain.data.sampler import GlobalBatchSampler


def plan(n, world, batch, drop_last=False, epoch=0, seed=0):
    samplers = [
        GlobalBatchSampler(
            n, world_size=world, rank=r, batch_size=batch, seed=seed, drop_last=drop_last
        )
        for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 3000),
    world=st.integers(1, 176),
    batch=st.integers(1, 64),
    epoch=st.integers(0, 5),
)
def test_every_sample_exactly_once_and_balanced(n, world, batch, epoch):
    if n < world:
        with pytest.raises(ValueError, match="fewer than"):
            partition.step_bounds(n, batch * world, world, False)
        return
    samplers, per_rank = plan(n, world, batch, epoch=epoch)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n))
    counts = samplers[0].global_counts()
    for step, global_count in enumerate(counts):
        sizes = [len(per_rank[r][step]) for r in range(world)]
        assert sum(sizes) == global_count
        assert max(sizes) - min(sizes) <= 1
        assert min(sizes) >= 1  # no rank ever runs a step with an empty batch


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 2000), world=st.integers(1, 16), batch=st.integers(1, 32))
def test_drop_last_keeps_only_full_steps(n, world, batch):
    g = world * batch
    if n < g:
        with pytest.raises(ValueError):
            partition.step_bounds(n, g, world, True)
        return
    samplers, per_rank = plan(n, world, batch, drop_last=True)
    assert samplers[0].global_counts() == [g] * (n // g)


def test_step_contents_do_not_depend_on_world_size():
    # Same global batch of 12: 1 x 12, 2 x 6, 3 x 4, 4 x 3 see the same samples in each step,
    # including the last one, where ranks hold different counts.
    n = 115
    reference = None
    for world in (1, 2, 3, 4):
        _, per_rank = plan(n, world, 12 // world, epoch=1, seed=7)
        steps = [
            sorted(i for r in range(world) for i in per_rank[r][s]) for s in range(len(per_rank[0]))
        ]
        if reference is None:
            reference = steps
        assert steps == reference
    assert len(reference[-1]) == 7


def test_short_tail_merges_into_previous_step():
    # 26 samples, 4 ranks x 3 = 12 per step: the 2 left over (< 4 ranks) join step 2.
    assert partition.step_bounds(26, 12, 4, False) == [(0, 12), (12, 26)]
    assert partition.step_bounds(28, 12, 4, False) == [(0, 12), (12, 24), (24, 28)]


def test_permutation_depends_on_seed_and_epoch_only():
    a = partition.epoch_permutation(1000, seed=3, epoch=2)
    assert np.array_equal(a, partition.epoch_permutation(1000, seed=3, epoch=2))
    assert not np.array_equal(a, partition.epoch_permutation(1000, seed=3, epoch=3))
    assert not np.array_equal(a, partition.epoch_permutation(1000, seed=4, epoch=2))


def test_split_counts():
    assert partition.split_counts(7, 3) == [3, 2, 2]
    assert partition.rank_slice(10, 17, 3, 1) == (13, 15)
