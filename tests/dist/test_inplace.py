"""In-place recovery (--recovery inplace, on torchft): a SIGKILLed worker does not stop the
others, nothing rolls back, a restarted worker rejoins with the group's state, and every
sample is still trained exactly once per epoch. Real processes, real SIGKILLs, a real
lighthouse and gloo groups rebuilt on loopback."""

from __future__ import annotations

import collections
import json
import os

import pytest

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch import describe_plan
from tests.conftest import assert_no_orphans, run_cli, stress_only

DIGITS = 1437  # training samples of the built-in digits set


def load(out):
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def assert_exactly_once(records, epochs):
    seen = collections.defaultdict(list)
    for r in records:
        seen[r["epoch"]] += r["sample_ids"]
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == list(range(DIGITS)), f"epoch {epoch}"


def test_survivors_continue_and_a_restarted_worker_rejoins(tmp_path):
    out = tmp_path / "run"
    # Rank 0 is slowed so the run outlasts rank 1's restart (a fresh Python importing torch).
    result = run_cli("run", "--recovery", "inplace", "--nproc-per-node", "2", "--epochs", "6",
                     "--max-restarts", "1", "--log-sample-ids", "--num-threads", "1",
                     "--inject", "kill:rank=1:step=10,slow:rank=0:factor=6",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    survivor = [r for r in records if r["rank"] == 0]
    # Rank 0 was never restarted and never went back: one attempt, every step once, in order.
    assert {r["attempt"] for r in survivor} == {0}
    assert [r["step"] for r in survivor] == list(range(1, summary["steps"] + 1))
    [recovery] = summary["recoveries"]
    assert recovery["kind"] == "inplace" and recovery["rank"] == 1
    assert recovery["lost_steps"] == 0 and recovery["world_size"] == 1
    assert recovery["detected_s"] is not None and recovery["resumed_s"] is not None
    # Alone after the kill, then two again once rank 1 rejoined at a later step, healed from
    # rank 0: it starts where the group is, not at step 1.
    rejoined = [r for r in records if r["rank"] == 1 and r["attempt"] == 1]
    assert rejoined, "rank 1 did not rejoin"
    first = rejoined[0]["step"]
    assert recovery["rejoined_step"] == first > 10
    # It copied the model and the optimizer's state at least (the sampler's too), and that
    # copy is timed (within its first step's quorum).
    assert recovery["healed_bytes"] == rejoined[0]["healed_bytes"]
    assert recovery["healed_bytes"] >= summary["max_rank_state_bytes"] / 2
    assert 0 < recovery["heal_s"] == rejoined[0]["heal_copy_s"] <= rejoined[0]["quorum_s"]
    assert recovery["heal_GBps"] > 0
    by_step = {r["step"]: r["participants"] for r in survivor}
    assert by_step[10] == 1 or by_step[11] == 1
    assert by_step[first] == 2 and by_step[summary["steps"]] == 2
    assert summary["replicas_agree"]
    assert_exactly_once(records, 6)
    assert "in place: rank 1 killed by SIGKILL" in result.stdout
    assert summary["test_accuracy"] > 0.9
    assert_no_orphans(out)


# Compression in place runs in make test's modes matrix (bf16, no fault) and a kill in
# place in the test above; the two together in every make stress round (make test's budget).
@stress_only
def test_compressed_gradients_in_place_survive_a_kill(tmp_path):
    """--compression bf16 in place: the gradient all-reduce goes in bf16 on torchft's group
    (half the bytes), a SIGKILLed replica is restarted and heals, every sample once."""
    out = tmp_path / "run"
    result = run_cli("run", "--recovery", "inplace", "--nproc-per-node", "2", "--epochs", "6",
                     "--compression", "bf16", "--max-restarts", "1", "--log-sample-ids",
                     "--num-threads", "1", "--inject", "kill:rank=1:step=10,slow:rank=0:factor=6",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    [recovery] = summary["recoveries"]
    assert recovery["kind"] == "inplace" and recovery["lost_steps"] == 0
    assert any(r["rank"] == 1 and r["attempt"] == 1 for r in records), "rank 1 did not rejoin"
    assert summary["compression_ratio"] == pytest.approx(2.0, rel=0.01)
    assert summary["replicas_agree"] and summary["test_accuracy"] > 0.8
    assert_exactly_once(records, 6)
    assert_no_orphans(out)


def test_without_restarts_the_survivors_finish_every_epoch(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--recovery", "inplace", "--nproc-per-node", "3", "--epochs", "2",
                     "--log-sample-ids", "--num-threads", "1", "--inject", "kill:rank=2:step=5",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    [recovery] = summary["recoveries"]
    assert recovery["rank"] == 2 and recovery["world_size"] == 2 and "rejoined_step" not in recovery
    # Rank 2's unconsumed samples went to the two survivors: still exactly once per epoch.
    assert_exactly_once(records, 2)
    assert summary["samples"] == 2 * DIGITS
    assert {r["participants"] for r in records if r["step"] > 6} == {2}
    assert summary["replicas_agree"]


def test_max_steps_ends_every_replica_at_that_step(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--recovery", "inplace", "--nproc-per-node", "2", "--epochs", "3",
                     "--max-steps", "7", "--num-threads", "1", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["steps"] == 7
    for rank in (0, 1):
        assert [r["step"] for r in records if r["rank"] == rank] == list(range(1, 8))
    assert summary["replicas_agree"]
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]  # both reported


@stress_only  # make test's budget: every make stress round runs it
def test_a_slow_replica_is_waited_for_not_healed_at_every_step(tmp_path):
    """Three replicas, one much slower: every step's quorum waits for it (it is alive), so
    all three contribute to every step. With a 100 ms join timeout the lighthouse formed
    each quorum with the first majority (2 of 3, as 17 of 32 at scale) and the slow one
    healed from a peer at every step, its gradients never counted."""
    out = tmp_path / "run"
    result = run_cli("run", "--recovery", "inplace", "--nproc-per-node", "3", "--epochs", "1",
                     "--max-steps", "6", "--num-threads", "1", "--inject",
                     "slow:rank=2:factor=60", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["steps"] == 6 and summary["replicas_agree"]
    slow = [r["compute_s"] for r in records if r["rank"] == 2]
    fast = [r["compute_s"] for r in records if r["rank"] == 0]
    assert min(slow) > 0.15 and max(fast) < min(slow)  # slower than the old join timeout
    assert {r["participants"] for r in records} == {3}


def test_a_replica_that_reached_the_end_finishes_after_a_peer_did(tmp_path):
    """The replica that ends second has trained every step too: it finishes and reports its
    totals. It was told "the other replicas finished the run before this one rejoined" (a
    restarted replica's case) and left no final report, so the modes matrix's slowed rank
    had no per-rank figures in about one run of four on a loaded machine."""
    import types

    import torch

    from scaletrain.strategies.inplace import QuorumPlan

    cfg = with_overrides(RunConfig(), {"recovery": "inplace", "max_steps": 5, "out": str(tmp_path)})
    (tmp_path / "logs" / "final").mkdir(parents=True)
    (tmp_path / "logs" / "final" / "rank0.json").write_text("{}")  # the peer's, written first
    ctx = types.SimpleNamespace(device=torch.device("cpu"), rank=1, world_size=2)
    strategy = types.SimpleNamespace(cfg=cfg, ctx=ctx, run_dir=tmp_path)
    plan = QuorumPlan(strategy, list(range(96)))
    assert plan.next_step(types.SimpleNamespace(step=5)) is None


def test_inplace_refuses_what_it_cannot_do():
    base = {"recovery": "inplace"}
    for overrides, message in [
        ({"strategy": "pipeline"}, "--recovery inplace runs data parallel training"),
        # fsdp in place: whole replica groups (tests/dist/test_inplace_hsdp.py), 2 at least,
        # on one node each; --balance speed not with them yet.
        ({"strategy": "fsdp"}, "pass --replica-size R"),
        ({"strategy": "fsdp", "replica_size": 4, "nproc_per_node": 4}, "at least 2 replica"),
        (
            {"strategy": "fsdp", "replica_size": 2, "nproc_per_node": 4, "balance": "speed"},
            "not built for groups yet",
        ),
        (
            {
                "strategy": "fsdp",
                "replica_size": 2,
                "nproc_per_node": 3,
                "nnodes": "2",
                "rdzv_endpoint": "127.0.0.1:29999",
            },
            "must divide --nproc-per-node",
        ),
        ({"nnodes": "1:2", "rdzv_endpoint": "127.0.0.1:29999"}, "starts a fixed set of replicas"),
        ({"compression": "powersgd:rank=2"}, "carries fp16 and bf16 gradients, not powersgd"),
        ({"compression": "topk"}, "torchft carries only all-reduces"),
        ({"strategy": "local_sgd", "balance": "speed"}, "deals a round of --sync-every steps"),
    ]:
        with pytest.raises(ValueError, match=message):
            describe_plan(with_overrides(RunConfig(), {**base, **overrides}))


def _outranks(tmp_path):
    """Two replicas of a job run that continues from the checkpoint of step 7: replica 1
    resumed from it; replica 0 was restarted before the first commit and holds the fresh
    state. In their first quorum (real torchft: a lighthouse and two managers) replica 0
    must heal from replica 1. Were both at torchft's step 0, torchft would take replica 0,
    the first id, as the source and copy its fresh state over the resumed one."""
    import threading

    import torch
    from torchft.coordination import LighthouseServer

    from scaletrain import env
    from scaletrain.runtime import DistContext
    from scaletrain.strategies.inplace import InplaceStrategy

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000)
    port = lighthouse.address().rpartition(":")[2]
    os.environ[env.LIGHTHOUSE] = f"http://127.0.0.1:{port}"
    os.environ[env.ADDR] = "127.0.0.1"
    cfg = with_overrides(RunConfig(), {"recovery": "inplace", "out": str(tmp_path)})
    replicas = []
    for rank, attempt, value in ((0, 1, 0.0), (1, 0, 1.0)):
        ctx = DistContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                          restart_count=attempt, attempt=attempt, device=torch.device("cpu"),
                          backend="gloo", mode="inplace")  # fmt: skip
        strategy = InplaceStrategy(ctx, cfg)
        model = torch.nn.Linear(4, 2)
        torch.nn.init.constant_(model.weight, value)
        strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.mse_loss)
        strategy.bind_state(
            lambda s=strategy: {"strategy": s.state_dict()},
            lambda state, s=strategy: s.load_state_dict(state["strategy"]),
        )
        replicas.append(strategy)
    replicas[1].resumed_at(7)  # what the loop does after it resumed from the checkpoint
    try:
        threads = [threading.Thread(target=r.manager.start_quorum) for r in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        for r in replicas:  # the resumed state on both, and its step
            assert torch.equal(r.module.weight, torch.ones(2, 4)), r.ctx.rank
            assert r.manager.current_step() == 7
        assert replicas[0].healed_bytes > 0 and replicas[1].healed_bytes == 0
        replicas[0].check_state_held()  # it found the job's state: nothing raised
    finally:
        for r in replicas:
            r.manager.shutdown(wait=True)  # a worker's close does not wait: it exits next
        lighthouse.shutdown()


def _finds_no_state(tmp_path):
    """Every replica that held the job's state was lost (across nodes no launcher knows):
    the one restarted alone finds torchft's step at 0 while the job has a checkpoint. It
    must not train the job again from its start over that checkpoint: it fails, naming the
    checkpoint to continue from."""
    import torch
    from torchft.coordination import LighthouseServer

    from scaletrain import env
    from scaletrain.fault.checkpoint import save_checkpoint
    from scaletrain.runtime import DistContext
    from scaletrain.strategies.inplace import InplaceStrategy, StateLost

    save_checkpoint(tmp_path / "checkpoints", 10, {"weights": torch.zeros(1)}, keep=2)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    os.environ[env.LIGHTHOUSE] = f"http://127.0.0.1:{lighthouse.address().rpartition(':')[2]}"
    os.environ[env.ADDR] = "127.0.0.1"
    cfg = with_overrides(RunConfig(), {"recovery": "inplace", "out": str(tmp_path)})
    ctx = DistContext(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=1,
                      attempt=1, device=torch.device("cpu"), backend="gloo",
                      mode="inplace")  # fmt: skip
    strategy = InplaceStrategy(ctx, cfg)
    model = torch.nn.Linear(4, 2)
    strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.mse_loss)
    strategy.bind_state(lambda: {"strategy": strategy.state_dict()},
                        lambda state: strategy.load_state_dict(state["strategy"]))  # fmt: skip
    try:
        strategy.manager.start_quorum()
        with pytest.raises(StateLost, match="newest checkpoint is step 10"):
            strategy.check_state_held()
    finally:
        strategy.manager.shutdown(wait=True)
        lighthouse.shutdown()


def _in_a_process_of_its_own(name: str, tmp_path) -> None:
    """torchft's managers and lighthouse run in a process of their own, which leaves at once
    when the checks passed: their threads at an interpreter's exit once took a whole pytest
    worker down."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (f"import os, sys; from pathlib import Path; from tests.dist.test_inplace import "
            f"{name}; {name}(Path(sys.argv[1])); sys.stdout.flush(); os._exit(0)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_resumed_replica_outranks_one_restarted_afresh_in_their_first_quorum(tmp_path):
    _in_a_process_of_its_own("_outranks", tmp_path)


def test_a_restarted_replica_that_finds_no_state_fails_rather_than_train_afresh(tmp_path):
    _in_a_process_of_its_own("_finds_no_state", tmp_path)


def test_ddp_in_place_trains_as_the_restart_mode_does(tmp_path):
    """No fault: in place (torchft's quorum and all-reduce) ends with the restart mode's
    weights, bit for bit, through an uneven last step (1437 digits in steps of 48: its 45
    split 23 and 22), so each replica's gradient is weighted by its samples over the
    quorum's participants, as DDP weighs them."""
    job = ["--nproc-per-node", "2", "--epochs", "1", "--deterministic", "--seed", "4",
           "--num-threads", "1", "--batch-size", "24"]  # fmt: skip
    hashes = []
    for name, extra in [("inplace", ["--recovery", "inplace"]), ("restart", [])]:
        out = tmp_path / name
        result = run_cli("run", *job, *extra, "--out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        hashes.append(json.loads((out / "summary.json").read_text())["params_sha256"])
    assert hashes[0] == hashes[1]
