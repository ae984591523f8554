"""An in-place job (--recovery inplace) that loses every replica at once: with
--checkpoint-every one replica (quorum rank 0 of the step) writes each checkpoint, and the
same command continues the job from the newest one after the whole job was SIGKILLed (bit
for bit with --deterministic) or preempted (SIGTERM: the replicas checkpoint their last step
and the launcher exits 3). Real launchers, real signals, torchft's lighthouse and gloo on
loopback."""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest

from scaletrain.config import RunConfig, dumps_toml, with_overrides
from scaletrain.fault.jobs import job_runs_path
from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import append_jsonl, read_jsonl
from scaletrain.launch.jobs import plan_job_run
from tests.conftest import assert_no_orphans, kill_job, run_cli, stress_only
from tests.dist.test_jobs import start, wait_for_step

DIGITS = 1437  # training samples of the built-in digits set
# 23 steps an epoch with 2 replicas x 32, 46 in all; --deterministic so runs compare bitwise.
JOB = ["--recovery", "inplace", "--nproc-per-node", "2", "--epochs", "2", "--deterministic",
       "--seed", "4", "--num-threads", "1", "--checkpoint-every", "10",
       "--log-sample-ids"]  # fmt: skip


def summary(out):
    return json.loads((out / "summary.json").read_text())


def assert_each_sample_once_per_epoch(records, epochs=2):
    seen = collections.defaultdict(list)
    for r in records:
        seen[r["epoch"]] += r["sample_ids"]
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == list(range(DIGITS)), epoch


@pytest.fixture(scope="session")  # session: xdist tears module fixtures down between modules
def inplace_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("inplace-jobs") / "clean"
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    return summary(out), read_jsonl(out / "metrics.jsonl")


def test_one_replica_writes_each_checkpoint(inplace_uninterrupted):
    clean, records = inplace_uninterrupted
    # The writer blocks for its save; the other replica does not wait for it at all.
    writers = collections.Counter(r["step"] for r in records if r["checkpoint_s"] > 0)
    assert writers == {step: 1 for step in range(10, clean["steps"] + 1, 10)}, writers
    assert clean["checkpointing"]["saves"] == 4 and clean["checkpointing"]["mode"] == "every"
    assert clean["recoveries"] == [] and clean["replicas_agree"]
    # Every step with both replicas, the first one too (wait_for_peers: the bitwise
    # comparison below rests on it).
    assert {r["participants"] for r in records} == {2}


