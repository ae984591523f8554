"""The parameter server's pure rules: partition, the ssp bound, staleness, and the data plan
(leases dealt, committed and requeued: every sample exactly once per epoch)."""

from __future__ import annotations

from collections import Counter

import pytest

from scaletrain.config import RunConfig, from_dict
from scaletrain.data.partition import epoch_order, rank_indices, step_bounds
from scaletrain.strategies.param_server.consistency import (
    join_clock,
    may_proceed,
    shard_ranges,
    split_tensors,
    staleness,
    staleness_histogram,
    total_updates,
)
from scaletrain.strategies.param_server.coordinator import DataCoordinator


def test_partition_is_balanced_by_bytes_and_splits_a_large_tensor():
    sizes = [1000, 10, 10, 3]  # one tensor much larger than a server's share
    ranges = shard_ranges(sum(sizes), 3)
    assert ranges == [(0, 341), (341, 682), (682, 1023)]
    assert split_tensors(sizes, ranges) == [[0], [0], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="cannot split 2 parameters over 3 servers"):
        shard_ranges(2, 3)


def test_every_server_count_from_one_to_the_parameters_is_a_partition():
    assert shard_ranges(5, 1) == [(0, 5)]
    assert shard_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="cannot split 3 parameters over 0 servers"):
        shard_ranges(3, 0)


def test_a_tensor_belongs_to_each_server_whose_slice_it_overlaps_and_to_no_other():
    """Tensors ending exactly where a slice begins, or beginning where it ends, are not in it."""
    assert split_tensors([2, 2, 2], [(0, 2), (2, 4), (4, 6)]) == [[0], [1], [2]]
    assert split_tensors([3, 1, 2], [(0, 3), (3, 6)]) == [[0], [1, 2]]
    assert split_tensors([1, 4, 1], [(0, 3), (3, 6)]) == [[0, 1], [1, 2]]


@pytest.mark.parametrize(
    ("consistency", "samples", "drop_last", "max_steps", "expected"),
    [
        ("bsp", 100, False, 0, 2 * 9),  # global steps of 4 x 3 = 12: 8 and a short one
        ("bsp", 100, True, 0, 2 * 8),
        ("bsp", 100, False, 5, 5),  # --max-steps counts global steps
        ("asp", 99, False, 0, 2 * 25),  # single pushes of 4: 24 and a short one
        ("ssp", 99, True, 0, 2 * 24),
        ("asp", 99, False, 5, 15),  # a global step's worth of pushes from each of 3 workers
    ],
)
def test_the_servers_count_the_updates_of_the_run(
    consistency, samples, drop_last, max_steps, expected
):
    cfg = from_dict({
        "train": {"strategy": "ps", "batch_size": 4, "epochs": 2, "drop_last": drop_last,
                  "max_steps": max_steps},
        "ps": {"consistency": consistency} | ({"staleness": 2} if consistency == "ssp" else {}),
    })  # fmt: skip
    assert total_updates(cfg, samples, 3) == expected


def test_bounded_staleness_rule():
    assert may_proceed(5, [5, 3], staleness=2)
    assert not may_proceed(6, [6, 3], staleness=2)
    assert not may_proceed(1, [1, 0], staleness=0)  # ssp(0) waits for everyone every step
    assert may_proceed(100, [100, 0], staleness=None)  # asp never waits
    assert may_proceed(7, [], staleness=0)  # alone
    assert staleness(10, 7) == 3 and staleness(3, 7) == 0
    assert staleness_histogram([2, 0, 2, 1]) == {"0": 1, "1": 1, "2": 2}


def test_a_joiner_keeps_its_clock_and_a_new_worker_starts_level_with_the_slowest():
    assert join_clock(9, [4, 12]) == 9  # rejoining a restarted server: as far ahead as it was
    assert join_clock(-1, [4, 12]) == 4  # a new (or restarted) worker: level with the slowest
    assert join_clock(-1, []) == 0
    assert join_clock(0, [4, 12]) == 0  # a clock of 0 is a clock: kept
    # Two servers that hold the workers by the same clocks never hold two workers each for
    # the other: A held by C on one and C held by A on the other needs A - C > S and
    # C - A > S at once.
    clocks = {"A": join_clock(7, []), "C": join_clock(4, [7])}
    held = {w for w, c in clocks.items() if not may_proceed(c + 1, clocks.values(), 2)}
    assert held == {"A"}


