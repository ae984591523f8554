"""The restart mode's batch plan (data/plans.py) in one process: ranks that step together
are dealt every sample exactly once per epoch, load what they were dealt, and a plan
restored from a mid-epoch state goes on where the saved one stopped."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from scaletrain.config import from_dict
from scaletrain.data.plans import BatchPlan, SamplerPlan, StepPlan, load_indices

DEVICE = torch.device("cpu")


def dataset(n: int) -> TensorDataset:
    """Sample i is (i, 10 i): what was loaded says which sample it was."""
    ids = torch.arange(n, dtype=torch.float32)
    return TensorDataset(ids.unsqueeze(1), 10 * ids)


def config(*, batch=3, epochs=2, max_steps=0, drop_last=False, seed=7):
    return from_dict({"train": {"batch_size": batch, "epochs": epochs, "max_steps": max_steps,
                                "drop_last": drop_last, "seed": seed}})  # fmt: skip


def plans(n, world, **kw):
    cfg = config(**kw)
    return [SamplerPlan(dataset(n), cfg, data_rank=r, data_world_size=world, device=DEVICE)
            for r in range(world)]  # fmt: skip


def run(ranks, progress=0, stop_after=None):
    """Step every rank together, loading and committing; the steps each rank was dealt."""
    dealt = []
    while stop_after is None or len(dealt) < stop_after:
        state = SimpleNamespace(step=progress)
        steps = [p.next_step(state) for p in ranks]
        if steps[0] is None:
            assert all(s is None for s in steps)
            break
        for p, s in zip(ranks, steps, strict=True):
            inputs, targets = p.load(s)
            if s.num_samples:  # what was loaded is what was dealt
                assert inputs[:, 0].long().tolist() == s.indices
                assert torch.equal(targets, 10 * inputs[:, 0])
            p.commit(s)
        dealt.append(steps)
        progress += 1
    return dealt


@pytest.mark.parametrize(("n", "world", "batch"), [(25, 3, 3), (24, 2, 4), (7, 3, 2)])
def test_every_sample_once_per_epoch_weighted_by_what_each_rank_holds(n, world, batch):
    ranks = plans(n, world, batch=batch)
    per_step = batch * world
    expected_steps = -(-n // per_step)
    assert ranks[0].steps_per_epoch() == expected_steps
    assert ranks[0].total_steps(SimpleNamespace(step=0)) == 2 * expected_steps
    dealt = run(ranks)
    assert len(dealt) == 2 * expected_steps
    for epoch in (0, 1):
        steps = [d for d in dealt if d[0].epoch == epoch]
        trained = Counter(i for step in steps for s in step for i in s.indices[: s.num_samples])
        assert trained == Counter(range(n))
        for number, step in enumerate(steps, start=1 + epoch * expected_steps):
            assert {s.step for s in step} == {number}
            assert {s.global_samples for s in step} == {sum(s.num_samples for s in step)}
            assert all(len(s.indices) == max(s.num_samples, 1) for s in step)
    assert dealt[0][0].indices != dealt[expected_steps][0].indices  # a new order each epoch


def test_drop_last_and_max_steps_end_the_run_where_they_say():
    assert len(run(plans(25, 3, batch=3, drop_last=True))) == 2 * 2
    ranks = plans(25, 3, batch=3, max_steps=3)
    assert ranks[0].total_steps(SimpleNamespace(step=0)) == 3
    assert len(run(ranks)) == 3


def test_a_plan_restored_mid_epoch_deals_what_the_saved_one_had_left():
    whole = run(plans(25, 3))
    first = plans(25, 3)
    before = run(first, stop_after=4)  # step 4 of 3 + 3 + 3: in the second epoch
    states = [p.state_dict() for p in first]
    assert states[0]["epoch"] == 1
    again = plans(25, 3)
    for p, state in zip(again, states, strict=True):
        p.load_state_dict(state)
    assert again[0].total_steps(SimpleNamespace(step=4)) == 6
    after = run(again, progress=4)
    key = [[(s.step, s.epoch, s.indices, s.num_samples) for s in step] for step in whole]
    assert [[(s.step, s.epoch, s.indices, s.num_samples) for s in step]
            for step in before + after] == key  # fmt: skip


def test_a_dealt_step_not_yet_committed_still_counts_as_left():
    [plan] = plans(9, 1, batch=3, epochs=1)
    start = SimpleNamespace(step=0)
    assert plan.remaining() == 3
    step = plan.next_step(start)
    assert plan.remaining() == 3 and plan.total_steps(start) == 3  # dealt, not applied
    plan.commit(step)
    assert plan.remaining() == 2
    assert plan.total_steps(SimpleNamespace(step=1)) == 3


def test_shares_split_the_step_from_the_next_one_dealt():
    ranks = plans(40, 2, batch=5, epochs=1)
    first = run(ranks, stop_after=1)[0]
    assert [s.num_samples for s in first] == [5, 5] and first[0].extras == {}
    for p in ranks:
        p.set_shares([3.0, 1.0])
        assert p.shares() == [3.0, 1.0]
    second = run(ranks, progress=1, stop_after=1)[0]
    assert [s.num_samples for s in second] == [8, 2]
    assert [s.extras["share"] for s in second] == [0.75, 0.25]  # each rank records its own


def test_the_base_plan_offers_no_shares_and_refuses_to_split():
    class Fixed(BatchPlan):
        def next_step(self, progress):
            return None

        def load(self, plan):
            return None, None

        def commit(self, plan):
            return None

        def total_steps(self, progress):
            return 0

    plan = Fixed()
    assert plan.shares() is None and not plan.offer_rate(1.0)
    assert plan.steps_per_epoch() == 0 and plan.state_dict() == {}
    assert plan.load_state_dict({}) is None
    with pytest.raises(NotImplementedError, match="Fixed splits no step by shares"):
        plan.set_shares([1.0])


def test_load_indices_reads_those_samples_as_one_batch():
    inputs, targets = load_indices(dataset(10), [7, 2, 5], DEVICE)
    assert inputs[:, 0].tolist() == [7.0, 2.0, 5.0]
    assert targets.tolist() == [70.0, 20.0, 50.0]
    step = StepPlan(step=1, epoch=0, indices=[1], num_samples=1, global_samples=1)
    assert step.wait_s == 0.0 and step.extras == {}


def test_a_sharded_dataset_is_read_in_shard_order_and_cuda_batches_are_pinned(monkeypatch):
    """The plan hands the sampler the dataset's shard sizes (shard-aware order), pins host
    memory only for a CUDA device, and moves what it loads to its own device."""
    from scaletrain.data import plans as module

    data = dataset(12)
    data.shard_sizes = [4, 4, 4]
    cfg = config()
    [plan] = [SamplerPlan(data, cfg, data_rank=0, data_world_size=1, device=DEVICE)]
    assert plan.sampler.shard_sizes == [4, 4, 4]
    assert plan.loader.pin_memory is False
    cuda = SamplerPlan(data, cfg, data_rank=0, data_world_size=1, device=torch.device("cuda"))
    assert cuda.loader.pin_memory is True  # built only: pinning happens when it is read
    made, moved = [], []
    real_loader, real_move = module.make_loader, module.to_device
    monkeypatch.setattr(
        module, "make_loader", lambda *a, **kw: made.append(kw) or real_loader(*a, **kw)
    )
    monkeypatch.setattr(module, "to_device", lambda x, d: moved.append(d) or real_move(x, d))
    load_indices(data, [1, 2], DEVICE)
    step = plan.next_step(SimpleNamespace(step=0))
    plan.load(step)
    assert made[0]["cuda"] is False and made[0]["batch_size"] == 2
    assert moved == [DEVICE] * 4