def test_a_killed_in_place_job_continues_from_its_checkpoint_bit_identical(
    tmp_path, inplace_uninterrupted
):
    out = tmp_path / "run"
    # Slowed (sleeps, the same math) so the kill lands mid-run.
    proc = start(*JOB, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 25, proc)
    kill_job(proc, out)
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == inplace_uninterrupted[0]["params_sha256"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["job_run"] == 1
    assert resume["step"] >= 20 and resume["step"] % 10 == 0
    assert "ended without a word" in resume["cause"] and resume["lost_steps"] > 0
    # The steps of job run 0 after the checkpoint were trained again: without them, every
    # sample of every epoch once.
    records = read_jsonl(out / "metrics.jsonl")
    redone = [r for r in records if r["job_run"] == 0 and r["step"] > resume["step"]]
    assert redone
    assert_each_sample_once_per_epoch([r for r in records if r not in redone])
    assert got["samples"] == 2 * DIGITS and got["job_runs"] == 2


# Preempted in place: every make stress round (make test's budget keeps the whole-job SIGKILL
# below and the restart mode's preemption at three moments).
@stress_only
def test_a_preempted_in_place_job_checkpoints_exits_3_and_continues(tmp_path):
    out = tmp_path / "run"
    proc = start(*JOB, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 15, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "preempted by SIGTERM" in stderr and "Traceback" not in stderr
    # The last step any replica trained is checkpointed (its quorum's rank 0 wrote it).
    reached = max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    assert index[-1]["step"] == reached, (index, reached)
    assert not (out / "summary.json").exists()
    assert_no_orphans(out)
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["cause"] == "job run 0 preempted"
    assert resume["step"] == reached and resume["lost_steps"] == 0
    assert_each_sample_once_per_epoch(read_jsonl(out / "metrics.jsonl"))  # nothing redone
    assert got["samples"] == 2 * DIGITS and got["replicas_agree"]
    runs = read_jsonl(out / "logs" / "job_runs.jsonl")
    assert [j.get("how") for j in runs if "ended_at" in j] == ["preempted", "finished"]


def test_an_in_place_job_without_checkpoints_is_not_continued(tmp_path):
    """Its state was in the replicas only: refused before anything starts, and why."""
    cfg = with_overrides(RunConfig(), {"recovery": "inplace", "out": str(tmp_path)})
    (tmp_path / "config.toml").write_text(dumps_toml(cfg.to_dict()))
    append_jsonl(job_runs_path(tmp_path), {"job_run": 0, "started_at": 1.0, "attempt_base": 0})
    append_jsonl(tmp_path / "metrics.jsonl", {"step": 1, "rank": 0})  # it trained, then died
    with pytest.raises(ValueError, match="wrote no checkpoint"):
        plan_job_run(cfg, tmp_path, "inplace")


def test_every_replica_lost_at_once_continues_from_the_checkpoint_in_the_same_launcher(
    tmp_path, inplace_uninterrupted
):
    """Both replicas killed before step 12 (checkpoint at 10): nobody to heal from, so the
    launcher begins the next job run itself, as the same command would: bit-identical, step
    11 redone, one restart of each replica spent (a replica that was already restarting when
    the other died is started again in that restart's stead)."""
    out = tmp_path / "run"
    result = run_cli("run", *JOB, "--max-restarts", "1",
                     "--inject", "kill:rank=0:step=12,kill:rank=1:step=12",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "no replica holds the training state" in result.stderr
    got = summary(out)
    assert got["params_sha256"] == inplace_uninterrupted[0]["params_sha256"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["job_run"] == 1 and resume["step"] == 10
    assert "lost every replica" in resume["cause"] and resume["lost_steps"] == 1
    records = read_jsonl(out / "metrics.jsonl")
    redone = [r for r in records if r["job_run"] == 0 and r["step"] > 10]
    assert {r["step"] for r in redone} == {11}
    assert_each_sample_once_per_epoch([r for r in records if r not in redone])
    assert got["samples"] == 2 * DIGITS and got["job_runs"] == 2
    runs = read_jsonl(job_runs_path(out))
    assert [j["job_run"] for j in runs if "started_at" in j] == [0, 1]
    deaths = [i for i in read_jsonl(out / "logs" / "incidents.jsonl") if i["kind"] == "inplace"]
    assert sorted(i["rank"] for i in deaths) == [0, 1]
    assert_no_orphans(out)


@stress_only  # make test's budget: every make stress round runs it
def test_a_replica_lost_before_the_continued_job_commits_heals_from_a_resumed_peer(
    tmp_path, inplace_uninterrupted
):
    """The job killed, the same command continues from step S; replica 0 is killed in step
    S+1, before its first quorum (the peer does not wait for it: its death is recorded).
    Restarted, it holds the fresh state of step 0; its peer holds the checkpoint's. The
    quorum must rank the resumed peer above it (torchft's step counts from S, not 0): at
    equal steps torchft copies the first replica id's state to the others, and replica 1
    would have taken replica 0's fresh one and trained the job again from its start. (The
    weights are not the uninterrupted run's: step S+1 was trained by replica 1 alone.)"""
    out = tmp_path / "run"
    proc = start(*JOB, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 12, proc)
    kill_job(proc, out)
    resumed = json.loads((out / "checkpoints" / "index.json").read_text())[-1]["step"]
    result = run_cli("run", *JOB, "--max-restarts", "1",
                     "--inject", f"kill:rank=0:step={resumed + 1}",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = summary(out)
    resume, death = got["recoveries"]
    assert resume["kind"] == "resume" and resume["step"] == resumed
    assert death["kind"] == "inplace" and death["rank"] == 0
    records = read_jsonl(out / "metrics.jsonl")
    # Job run 1 went on from the checkpoint, on both replicas: none trained from step 0.
    assert min(r["step"] for r in records if r["job_run"] == 1) == resumed + 1
    healed = [r for r in records if r["job_run"] == 1 and r["rank"] == 0 and r["attempt"] > 0]
    assert healed[0]["step"] > resumed and healed[0]["healed_bytes"] > 0
    redone = [r for r in records if r["job_run"] == 0 and r["step"] > resumed]
    assert_each_sample_once_per_epoch([r for r in records if r not in redone])
    assert got["samples"] == 2 * DIGITS and got["replicas_agree"]
    assert_no_orphans(out)


@stress_only  # make test's budget: every make stress round runs it
def test_a_job_killed_after_its_last_checkpoint_finishes_without_training(tmp_path):
    """The job was lost after the checkpoint of its last step and before its summary (the
    state such a kill leaves: the job run not ended, no summary, no final reports). The
    same command has nothing left to train: it forms no quorum, writes no checkpoint again,
    evaluates and writes the summary of the weights the checkpoint holds."""
    job = ["--recovery", "inplace", "--nproc-per-node", "2", "--epochs", "1", "--num-samples",
           "256", "--batch-size", "16", "--checkpoint-every", "8", "--seed", "4",
           "--num-threads", "1"]  # fmt: skip
    out = tmp_path / "run"
    result = run_cli("run", *job, "--out", str(out))
    assert result.returncode == 0, result.stderr
    done = summary(out)
    assert done["steps"] == 8 and [e["step"] for e in read_jsonl(out / "metrics.jsonl")][-1] == 8
    runs = job_runs_path(out)
    runs.write_text(runs.read_text().splitlines()[0] + "\n")  # "finished" never written
    (out / "summary.json").unlink()
    for final in (out / "logs" / "final").iterdir():
        final.unlink()
    result = run_cli("run", *job, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == done["params_sha256"]
    assert got["test_accuracy"] == done["test_accuracy"] and got["replicas_agree"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["step"] == 8 and resume["lost_steps"] == 0
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    assert [e["step"] for e in index] == [8]
    assert_no_orphans(out)
