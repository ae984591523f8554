"""A job's lifecycle, as a cluster puts it through: preempted (SIGTERM to the launcher) or
killed whole (SIGKILL to every process), then run again with the same command on the same
run directory; resumed with more workers; trained further after it finished; refused when
the math would change. Real launchers, real signals, real gloo groups on loopback."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import read_jsonl
from tests.conftest import REPO, assert_no_orphans, kill_job, run_cli, stress_only

DIGITS = 1437  # training samples of the built-in digits set
# 23 steps an epoch with 2 workers x 32; --deterministic so runs compare bit for bit.
JOB = ["--nproc-per-node", "2", "--epochs", "4", "--deterministic", "--seed", "4",
       "--num-threads", "1", "--checkpoint-every", "20", "--preempt-check-every", "2"]  # fmt: skip


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "run", *args],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def wait_for_step(out, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until rank 0 recorded ``step`` (the job is mid-run), or the test fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step and r["rank"] == 0 for r in read_jsonl(out / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs") / "clean"
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    return summary(out)


# Preemption of a run at its checkpoint, in make test: test_preempt_anytime.py (there to the
# launcher's whole process group); this one, to the launcher alone, in every make stress round.
@stress_only
def test_preempted_job_checkpoints_exits_3_and_resumes_bit_identical(tmp_path, uninterrupted):
    out = tmp_path / "run"
    # Slowed (as slower hardware: sleeps, same math) so SIGTERM lands mid-run.
    proc = start(*JOB, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 15, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "preempted by SIGTERM" in stderr and "Traceback" not in stderr
    # One synchronous checkpoint of the step every rank reached, which is the last recorded.
    records = read_jsonl(out / "metrics.jsonl")
    reached = max(r["step"] for r in records)
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    assert index[-1]["step"] == reached and reached % 2 == 0  # agreed at a check step
    assert not (out / "summary.json").exists()
    assert_no_orphans(out)
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == uninterrupted["params_sha256"]
    assert got["steps"] == uninterrupted["steps"] and got["samples"] == uninterrupted["samples"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["cause"] == "job run 0 preempted"
    assert resume["step"] == reached and resume["lost_steps"] == 0
    assert got["job_runs"] == 2 and got["time_lost"]["between_job_runs_s"] > 0
    assert 0 < got["goodput"] < 1 and got["wall_s"] > got["train_wall_s"]
    runs = read_jsonl(out / "logs" / "job_runs.jsonl")
    assert [j.get("how") for j in runs if "ended_at" in j] == ["preempted", "finished"]
    job_of = {(r["rank"], r["step"]): r["job_run"] for r in read_jsonl(out / "metrics.jsonl")}
    assert job_of[(0, 1)] == 0 and job_of[(0, got["steps"])] == 1


# A job killed whole and continued, restart mode: every make stress round (make test keeps the
# preempted job's continuation at three moments, and the in-place killed job's).
@stress_only
def test_killed_job_resumes_from_its_newest_checkpoint(tmp_path, uninterrupted):
    """Every process SIGKILLed at once (the machine went away): the same command goes on
    from the newest checkpoint, redoing the steps after it, to the same weights."""
    out = tmp_path / "run"
    proc = start(*JOB, "--inject", "slow:rank=0:factor=4", "--out", str(out))
    wait_for_step(out, 45, proc)
    kill_job(proc, out)
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == uninterrupted["params_sha256"]
    [resume] = got["recoveries"]
    assert resume["kind"] == "resume" and resume["step"] >= 40 and resume["step"] % 20 == 0
    assert "ended without a word" in resume["cause"]
    assert resume["lost_steps"] > 0 and got["time_lost"]["redone_s"] > 0


def test_resumed_with_more_workers_trains_every_sample_once(tmp_path):
    out = tmp_path / "run"
    job = [*JOB, "--log-sample-ids", "--out", str(out)]
    proc = start(*job, "--inject", "slow:rank=0:factor=4")
    wait_for_step(out, 30, proc)
    os.kill(proc.pid, signal.SIGUSR1)  # SLURM's --signal=B:USR1@T
    proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE
    result = run_cli("run", *job[2:], "--nproc-per-node", "3")
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["world_size"] == 3 and got["samples"] == 4 * DIGITS
    # Each epoch's samples once, over the job runs and the two world sizes (the preempted
    # run checkpointed the step it stopped after: nothing is redone).
    seen = collections.defaultdict(list)
    for r in read_jsonl(out / "metrics.jsonl"):
        seen[r["epoch"]] += r["sample_ids"]
    for epoch in range(4):
        assert sorted(seen[epoch]) == list(range(DIGITS)), epoch


def test_a_finished_job_trains_further_with_more_epochs(tmp_path, uninterrupted):
    out = tmp_path / "run"
    shorter = [*JOB, "--epochs", "3"]  # the last --epochs wins
    assert run_cli("run", *shorter, "--out", str(out)).returncode == 0
    again = run_cli("run", *shorter, "--out", str(out))  # a requeue after the end: no error
    assert again.returncode == 0 and "is complete" in again.stdout, again.stderr
    changed = run_cli("run", *shorter, "--lr", "0.1", "--out", str(out))
    assert changed.returncode == 2 and "resumes only with the same math" in changed.stderr
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == uninterrupted["params_sha256"]
    assert (out / "logs" / "summary.job0.json").exists()  # the first run's summary, kept


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--lr", "0.1"], "resumes only with the same math: lr: 0.05 -> 0.1"),
        (["--batch-size", "16"], "batch_size: 32 -> 16"),
        (["--model", "mlp"], "model: 'cnn' -> 'mlp'"),
        (["--recovery", "inplace", "--checkpoint-every", "0"], "recovery: 'restart' -> 'inplace'"),
    ],
)
def test_a_resume_that_changes_the_math_is_refused(tmp_path, change, message):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text(  # a job run of JOB's was started here
        "[train]\nepochs = 4\nseed = 4\ndeterministic = true\nnum_threads = 1\n"
        "[fault]\ncheckpoint_every = 20\n"
    )
    (out / "logs").mkdir()
    (out / "logs" / "job_runs.jsonl").write_text(
        '{"job_run": 0, "started_at": 1.0, "attempt_base": 0}\n'
    )
    result = run_cli("run", *JOB, *change, "--out", str(out), timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_auto_checkpoint_interval_is_agreed_and_resumes_bit_identical(tmp_path, uninterrupted):
    """--checkpoint-every auto: every rank saves at the same steps (each checkpoint in the
    index has both ranks' own files), the summary says what interval was chosen from what,
    and a worker killed mid-run resumes to the uninterrupted run's weights."""
    out = tmp_path / "run"
    job = [a for a in JOB if a not in ("--checkpoint-every", "20")]
    result = run_cli("run", *job, "--checkpoint-every", "auto", "--mtbf-s", "5",
                     "--keep-checkpoints", "100", "--max-restarts", "1",
                     "--inject", "kill:rank=1:step=50", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = summary(out)
    assert got["params_sha256"] == uninterrupted["params_sha256"]
    c = got["checkpointing"]
    assert c["mode"] == "auto" and c["saves"] >= 1 and c["interval_steps"] >= 1
    assert c["predicted_overhead"] > 0 and c["mtbf_s"] == 5
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    for entry in index:
        for rank in (0, 1):
            name = f"step-{entry['step']:08d}-rank{rank}.pt"
            assert (out / "checkpoints" / "rng" / name).exists(), (entry, rank)
    [restart] = got["recoveries"]
    assert restart["kind"] == "restart" and restart["step"] in [e["step"] for e in index]