def coordinator(lockstep: bool, **kw) -> DataCoordinator:
    args = dict(batch_size=4, epochs=2, seed=3, drop_last=False, num_workers=3)
    return DataCoordinator(26, lockstep=lockstep, **(args | kw))


def drain(c: DataCoordinator, die: dict[int, int] | None = None) -> Counter:
    """Deal round-robin to 3 asp workers until the run is over; worker w dies (its lease is
    requeued) at its die[w]-th lease. Returns (epoch, index) -> times trained."""
    trained: Counter = Counter()
    count = Counter()
    while not c.finished():
        for w in range(3):
            lease = c.deal(w)
            if lease is None:
                continue
            count[w] += 1
            if die and die.get(w) == count[w]:
                assert c.requeue(w) == len(lease.indices)
                continue
            trained.update((lease.epoch, i) for i in lease.indices)
            c.commit(w)
    return trained


def test_asp_leases_cover_every_sample_exactly_once_per_epoch_across_a_death():
    for die in (None, {1: 2}, {0: 1, 2: 5}):
        trained = drain(coordinator(False), die)
        assert trained == Counter({(e, i): 1 for e in range(2) for i in range(26)}), die


def test_the_next_epoch_starts_while_leases_of_the_last_are_out_and_requeues_come_first():
    c = coordinator(False, epochs=2)
    held = [c.deal(w) for w in range(3)]  # 12 of 26
    while (lease := c.deal(3)) is not None and lease.epoch == 0:
        c.commit(3)
    assert lease.epoch == 1  # epoch 0 is dealt out, three leases of it still out
    c.commit(3)
    c.requeue(1)
    again = c.deal(1)
    assert again.epoch == 0 and again.positions == held[1].positions
    assert c.epoch == 0 and not c.finished()


def test_bsp_steps_are_the_data_parallel_steps():
    c = coordinator(True, epochs=1)
    order = epoch_order(26, 3, 0)
    for start, end in step_bounds(26, 12, drop_last=False):
        leases = c.deal_step([2, 0, 1])
        for w in range(3):
            assert (
                list(leases[w].indices)
                == rank_indices(order, start, end, 3, w)[: len(leases[w].indices)]
            )
            c.commit(w)
    assert c.deal_step([0, 1, 2]) is None and c.finished() and c.samples_trained == 26


def test_bsp_with_a_dropped_worker_redeals_its_share_over_the_rest():
    c = coordinator(True, epochs=1)
    first = c.deal_step([0, 1, 2])
    c.commit(0), c.commit(2), c.requeue(1)
    second = c.deal_step([0, 2])
    assert second[0].positions[:4] == first[1].positions  # the requeued share comes first
    trained = Counter(first[0].indices + first[2].indices + second[0].indices + second[2].indices)
    c.commit(0), c.commit(2)
    while (leases := c.deal_step([0, 2])) is not None:
        for w, lease in leases.items():
            trained.update(lease.indices)
            c.commit(w)
    assert trained == Counter(range(26))


def test_max_steps_caps_the_samples_at_that_many_data_parallel_steps():
    bsp = coordinator(True, max_steps=2, epochs=5)
    while (leases := bsp.deal_step([0, 1, 2])) is not None:
        for w in leases:
            bsp.commit(w)
    assert bsp.steps_dealt == 2
    asp = coordinator(False, max_steps=2, epochs=5)
    assert sum(drain(asp).values()) == 2 * 3 * 4  # 2 steps x 3 workers x 4 samples
    # A dead worker's lease goes back to the budget: its samples are still trained.
    trained = drain(coordinator(False, max_steps=2, epochs=5), die={1: 1})
    assert sum(trained.values()) == 24 and set(trained.values()) == {1}


