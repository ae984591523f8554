"""Sharded data parallel (FSDP2): the same training as one process, a fraction of the state
per rank, and checkpoints that survive a restart. Real processes, real gloo collectives."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from scaletrain.fault.checkpoint import read_index
from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import read_jsonl
from tests.conftest import assert_no_orphans, kill_job, run_cli, stress_only
from tests.dist.test_equivalence import train
from tests.dist.test_jobs import start, wait_for_step


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


# 2 groups x 2 ranks in place with persistent checkpoints written in the background: the
# HSDP fixture's run otherwise (its weights are the uninterrupted in-place run's, above).
HSDP_JOB = ["--recovery", "inplace", "--strategy", "fsdp", "--replica-size", "2",
            "--nproc-per-node", "4", "--dataset", "digits", "--num-samples", "115",
            "--model", "cnn", "--width", "8", "--batch-size", "3", "--epochs", "2",
            "--lr", "0.05", "--seed", "3", "--deterministic", "--num-threads", "1",
            "--checkpoint-every", "4", "--checkpoint-async", "--log-sample-ids"]  # fmt: skip


def test_a_killed_hsdp_in_place_job_continues_from_its_group_checkpoint_bit_identical(
    tmp_path, hsdp
):
    """The group of each step's quorum rank 0 writes its checkpoint, each rank its shards in
    the file of its rank in the group. The whole job SIGKILLed after step 10 (checkpoint at
    8), the same command continues from step 8: the restart mode's weights, bit for bit, and
    every sample once per epoch (the steps after the checkpoint trained again)."""
    weights, _ = hsdp
    out = tmp_path / "run"
    # A rank of each group hangs before step 11 (once in the job: its first run), so that
    # run stands still after step 10 until it is killed.
    job = [*HSDP_JOB, "--inject", "hang:rank=0:step=11,hang:rank=2:step=11", "--out", str(out)]
    checkpoints = out / "checkpoints"
    proc = start(*job)
    wait_for_step(out, 10, proc)
    # Both hangs fired (else the next run would hang there), and the background write of
    # step 8 is published.
    fired = [out / "logs" / "faults" / f"hang-rank{r}-step11" for r in (0, 2)]
    deadline = time.monotonic() + 60
    while not (all(f.exists() for f in fired) and steps(read_index(checkpoints)) == [4, 8]):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    kill_job(proc, out)
    assert steps(read_index(checkpoints)) == [4, 8]
    # One group wrote each: a file per rank of the group, by its rank in the group.
    assert sorted(p.name for p in (checkpoints / "rng").glob("step-00000008-*")) == [
        "step-00000008-rank0.pt", "step-00000008-rank1.pt"]  # fmt: skip

    result = run_cli("run", *job)
    assert result.returncode == 0, result.stderr
    final = torch.load(checkpoints / "final.pt", weights_only=True)["model"]
    assert all(torch.equal(final[k], weights[k]) for k in weights)
    summary = json.loads((out / "summary.json").read_text())
    [resume] = summary["recoveries"]
    assert (resume["kind"], resume["step"], resume["job_run"]) == ("resume", 8, 1)
    assert "ended without a word" in resume["cause"] and resume["lost_steps"] == 2
    records = read_jsonl(out / "metrics.jsonl")
    assert_each_sample_once([r for r in records if not (r["job_run"] == 0 and r["step"] > 8)])
    assert_no_orphans(out)


# Every make stress round (make test's budget keeps the whole-job SIGKILL above, which
# reads the group checkpoints, and the restart mode's preemption at three moments).
@stress_only
def test_a_preempted_hsdp_in_place_job_leaves_by_groups_and_continues(tmp_path):
    """SIGTERM: the ranks of a group leave after the same step (they agree on it: one that
    left alone would leave its mate in the step's collectives), the last step's writing
    group checkpoints it (a group that saw the request a step later trains that step
    without the other), the launcher exits 3, and the same command goes on from that step
    with nothing trained twice."""
    out = tmp_path / "run"
    job = [*HSDP_JOB, "--out", str(out)]
    # Rank 1 is slowed (sleeps, the same math) so the SIGTERM lands mid-run.
    proc = start(*job, "--inject", "slow:rank=1:factor=8")
    wait_for_step(out, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr
    records = read_jsonl(out / "metrics.jsonl")
    left = {r["rank"]: r["step"] for r in records}  # each rank's last step
    assert left[0] == left[1] and left[2] == left[3], left
    reached = max(left.values())
    assert steps(read_index(out / "checkpoints"))[-1] == reached
    result = run_cli("run", *job)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    [resume] = summary["recoveries"]
    assert resume["cause"] == "job run 0 preempted"
    assert resume["step"] == reached and resume["lost_steps"] == 0
    assert_each_sample_once(read_jsonl(out / "metrics.jsonl"))  # nothing trained twice
    assert summary["replicas_agree"]
    assert_no_orphans(out)


def assert_each_sample_once(records: list[dict]) -> None:
    for epoch in (0, 1):
        ids = [i for r in records if r["epoch"] == epoch for i in r["sample_ids"]]
        assert sorted(ids) == list(range(115)), epoch


def steps(index: list[dict]) -> list[int]:
    return [e["step"] for e in index]
