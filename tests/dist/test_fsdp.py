"""Sharded data parallel (FSDP2): the same training as one process, a fraction of the state
per rank, and checkpoints that survive a restart. Real processes, real gloo collectives."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import assert_no_orphans, run_cli, stress_only
from tests.dist.test_equivalence import train


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), 1, 115)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_one_process(tmp_path, single, world):
    """Losses step by step and final weights as one worker with the whole batch, including
    the short, unevenly split last step of each epoch."""
    ref_weights, ref = single
    weights, run = train(tmp_path, world, 115, strategy="fsdp")
    assert run["summary"]["steps"] == 20
    ref_loss = {r["step"]: r["loss"] for r in ref["records"]}
    for step in range(1, 11):
        rows = [r for r in run["records"] if r["step"] == step and r["samples"]]
        mean = sum(r["loss"] * r["samples"] for r in rows) / sum(r["samples"] for r in rows)
        assert mean == pytest.approx(ref_loss[step], abs=1e-4), f"step {step}"
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"


def test_fsdp_holds_a_share_of_the_state(tmp_path, single):
    _, ref = single
    _, run = train(tmp_path, 2, 115, strategy="fsdp")
    full = ref["summary"]["per_rank"][0]["memory"]
    for rank in run["summary"]["per_rank"]:
        mine = rank["memory"]
        # Each rank holds its shard: about half (shards are padded to equal sizes).
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert 0.45 * full[key] <= mine[key] <= 0.6 * full[key], (key, mine, full)
    assert run["summary"]["max_rank_state_bytes"] < 0.6 * ref["summary"]["max_rank_state_bytes"]


# Every make stress round (make test's budget: fsdp's restart from DCP shards is bit-identical
# in the HSDP test below and in test_resume_property.py's fsdp regression).
@stress_only
def test_fsdp_and_tensor_checkpoint_restart_gives_identical_weights(tmp_path):
    """fsdp --tp 2 on the transformer holds both kinds of DTensor state (FSDP shards over
    "dp", tensor-parallel splits over "tp"; here dp is 1): a rank killed mid-run restarts
    from the DCP checkpoint to the uninterrupted run's weights. --strategy tensor keeps its
    state the same way (it inherits fsdp's state handling)."""
    common = ["--nproc-per-node", "2", "--strategy", "fsdp", "--tp", "2", "--model",
              "transformer", "--max-steps", "8", "--deterministic", "--seed", "5",
              "--num-threads", "1"]  # fmt: skip
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli("run", *common, "--out", str(clean)).returncode == 0
    result = run_cli("run", *common, "--checkpoint-every", "3", "--max-restarts", "1",
                     "--inject", "kill:rank=1:step=5", "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summaries = [json.loads((d / "summary.json").read_text()) for d in (clean, killed)]
    assert summaries[1]["recoveries"][0]["step"] == 3
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    assert_no_orphans(killed)


@pytest.fixture(scope="session")
def hsdp(tmp_path_factory):
    """2 replica groups of 2 ranks (--replica-size 2), the single run's data and batch."""
    return train(tmp_path_factory.mktemp("hsdp"), 4, 115, strategy="fsdp", replica_size=2)


def test_hsdp_matches_one_process_and_holds_a_group_share(single, hsdp):
    """Replica groups (HSDP): each group shards over its own 2 ranks and the groups
    all-reduce the shards' gradients; the training is one process's with the whole batch,
    and a rank holds half the state (its group's share), not a quarter."""
    ref_weights, ref = single
    weights, run = hsdp
    assert run["summary"]["hsdp"] == {"replica_size": 2, "replica_groups": 2}
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"
    full = ref["summary"]["per_rank"][0]["memory"]
    for rank in run["summary"]["per_rank"]:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert 0.45 * full[key] <= rank["memory"][key] <= 0.6 * full[key], (key, rank)


def test_hsdp_checkpoint_restart_gives_identical_weights(tmp_path, hsdp):
    """A rank of the second group SIGKILLed mid-run: the group restarts from the DCP
    checkpoint of the 2-D mesh's shards, to the uninterrupted run's weights, bit for bit."""
    weights, _ = hsdp
    killed, run = train(
        tmp_path, 4, 115, strategy="fsdp", replica_size=2,
        checkpoint_every=4, max_restarts=1, inject="kill:rank=3:step=6",
    )  # fmt: skip
    assert run["summary"]["recoveries"][0]["step"] == 4, run["summary"]["recoveries"]
    assert all(torch.equal(killed[k], weights[k]) for k in weights)


def test_hsdp_in_place_trains_as_the_restart_mode_does(tmp_path, hsdp):
    """The same 2 groups x 2 ranks in place (torchft's quorum and all-reduce across the
    groups, FSDP within each: tests/dist/test_inplace_hsdp.py kills one): the same data split
    and the same two means as the restart mode's 2-D mesh, so the same weights, bit for bit,
    the uneven last step of each epoch included; each rank holds its group's share."""
    weights, restart = hsdp
    ours, run = train(tmp_path, 4, 115, strategy="fsdp", replica_size=2, recovery="inplace")
    summary = run["summary"]
    assert summary["recovery"] == "inplace" and summary["replicas_agree"]
    assert summary["hsdp"] == {"replica_size": 2, "replica_groups": 2}
    assert all(torch.equal(ours[k], weights[k]) for k in weights)
    memory = {r["rank"]: r["memory"] for r in summary["per_rank"]}
    assert memory == {r["rank"]: r["memory"] for r in restart["summary"]["per_rank"]}