def test_checkpoint_requeues_the_leases_that_were_out():
    c = coordinator(False)
    a, b = c.deal(0), c.deal(1)
    c.commit(0)
    state = c.state_dict()
    restored = coordinator(False)
    restored.load_state_dict(state)
    assert restored.samples_trained == len(a.indices)
    assert restored.deal(2).positions == b.positions
    restored.commit(2)
    remaining = drain(restored)
    assert sum(remaining.values()) == 2 * 26 - len(a.indices) - len(b.indices)


@pytest.mark.parametrize(
    "ps, message",
    [
        ({"num_servers": 0}, "num_servers: must be >= 1"),
        ({"staleness": -2}, "staleness: must be >= 0"),
        ({"consistency": "ssp"}, "--consistency ssp needs --staleness"),
        ({"consistency": "asp", "staleness": 2}, "applies to --consistency ssp only"),
        ({"consistency": "eventual"}, "consistency: must be one of bsp, asp, ssp"),
    ],
)
def test_bad_parameter_server_settings_name_the_field(ps, message):
    with pytest.raises(ValueError, match=message):
        from_dict({"train": {"strategy": "ps"}, "ps": ps})


def test_a_world_with_no_worker_is_refused():
    from scaletrain.strategies.param_server.worker import PSWorkerStrategy

    cfg = RunConfig()
    cfg.ps.num_servers = 2
    with pytest.raises(ValueError, match="2 servers leave no worker in a world of 2"):
        PSWorkerStrategy.check_config(cfg, 2, None)
    PSWorkerStrategy.check_config(cfg, 3, None)


def test_bsp_max_steps_counts_steps_across_an_epoch_boundary():
    """26 samples, 12 a step: 3 steps an epoch (the last of 2); max_steps 5 ends in epoch 2
    with 5 full data-parallel steps, as ddp's would."""
    c = coordinator(True, max_steps=5, epochs=3)
    sizes = []
    while (leases := c.deal_step([0, 1, 2])) is not None:
        sizes.append(sum(len(lease.indices) for lease in leases.values()))
        for w in leases:
            c.commit(w)
    assert sizes == [12, 12, 2, 12, 12]


def test_a_cut_holds_each_workers_newest_push_and_a_server_has_it_once_applied():
    """cuts.py: the pushes a cut holds are, of each worker, the newest any server applied
    (of its newest process); a server has reached them when it applied each, or when that
    worker's process is gone or another."""
    from scaletrain.strategies.param_server import cuts

    # Server 0 applied worker 1's push 7, server 1 not yet (in flight); worker 2 restarted
    # (process 1) and server 1 saw its new process's join at clock 3.
    held = cuts.newest([{0: (0, 5), 1: (0, 7), 2: (0, 9)}, {0: (0, 5), 1: (0, 6), 2: (1, 3)}])
    assert held == {0: (0, 5), 1: (0, 7), 2: (1, 3)}
    assert cuts.decode(cuts.encode(held).encode()) == held
    sessions = {0: 0, 1: 0, 2: 1}
    assert not cuts.reached(held, {0, 1, 2}, sessions, {0: 5, 1: 6, 2: 3})  # push 7 owed
    assert cuts.reached(held, {0, 1, 2}, sessions, {0: 5, 1: 7, 2: 3})
    assert cuts.reached(held, {0, 2}, sessions, {0: 5, 2: 3})  # worker 1 died meanwhile
    assert cuts.reached(held, {0, 1, 2}, {0: 0, 1: 1, 2: 1}, {0: 5, 1: 0, 2: 3})  # restarted


