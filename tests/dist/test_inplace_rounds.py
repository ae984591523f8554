"""Local SGD and DiLoCo with --recovery inplace (strategies/inplace_rounds.py), for real: a
clean run equals the restart mode's bit for bit; a replica SIGKILLed between two
synchronizations costs only its own round (its samples are redone, its records named lost),
and it rejoins healed; a whole job SIGKILLed continues from its checkpoint with the same
command, bit-identical to the run never killed; a preempted one (SIGTERM) leaves at a
synchronization and continues."""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest

from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import read_jsonl
from scaletrain.strategies.inplace_rounds import without_lost_work
from tests.conftest import assert_no_orphans, kill_job, run_cli, stress_only
from tests.dist.test_jobs import start, wait_for_step

DIGITS = 1437  # training samples of the built-in digits set
# 24 steps an epoch with 2 replicas x 30 (the last of 17), 48 in all: rounds of 4. (In place
# a round never crosses an epoch, where the restart mode's count of local steps does: its
# synchronizations fall at the same steps only when --sync-every divides the epoch's steps.)
JOB = ["--strategy", "diloco", "--sync-every", "4", "--nproc-per-node", "2", "--epochs", "2",
       "--batch-size", "30", "--deterministic", "--seed", "4", "--num-threads", "1",
       "--checkpoint-every", "10", "--log-sample-ids"]  # fmt: skip


def summary(out):
    return json.loads((out / "summary.json").read_text())


def assert_each_sample_once_per_epoch(records, epochs):
    seen = collections.defaultdict(list)
    for r in records:
        seen[r["epoch"]] += r["sample_ids"][: r["samples"]]
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == list(range(DIGITS)), epoch


