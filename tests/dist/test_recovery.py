"""Checkpoint, kill, resume: real workers, real SIGKILLs, torch's elastic agent restarting.

- A worker killed mid-run (max-restarts 1): the group restarts from the newest checkpoint and
  ends with bit-identical weights to an uninterrupted run (--deterministic, CPU).
- A whole node killed mid-epoch (3 nodes, --nnodes 2:3): the 2 survivors re-rendezvous, resume
  from the checkpoint and re-split the rest of the epoch; the sample ids trained on (kept up to
  the step each attempt was resumed from) are exactly the dataset, each once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from scaletrain.io import read_jsonl
from tests.conftest import (
    REPO,
    assert_no_orphans,
    listeners_while_running,
    run_cli,
    start_local_nodes,
    stress_only,
)


def summary_of(out):
    return json.loads((out / "summary.json").read_text())


COMMON = ["--nproc-per-node", "2", "--max-steps", "20", "--deterministic", "--seed", "3"]


@pytest.fixture(scope="session")
def clean_hash(tmp_path_factory):
    clean = tmp_path_factory.mktemp("clean") / "run"
    assert run_cli("run", *COMMON, "--out", str(clean)).returncode == 0
    return summary_of(clean)["params_sha256"]


# Asynchronous saves in every make stress round (make test's budget; make test kills a run
# with asynchronous checkpoints in test_resume_property.py and the modes matrix).
@pytest.mark.parametrize("saving", ["sync", pytest.param("async", marks=stress_only)])
def test_killed_worker_restarts_from_checkpoint_with_identical_weights(
    tmp_path, clean_hash, saving
):
    """Synchronous saves: rank 1 dies before step 8, and rank 0 before step 14 of the restarted
    world (a fault fires once per job, the first time its rank reaches its step, so a later
    one still fires after a restart): two restarts, the clean run's weights."""
    killed = tmp_path / "killed"
    async_flag = ["--checkpoint-async"] if saving == "async" else []
    second = ",kill:rank=0:step=14" if saving == "sync" else ""
    result = run_cli("run", *COMMON, "--checkpoint-every", "3", "--max-restarts", "2",
                     *async_flag, "--inject", f"kill:rank=1:step=8{second}",
                     "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of(killed)
    assert summary["params_sha256"] == clean_hash
    assert summary["steps"] == 20
    recovery, *later = summary["recoveries"]
    if saving == "sync":
        [again] = later
        assert again["attempt"] == 2 and again["rank"] == 0 and again["failed_step"] == 14
        assert again["step"] == 12
    else:
        assert later == []
    assert recovery["kind"] == "restart" and recovery["attempt"] == 1
    assert recovery["cause"] == "death" and recovery["rank"] == 1
    assert recovery["failed_step"] == 8
    if saving == "sync":
        assert recovery["step"] == 6  # the newest checkpoint before the kill at step 8
    else:  # step 6's save may still have been in flight when rank 1 died
        assert recovery["step"] in (3, 6), recovery
    # step 7 (and with the older checkpoint, 4 to 6) was trained, then lost with the group
    assert recovery["lost_steps"] == 7 - recovery["step"]
    assert 0 < recovery["detected_s"] < recovery["resumed_s"] + recovery["detected_s"]
    assert recovery["resumed_s"] > 0
    assert "killed by SIGKILL" not in result.stderr  # recovered: not reported as a failure
    assert_no_orphans(killed)


@stress_only  # make test's budget: every make stress round runs it
def test_a_death_right_after_a_checkpoint_step_resumes_from_that_checkpoint(tmp_path):
    """Rank 0 is slowed (it sleeps after each step's compute, before it saves) and rank 1
    dies just before the step after a checkpoint. A rank passes a synchronous save only once
    rank 0's checkpoint is on disk, so the restart resumes from that checkpoint: before, rank
    1 went on with only its RNG file written and the agent stopped rank 0 mid-save (the
    stress runs' draw ddp-w4-b8x1-n70-ck1-kill1at4 resumed from step 2, not 3)."""
    out = tmp_path / "run"
    result = run_cli("run", "--nproc-per-node", "2", "--max-steps", "8", "--deterministic",
                     "--checkpoint-every", "3", "--max-restarts", "1", "--inject",
                     "kill:rank=1:step=7,slow:rank=0:factor=50", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    [recovery] = summary_of(out)["recoveries"]
    assert recovery["failed_step"] == 7 and recovery["rank"] == 1, recovery
    assert recovery["step"] == 6, recovery
    assert_no_orphans(out)


@stress_only  # make test's budget: every make stress round runs it
def test_an_empty_error_file_is_a_death_like_any_other_and_the_job_restarts(tmp_path):
    """torch's agent raised on an empty error file (a survivor SIGTERMed while writing it)
    and the launcher once reported that as bad input (exit 2): now it is a restart."""
    task = ["--task", str(REPO / "tests" / "dist" / "tasks" / "torn_error_file_task.py")
            + ":build_task"]  # fmt: skip
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, *task, "--max-steps", "4", "--max-restarts", "1",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    [recovery] = summary_of(out)["recoveries"]
    assert recovery["cause"] == "death" and recovery["rank"] == 0
    assert_no_orphans(out)


@stress_only  # make test's budget: every make stress round runs it
def test_a_restart_that_fails_again_before_its_checkpoint_is_still_reported(tmp_path, clean_hash):
    """Rank 1 dies at step 6, and again at the first step of the restarted group, before that
    attempt writes a checkpoint. The third attempt resumes from the checkpoint of step 4,
    which carries neither restart, yet summary.json lists both, and the weights are those of
    the uninterrupted run."""
    task = ["--task", str(REPO / "tests" / "dist" / "tasks" / "dies_twice_task.py") + ":build_task"]
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, *task, "--checkpoint-every", "4", "--max-restarts", "2",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of(out)
    assert summary["params_sha256"] == clean_hash
    recoveries = summary["recoveries"]
    got = [(r["attempt"], r["step"], r["cause"], r["rank"], r["failed_step"]) for r in recoveries]
    assert got == [(1, 4, "death", 1, 6), (2, 4, "death", 1, 5)], recoveries
    assert recoveries[1]["resumed_s"] is not None


# In make test: the bitwise resume property's draws use no randomness in the model, so
# without this test a restart that did not restore the ranks' random streams went unseen
# (make mutants: rng-not-restored).
def test_per_rank_random_streams_continue_exactly_after_a_restart(tmp_path):
    """Dropout masks differ between ranks; each rank resumes its own RNG stream, so the
    restarted run ends with the uninterrupted run's weights. Rank 1 runs on slower hardware
    (slow:factor=2): it waits longer, and that changes nothing in the math."""
    task = ["--task", str(REPO / "tests" / "dist" / "tasks" / "dropout_task.py") + ":build_task"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli("run", *COMMON, *task, "--out", str(clean)).returncode == 0
    result = run_cli("run", *COMMON, *task, "--checkpoint-every", "4", "--max-restarts", "1",
                     "--inject", "kill:rank=0:step=10,slow:rank=1:factor=2",
                     "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert summary_of(killed)["recoveries"][0]["step"] == 8
    assert summary_of(killed)["params_sha256"] == summary_of(clean)["params_sha256"]
    # Each rank's RNG file of every checkpoint still listed, nothing of pruned ones.
    index = json.loads((killed / "checkpoints" / "index.json").read_text())
    files = sorted(p.name for p in (killed / "checkpoints" / "rng").iterdir())
    assert files == sorted(f"step-{e['step']:08d}-rank{r}.pt" for e in index for r in (0, 1))


def test_hung_worker_is_detected_named_and_recovered(tmp_path, clean_hash):
    """Rank 1 stops before step 5 without dying; the watchdog names it, the group restarts.
    Meanwhile every listening socket of the run (the launcher's rendezvous store, rank 0's
    store, gloo's) is on 127.0.0.1: torch's TCPStore alone would listen on every interface."""
    hung = tmp_path / "hung"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "run", *COMMON, "--checkpoint-every", "3",
         "--max-restarts", "1", "--hang-timeout-s", "5", "--inject", "hang:rank=1:step=5",
         "--out", str(hung)],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    seen = listeners_while_running(proc, hung) if shutil.which("ss") else {"127.0.0.1:0"}
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert len(seen) >= 2 and all(a.startswith("127.0.0.1:") for a in seen), seen
    summary = summary_of(hung)
    assert summary["params_sha256"] == clean_hash
    [recovery] = summary["recoveries"]
    assert recovery["cause"] == "hang" and recovery["rank"] == 1
    assert recovery["failed_step"] == 5 and recovery["step"] == 3
    assert recovery["detected_s"] >= 5 and recovery["resumed_s"] > 0
    incidents = (hung / "logs" / "incidents.jsonl").read_text()
    assert "rank 1 did not reach the gradient all-reduce of step 5" in incidents
    assert_no_orphans(hung)


@stress_only  # make test's budget: every make stress round runs it
def test_hang_without_restarts_fails_with_a_report_not_a_stall(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, "--hang-timeout-s", "4", "--inject", "hang:rank=0:step=3",
                     "--out", str(out), timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert (
        "hang detected: rank 0 did not reach the gradient all-reduce of step 3 while rank 1 "
        "waits in it: rank 0 has been in 'starting the step' of step 3 for"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    # Never early: each report comes a whole --hang-timeout-s after its rank's last progress.
    reports = [i for i in read_jsonl(out / "logs" / "incidents.jsonl") if i["kind"] == "hang"]
    assert reports and all(r["detected_at"] - r["waited_since"] >= 4 for r in reports), reports
    assert_no_orphans(out)


@pytest.mark.parametrize(
    "damaged,log,message",
    [
        ("corrupt-checkpoint:step=6", "rank0.log", "sha256 differs"),
        # Rank 1's own state (RNG) file of step 6: rank 0's checkpoint is whole, but resuming
        # from it would give rank 1 another random stream. Every rank skips it together.
        pytest.param(
            "corrupt-checkpoint:step=6:rank=1",
            "rank1.log",
            "sha256 does not match",
            marks=stress_only,
        ),  # every make stress round (make test's budget)
    ],
    ids=["checkpoint", "rank-state-file"],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(
    tmp_path, clean_hash, damaged, log, message
):
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, "--checkpoint-every", "3", "--max-restarts", "1",
                     "--inject", f"{damaged},kill:rank=0:step=8",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of(out)
    assert summary["params_sha256"] == clean_hash
    [recovery] = summary["recoveries"]
    assert recovery["step"] == 3 and recovery["skipped_checkpoints"] == 1
    assert recovery["lost_steps"] == 4
    assert message in (out / "logs" / log).read_text()
    assert_no_orphans(out)


def test_node_lost_mid_epoch_survivors_train_each_sample_once(tmp_path):
    """Three nodes under fsdp; node 2 is lost. The survivors re-form a world of two, load the
    checkpoint all three wrote as shards (DCP reshards it 3 -> 2), and every sample of the
    epoch is trained once."""
    out = tmp_path / "run"  # one run directory on a file system all "nodes" share
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3",
            "--strategy", "fsdp", "--checkpoint-every", "2", "--keep-checkpoints", "100",
            "--log-sample-ids", "--dataset", "digits",
            "--num-samples", "600", "--batch-size", "8", "--epochs", "1",
            "--inject", "killnode:rank=2:step=8", "--timeout-s", "60",
            "--rdzv-last-call-s", "5", "--rdzv-keep-alive-s", "2",
            "--out", str(out)]  # fmt: skip
    nodes = start_local_nodes(3, args, "elastic-test")
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert nodes[2].returncode == -9  # the lost node
    assert [nodes[0].returncode, nodes[1].returncode] == [0, 0], outputs[:2]
    summary = summary_of(out)
    [recovery] = summary["recoveries"]
    assert recovery["world_size"] == 2 and summary["world_size"] == 2
    # Nodes 0 and 1 saw only broken collectives; the node that reported nothing is named.
    assert recovery["cause"] == "node-lost" and recovery["ranks"] == [2], recovery
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records if r["attempt"] == 0} == {0, 1, 2}
    resumed_at = {r["attempt"]: r["step"] for r in summary["recoveries"]}
    kept = [
        i
        for r in records
        if r["attempt"] + 1 not in resumed_at or r["step"] <= resumed_at[r["attempt"] + 1]
        for i in r["sample_ids"]
    ]
    assert sorted(kept) == list(range(600))
    assert summary["samples"] == 600
    resumed = summary["recoveries"][0]["step"]
    assert (out / "checkpoints" / f"step-{resumed:08d}.dcp" / "__2_0.distcp").exists()  # 3 shards
    assert summary["test_accuracy"] is not None
    assert_no_orphans(out)


# A world of another size after a failure: make test has the lost node's (3 -> 2).
@stress_only  # make test's budget: every make stress round runs it
def test_a_node_joining_late_grows_the_world_in_a_new_attempt(tmp_path):
    """--nnodes 1:2: node 0 trains alone, then node 1 joins and the agents stop the healthy
    world to form one of two. Neither agent counts that as a restart (both restart counts
    stay 0), yet the two worlds are two attempts: the records say which world trained each
    step, the growth is a recovery with cause node-joined, and the steps kept (each attempt's
    up to where the next resumed) train every sample once."""
    out = tmp_path / "run"
    task = str(REPO / "tests" / "dist" / "tasks" / "waits_for_company_task.py") + ":build_task"
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "0",
            "--task", task, "--dataset", "digits", "--num-samples", "600", "--batch-size", "8",
            "--epochs", "1", "--checkpoint-every", "2", "--log-sample-ids",
            "--hang-timeout-s", "600", "--timeout-s", "60", "--rdzv-last-call-s", "1",
            "--out", str(out)]  # fmt: skip
    [alone] = start_local_nodes(1, args, "growth")
    deadline = time.monotonic() + 120
    while not any(r["step"] >= 4 for r in read_jsonl(out / "metrics.jsonl")):
        assert alone.poll() is None, alone.communicate()
        assert time.monotonic() < deadline, "node 0 did not train alone"
        time.sleep(0.1)
    [joiner] = start_local_nodes(2, args, "growth", port=alone.rdzv_port, first=1)
    outputs = [p.communicate(timeout=240) for p in (alone, joiner)]
    assert [alone.returncode, joiner.returncode] == [0, 0], outputs
    summary = summary_of(out)
    [recovery] = summary["recoveries"]
    assert recovery["attempt"] == 1 and recovery["cause"] == "node-joined", recovery
    assert recovery["world_size"] == 2 and recovery["step"] == 4, recovery
    records = read_jsonl(out / "metrics.jsonl")
    assert {r["rank"] for r in records if r["attempt"] == 0} == {0}
    assert max(r["step"] for r in records if r["attempt"] == 0) == 4
    assert {r["rank"] for r in records if r["attempt"] == 1} == {0, 1}
    kept = [i for r in records if r["attempt"] == 1 or r["step"] <= recovery["step"]
            for i in r["sample_ids"]]  # fmt: skip
    assert sorted(kept) == list(range(600))
    assert_no_orphans(out)


@stress_only  # 15-24 s; every make stress round runs it
def test_nodes_without_a_shared_run_directory_are_told_so_on_restart(tmp_path):
    """Two nodes, each with its own --out: after a restart only node 0 finds the checkpoint.
    Resuming would split the ranks between two states; every rank stops and says why."""
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
            "--checkpoint-every", "2", "--max-steps", "8", "--inject", "kill:rank=1:step=5",
            "--timeout-s", "60"]  # fmt: skip
    outs = [tmp_path / f"node{i}" for i in range(2)]
    nodes = start_local_nodes(2, args, "unshared", [["--out", str(o)] for o in outs])
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], outputs
    assert "same --out on a shared file system" in outputs[0][1], outputs[0][1]
    assert "Traceback" not in outputs[0][1]
    assert not (outs[0] / "summary.json").exists()


@stress_only  # make test's budget: every make stress round runs it
def test_a_node_whose_peer_ended_the_job_reports_its_own_failure_not_the_rendezvous(tmp_path):
    """torch's agents can count restarts left differently: a restart that a node makes because
    a peer waits to rejoin is not counted. Made certain here: rank 0 hangs before step 5 (so
    its agent sees node 1 waiting before any failure of its own) and rank 1 dies there. The
    restarted world fails on both nodes (each has its own --out); node 1, out of restarts,
    ends the job and closes the rendezvous, which node 0's next restart finds closed. Node 0
    must still say why its workers failed, not blame the rendezvous."""
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
            "--checkpoint-every", "2", "--max-steps", "8", "--hang-timeout-s", "200",
            "--inject", "kill:rank=1:step=5,hang:rank=0:step=5", "--timeout-s", "60"]  # fmt: skip
    outs = [tmp_path / f"node{i}" for i in range(2)]
    nodes = start_local_nodes(2, args, "ended", [["--out", str(o)] for o in outs])
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], outputs
    node0 = outputs[0][1]
    assert "ended by another node's agent" in node0, node0
    assert "same --out on a shared file system" in node0, node0
    assert "rendezvous at" not in node0 and "Traceback" not in node0, node0
    assert "same --out on a shared file system" in outputs[1][1], outputs[1][1]
    for out in outs:
        assert_no_orphans(out)