def test_copies_of_a_cut_that_differ_are_not_continued_from(tmp_path, caplog):
    """Two servers' checkpoints named for the same cut are one moment only if they hold the
    same pushes: cut 2's copies differ in worker 1's last push (a copy taken before that
    push arrived), so the job continues from cut 1, and the warning names them. A worker
    that had left one server before its copy (worker 2 at cut 1) is no disagreement."""
    import logging

    from scaletrain.fault.checkpoint import save_checkpoint
    from scaletrain.strategies.param_server.cuts import consistent_checkpoint

    copies = {  # server -> [(version, cut, clocks)]
        0: [(8, [0, 1], {0: 4, 1: 4, 2: 3}), (16, [0, 2], {0: 8, 1: 9})],
        1: [(8, [0, 1], {0: 4, 1: 4}), (17, [0, 2], {0: 8, 1: 8})],
    }
    for k, saved in copies.items():
        for version, cut, clocks in saved:
            state = {"version": version, "released_step": 0, "cut": cut, "clocks": clocks}
            save_checkpoint(tmp_path / "checkpoints" / f"server{k}", version, state, keep=5)
    with caplog.at_level(logging.WARNING, logger="scaletrain.ps.cuts"):
        assert consistent_checkpoint(tmp_path, 2, "asp") == [8, 8]
    assert [r.getMessage() for r in caplog.records] == [
        "the copies of cut [0, 2] differ (worker 1's last push applied: 9 on server 0, 8 on "
        "server 1): not continued from"
    ]
    # bsp names its moments by the global step: clocks are not what makes them one.
    assert consistent_checkpoint(tmp_path, 2, "bsp") == [16, 17]


def test_a_cut_is_continued_from_past_damaged_copies_and_checkpoints_of_no_cut(tmp_path):
    """Per server, each checkpoint the index lists is read whole (a damaged one is passed
    over, not the end of the search); one that names no cut (a server's own periodic save)
    is no moment; a cut taken at the server's first update counts like any other."""
    from scaletrain.fault.checkpoint import save_checkpoint
    from scaletrain.strategies.param_server.cuts import consistent_checkpoint

    def save(k, version, cut, step=0):
        state = {"version": version, "released_step": step, "cut": cut, "clocks": {0: version}}
        save_checkpoint(tmp_path / "checkpoints" / f"server{k}", version, state, keep=9)

    for k in (0, 1):
        save(k, 1, [0, 1])
        save(k, 2, None)
    assert consistent_checkpoint(tmp_path, 2, "asp") == [1, 1]
    save(0, 5, [0, 2])
    (tmp_path / "checkpoints" / "server0" / "step-00000001.pt").write_bytes(b"damaged")
    save(0, 6, [0, 3])
    save(1, 6, [0, 3])
    assert consistent_checkpoint(tmp_path, 2, "asp") == [6, 6]
    assert consistent_checkpoint(tmp_path, 0, "asp") is None


def test_bsp_moments_are_global_steps_whatever_the_cut_field_says(tmp_path):
    from scaletrain.fault.checkpoint import save_checkpoint
    from scaletrain.strategies.param_server.cuts import consistent_checkpoint

    for k, versions in enumerate([(3, 6), (4, 7)]):
        for step, version in enumerate(versions, start=1):
            state = {"version": version, "released_step": step, "cut": None, "clocks": {}}
            save_checkpoint(tmp_path / "checkpoints" / f"server{k}", version, state, keep=9)
    assert consistent_checkpoint(tmp_path, 2, "bsp") == [6, 7]
    assert consistent_checkpoint(tmp_path, 2, "asp") is None  # no cut on any server


def test_a_server_that_has_not_seen_a_live_workers_push_has_not_reached_the_cut():
    from scaletrain.strategies.param_server import cuts

    assert not cuts.reached({3: (0, 1)}, {3}, {3: 0}, {})
    assert cuts.reached({3: (0, 1)}, {3}, {3: 0}, {3: 1})


def test_each_staleness_rule_scales_a_push_as_documented():
    """inverse: --lr / (1 + staleness); share: --lr / workers; none: --lr; any other name is
    refused naming the field."""
    from scaletrain.strategies.param_server.consistency import staleness_lr_factor

    assert [staleness_lr_factor("inverse", s, 4) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert staleness_lr_factor("share", 7, 4) == 0.25
    assert staleness_lr_factor("none", 7, 4) == 1.0
    with pytest.raises(ValueError, match="staleness_rule"):
        staleness_lr_factor("sqrt", 1, 4)


def test_every_store_key_of_the_parameter_server_is_spelled_in_keys_only():
    """Both sides of each store conversation import its keys from one module: a key spelled
    out anywhere else can drift from its reader's spelling."""
    from pathlib import Path

    import scaletrain

    root = Path(scaletrain.__file__).parent
    spelled = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "keys.py"
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if '"ps/' in line
    ]
    assert not spelled, f"store keys spelled outside param_server/keys.py: {spelled}"