@pytest.fixture(scope="session")  # session: xdist tears module fixtures down between modules
def clean_rounds(tmp_path_factory):
    out = tmp_path_factory.mktemp("inplace-rounds") / "clean"
    result = run_cli("run", "--recovery", "inplace", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_in_place_rounds_train_as_the_restart_mode_does(tmp_path, clean_rounds):
    """No fault: the same weights as DiLoCo in the restart mode, bit for bit (the same
    rounds, the same sample-weighted averages, the same outer steps); every synchronization
    with both replicas; each checkpoint written by one replica, with each replica's own
    optimizer state beside it."""
    out = tmp_path / "restart"
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    clean = summary(clean_rounds)
    assert clean["params_sha256"] == summary(out)["params_sha256"]
    assert clean["replicas_agree"] and clean["recoveries"] == []
    records = read_jsonl(clean_rounds / "metrics.jsonl")
    assert {r["participants"] for r in records} == {2} and not any("lost" in r for r in records)
    # Each step is numbered with its round: 12 rounds of 4.
    rounds = collections.Counter(r["round"] for r in records if r["rank"] == 0)
    assert rounds == {i: 4 for i in range(1, 13)}
    assert_each_sample_once_per_epoch(records, 2)
    # Checkpoints hold the last synchronization's state: due after steps 10, 20, 30, 40 and
    # the last, they hold steps 8, 16, 28, 36 and 48 (the index keeps the newest 3).
    index = json.loads((clean_rounds / "checkpoints" / "index.json").read_text())
    assert [e["step"] for e in index] == [28, 36, 48]
    own = sorted(p.name for p in (clean_rounds / "checkpoints" / "rng").iterdir())
    assert own == [f"step-{s:08d}-rank{r}.pt" for s in (28, 36, 48) for r in (0, 1)]
    writers = collections.Counter(r["step"] for r in records if r["checkpoint_s"] > 0)
    assert set(writers) == {10, 20, 30, 40}  # each replica its own file, rank 0 the rest


def test_a_replica_killed_between_synchronizations_costs_only_its_round(tmp_path):
    out = tmp_path / "run"
    # Rank 1 dies before step 10, inside round 3 (steps 9-12), and is restarted; rank 0 is
    # slowed so the run outlasts the restart (a fresh Python importing torch).
    result = run_cli("run", "--recovery", "inplace", "--strategy", "local_sgd",
                     "--sync-every", "4", "--nproc-per-node", "2", "--epochs", "6",
                     "--max-restarts", "1", "--log-sample-ids", "--num-threads", "1",
                     "--inject", "kill:rank=1:step=10,slow:rank=0:factor=6",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    got, records = summary(out), read_jsonl(out / "metrics.jsonl")
    survivor = [r for r in records if r["rank"] == 0]
    # Rank 0 never went back: one attempt, every step once, in order; its own round 3 kept.
    assert {r["attempt"] for r in survivor} == {0}
    assert [r["step"] for r in survivor] == list(range(1, got["steps"] + 1))
    # The synchronization that closed round 3 found rank 1's part of it lost: named in the
    # next step's records, and its samples trained again, so without rank 1's round 3
    # every sample of every epoch is trained once.
    lost = [r["lost"] for r in survivor if "lost" in r]
    assert lost == [[[1, 3]]], lost
    assert [r["step"] for r in records if r["rank"] == 1 and r["round"] == 3] == [9]
    assert_each_sample_once_per_epoch(without_lost_work(records), 6)
    # Rank 1 rejoined at a synchronization, healed from rank 0's state of the one before.
    [recovery] = got["recoveries"]
    assert recovery["kind"] == "inplace" and recovery["rank"] == 1
    rejoined = [r for r in records if r["rank"] == 1 and r["attempt"] == 1]
    assert rejoined, "rank 1 did not rejoin"
    assert recovery["rejoined_step"] == rejoined[0]["step"] > 12
    assert rejoined[0]["healed_bytes"] > 0 and rejoined[0]["synced"]
    by_step = {r["step"]: r["participants"] for r in survivor}
    assert by_step[13] == 1 and by_step[rejoined[0]["step"]] == 2
    assert got["replicas_agree"] and got["test_accuracy"] > 0.9
    assert_no_orphans(out)


# An in-place job killed whole and continued: make test has ddp's (test_inplace_jobs.py).
@stress_only  # make test's budget: every make stress round runs it
def test_a_killed_job_continues_bit_identical(tmp_path, clean_rounds):
    out = tmp_path / "run"
    # Slowed (sleeps, the same math) so the kill lands mid-run.
    proc = start("--recovery", "inplace", *JOB, "--inject", "slow:rank=0:factor=4",
                 "--out", str(out))  # fmt: skip
    wait_for_step(out, 25, proc)
    kill_job(proc, out)
    result = run_cli("run", "--recovery", "inplace", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    # Each replica continued its own optimizer state (written beside the checkpoint), the
    # rounds were dealt as before: the weights of the run never killed.
    assert got["params_sha256"] == summary(clean_rounds)["params_sha256"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["job_run"] == 1
    assert resume["step"] in (16, 28) and resume["lost_steps"] > 0
    records = without_lost_work(read_jsonl(out / "metrics.jsonl"))
    redone = [r for r in records if r["job_run"] == 0 and r["step"] > resume["step"]]
    assert redone
    assert_each_sample_once_per_epoch([r for r in records if r not in redone], 2)
    assert got["replicas_agree"]


@stress_only
def test_a_preempted_job_leaves_at_a_synchronization_and_continues(tmp_path):
    """SIGTERM: the replicas leave together just after a synchronization (after the first
    step of a round), with its state checkpointed; none leaves mid-round, so no replica's
    round is lost to the others (exit 3). The same command continues; every sample once."""
    job = ["--recovery", "inplace", *JOB, "--strategy", "local_sgd"]
    out = tmp_path / "run"
    proc = start(*job, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 15, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr
    records = read_jsonl(out / "metrics.jsonl")
    last = {rank: max(r["step"] for r in records if r["rank"] == rank) for rank in (0, 1)}
    assert len(set(last.values())) == 1 and last[0] % 4 == 1, last  # a round's first step
    assert not any("lost" in r for r in records)
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    assert index[-1]["step"] == last[0] - 1
    assert_no_orphans(out)
    result = run_cli("run", *job, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    [resume] = got["recoveries"]
    assert resume["cause"] == "job run 0 preempted" and resume["step"] == last[0] - 1
    records = without_lost_work(read_jsonl(out / "metrics.jsonl"))
    redone = [r for r in records if r["job_run"] == 0 and r["step"] > resume["step"]]
    assert_each_sample_once_per_epoch([r for r in records if r not in redone], 2)
    assert got["samples"] == 2 * DIGITS and got["replicas_agree"]
