"""The global-step plan and the resumable, elastic sampler, as pure code (no processes).

Every check runs the plan the way workers would: one sampler per rank, all stepping together,
committing each step after it is "applied", and, at random points, saving the state and
loading it into a new set of samplers with another world size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.data import partition
from scaletrain.data.sampler import GlobalBatchSampler


def samplers_for(n, world, batch, *, seed=0, drop_last=False, shard_sizes=None):
    return [
        GlobalBatchSampler(
            n,
            world_size=world,
            rank=r,
            batch_size=batch,
            seed=seed,
            drop_last=drop_last,
            shard_sizes=shard_sizes,
        )  # fmt: skip
        for r in range(world)
    ]


def run_steps(samplers, max_steps=None):
    """Step all ranks together; return the trained ids and each step's per-rank counts."""
    world = len(samplers)
    iters = [iter(s) for s in samplers]
    trained, step_counts = [], []
    for i, global_count in enumerate(samplers[0].global_counts()):
        if max_steps is not None and i >= max_steps:
            break
        counts = partition.split_counts(global_count, world)
        for rank, it in enumerate(iters):
            ids = next(it)
            assert len(ids) == max(counts[rank], 1)  # a rank without samples reads a stand-in
            trained += ids[: counts[rank]]  # ... which is weighted zero: not trained
        step_counts.append(counts)
        for s in samplers:
            s.commit(global_count)
    return trained, step_counts


@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(st.integers(1, 70), st.sampled_from([97, 101, 997, 2003, 4093])),
    world=st.integers(1, 64),
    batch=st.integers(1, 16),
    epoch=st.integers(0, 3),
)
def test_every_sample_exactly_once_and_balanced(n, world, batch, epoch):
    samplers = samplers_for(n, world, batch)
    for s in samplers:
        s.set_epoch(epoch)
    trained, step_counts = run_steps(samplers)
    assert sorted(trained) == list(range(n))
    for counts in step_counts:
        assert max(counts) - min(counts) <= 1


@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(st.integers(1, 300), st.sampled_from([997, 2003])),
    batch=st.integers(1, 8),
    plan=st.lists(st.tuples(st.integers(1, 64), st.integers(0, 12)), min_size=1, max_size=5),
    seed=st.integers(0, 3),
)
def test_resize_and_resume_mid_epoch_train_each_sample_once(n, batch, plan, seed):
    """World sizes N -> M -> K ..., each for a random number of steps, the state carried over
    by state_dict/load_state_dict; the last world finishes the epoch."""
    trained, state = [], None
    for i, (world, steps) in enumerate(plan):
        samplers = samplers_for(n, world, batch, seed=seed)
        for s in samplers:
            s.set_epoch(1)
            if state is not None:
                s.load_state_dict(state)
        last = i == len(plan) - 1
        ids, step_counts = run_steps(samplers, None if last else steps)
        trained += ids
        assert all(max(c) - min(c) <= 1 for c in step_counts)
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
        assert state["cursor"] == len(trained)  # nothing counts as consumed but what trained
    assert sorted(trained) == list(range(n))


def test_order_is_the_same_for_the_same_seed_and_any_world_size():
    # Global batch 12 as 1 x 12, 2 x 6, 3 x 4, 4 x 3: the same samples in each step.
    reference = None
    for world in (1, 2, 3, 4):
        samplers = samplers_for(115, world, 12 // world, seed=7)
        iters = [iter(s) for s in samplers]
        steps = []
        for count in samplers[0].global_counts():
            c = partition.split_counts(count, world)
            steps.append(sorted(i for r, it in enumerate(iters) for i in next(it)[: c[r]]))
        reference = reference or steps
        assert steps == reference
    assert len(reference[-1]) == 7


def test_drop_last_keeps_only_full_steps():
    assert [c for c in samplers_for(100, 4, 8, drop_last=True)[0].global_counts()] == [32] * 3
    with pytest.raises(ValueError, match="leaves no step"):
        samplers_for(10, 4, 8, drop_last=True)


def test_short_step_gives_extra_ranks_a_zero_weight_stand_in():
    s = samplers_for(10, 4, 2, seed=1)  # steps of 8 and 2: ranks 2 and 3 have nothing at the end
    order = s[0].order()
    last = [list(x)[-1] for x in s]
    assert last[0] == [int(order[8])] and last[1] == [int(order[9])]
    assert last[2] == last[3] == [int(order[8])]  # stand-ins, weighted zero by the trainer
    assert partition.split_counts(2, 4) == [1, 1, 0, 0]


def test_state_must_match_the_data():
    s = samplers_for(100, 2, 4)[0]
    state = s.state_dict()
    with pytest.raises(ValueError, match="num_samples=100, this run has 99"):
        samplers_for(99, 2, 4)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        samplers_for(100, 2, 4, seed=1)[0].load_state_dict(state)


def test_epoch_order_depends_on_seed_and_epoch_only():
    a = partition.epoch_order(1000, seed=3, epoch=2)
    assert np.array_equal(a, partition.epoch_order(1000, seed=3, epoch=2))
    assert not np.array_equal(a, partition.epoch_order(1000, seed=3, epoch=3))
    assert not np.array_equal(a, partition.epoch_order(1000, seed=4, epoch=2))


@settings(max_examples=50, deadline=None)
@given(
    shard=st.integers(1, 300),
    full=st.integers(0, 20),
    last=st.integers(1, 300),
    seed=st.integers(0, 9),
)
def test_shard_aware_order_is_a_permutation_that_reads_mostly_sequentially(shard, full, last, seed):
    # The writer's layout: equal shards and a last one of any smaller or equal size.
    sizes = [shard] * full + [min(last, shard)]
    n = sum(sizes)
    order = partition.epoch_order(n, seed, 0, shard_sizes=sizes)
    assert sorted(order.tolist()) == list(range(n))
    # Any window of one shard's size reads from at most 3 shards (2 when aligned).
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    for lo in range(0, n, shard):
        assert len(set(shard_of[order[lo : lo + shard]].tolist())) <= 3


def test_split_counts_and_slices():
    assert partition.split_counts(7, 3) == [3, 2, 2]
    assert partition.rank_slice(10, 17, 3, 1) == (13, 15)
    assert partition.rank_slice(0, 2, 4, 3) == (2, 2)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 500),
    batch=st.integers(1, 64),
    drop_last=st.booleans(),
    consumed=st.integers(0, 500),
)
def test_step_count_and_next_bounds_agree_with_the_plan(n, batch, drop_last, consumed):
    """The loop asks for the remaining steps every step without building the epoch's list;
    the count and the next step must be the list's."""
    cursor = min(consumed, n)
    bounds = partition.step_bounds(n, batch, drop_last, cursor)
    assert partition.step_count(n, batch, drop_last, cursor) == len(bounds)
    if not partition.step_count(n, batch, drop_last):
        return
    sampler = GlobalBatchSampler(n, world_size=1, rank=0, batch_size=batch, seed=0,
                                 drop_last=drop_last)  # fmt: skip
    sampler.cursor = cursor
    assert len(sampler) == len(bounds)
    assert sampler.next_bounds() == (bounds[0] if bounds else None)


def test_balanced_shares_carry_over_only_to_a_world_of_their_size():
    """--balance speed's shares fit the world that measured them: a state carried to a
    world of another size plans the rest of the epoch with equal shares, every sample once;
    a world of the same size keeps them."""
    two = samplers_for(100, 2, 5, seed=1)
    trained, _ = run_steps(two, 3)
    for s in two:
        s.shares = [3.0, 1.0]
    state = two[0].state_dict()
    three = samplers_for(100, 3, 5, seed=1)
    for s in three:
        s.load_state_dict(state)
    assert all(s.shares is None for s in three)
    rest, _ = run_steps(three)
    assert sorted(trained + rest) == list(range(100))
    again = samplers_for(100, 2, 5, seed=1)[0]
    again.load_state_dict(state)
    assert again.shares == [3.0, 1.0]


def test_shares_split_in_proportion_with_largest_remainders_to_the_lowest_rank():
    """--balance speed's split: whole parts first, the samples left over by largest
    remainder, ties to the lower rank; a share of zero gets nothing."""
    assert partition.split_counts(10, 3, [1.0, 1.0, 2.0]) == [3, 2, 5]  # 2.5, 2.5, 5: tie
    assert partition.split_counts(10, 3, [0.1, 0.5, 0.4]) == [1, 5, 4]
    assert partition.split_counts(7, 3, [0.3, 0.45, 0.25]) == [2, 3, 2]  # .1 .15 .75 left
    assert partition.split_counts(9, 3, [0.0, 2.0, 1.0]) == [0, 6, 3]
    assert partition.rank_slice(100, 110, 3, 2, [1.0, 1.0, 2.0]) == (105, 110)
    order = np.arange(200, 210)
    assert partition.rank_indices(order, 0, 10, 3, 2, [1.0, 1.0, 2.0]) == [205, 206, 207, 208, 209]


@pytest.mark.parametrize("shares", [[1.0, 1.0], [1.0, -0.5, 1.0], [0.0, 0.0, 0.0]])
def test_shares_that_do_not_fit_the_world_are_refused(shares):
    with pytest.raises(ValueError, match=r"do not fit a world of 3"):
        partition.split_counts(9, 3, shares)


def test_out_of_range_cursors_and_mismatched_shards_are_refused_naming_them():
    for fn in (partition.step_bounds, partition.step_count):
        with pytest.raises(ValueError, match="cursor 11 is outside an epoch of 10 samples"):
            fn(10, 4, False, cursor=11)
    with pytest.raises(ValueError, match="shard sizes add up to 9, not 10 samples"):
        partition.epoch_order(10, 0, 0, shard_sizes=[4, 5])


def test_shard_aware_windows_default_to_the_largest_shard_and_cover_every_position():
    """Each window of ``window`` positions holds the samples of those positions before the
    shuffle (shards in random order, then shuffled inside each window only)."""
    sizes = [6, 6, 6, 6, 6]
    for seed in range(5):
        plain = partition.epoch_order(30, seed, 1, shard_sizes=sizes, window=1)
        default = partition.epoch_order(30, seed, 1, shard_sizes=sizes)
        # window=1 shuffles nothing: whole shards in a row; the default window is one shard
        assert all(plain[i + 1] == plain[i] + 1 for i in range(0, 30, 6) for i in range(i, i + 5))
        for lo in range(0, 30, 6):
            assert sorted(default[lo : lo + 6]) == sorted(plain[lo : lo + 6])
        assert not np.array_equal(default, plain) or seed  # seed 0 shuffles some window
    order = partition.epoch_order(30, 3, 0, shard_sizes=sizes, window=4)
    assert sorted(order[:4]) != list(order[:4]) or sorted(order[4:8]) != list(order[4:8])
