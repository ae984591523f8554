"""Preemption at any instant: SIGTERM or SIGUSR1 reaches ``scaletrain run`` at a moment chosen
by an event of the run (its handlers in place, the run directory written, the first step,
a checkpoint, an evaluation, the last step, summary.json), never by a sleep. Each ends with
exit 3, or 0 where the job had finished, and the same command then ends the job with the
weights of the uninterrupted run, bit for bit. Real launchers, real signals, real gloo.

At the checkpoint the signal goes to the launcher's whole process group, as SLURM (every
process of a job step), `timeout` and `kill -TERM -PGID` send it: the launcher's helpers (the
fork server every worker is forked from) get it too. The launcher still answers it
(checkpoint, exit 3), and no helper dies of it and takes the workers along (that ended the
job as a failure, exit 1, with no checkpoint of its last step)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import read_jsonl
from tests.conftest import assert_no_orphans, run_cli, stress_only
from tests.dist.test_jobs import start

# 2 workers x 16 of 320 digits: 10 steps an epoch, 20 in all; a checkpoint every 5 steps, an
# evaluation every 6, a preemption check every 4 (and after each attempt's first step).
JOB = ["--nproc-per-node", "2", "--num-samples", "320", "--batch-size", "16", "--epochs", "2",
       "--deterministic", "--seed", "5", "--num-threads", "1", "--checkpoint-every", "5",
       "--eval-every", "6", "--preempt-check-every", "4", "--width", "8"]  # fmt: skip
TOTAL_STEPS = 20


def handlers_in_place(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM (its SigCgt mask in /proc): the command line's
    first act."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def records(out: Path) -> list[dict]:
    return read_jsonl(out / "metrics.jsonl")


# moment -> (the event that marks it, the exit statuses it may end with)
MOMENTS: dict[str, tuple[Callable[[Path, int], bool], set[int]]] = {
    "start-up": (lambda out, pid: handlers_in_place(pid), {PREEMPTED_EXIT_CODE}),
    "run-directory": (lambda out, pid: (out / "config.toml").exists(), {PREEMPTED_EXIT_CODE}),
    "first-step": (lambda out, pid: bool(records(out)), {PREEMPTED_EXIT_CODE}),
    "checkpoint": (lambda out, pid: (out / "checkpoints" / "index.json").exists(),
                   {PREEMPTED_EXIT_CODE}),
    "evaluation": (lambda out, pid: any("test_accuracy" in r for r in records(out)),
                   {PREEMPTED_EXIT_CODE}),
    # After the last step's record the job may stop at its check (3) or finish (0).
    "last-step": (lambda out, pid: any(r["step"] == TOTAL_STEPS for r in records(out)),
                  {PREEMPTED_EXIT_CODE, 0}),
    "summary": (lambda out, pid: (out / "summary.json").exists(), {0}),
}  # fmt: skip
# make test sends the signal at these; make stress at every moment (SCALETRAIN_STRESS_SEED set).
QUICK = ("start-up", "checkpoint", "summary")
# Which signal each moment sends (both preemption signals in make test's three), and the
# moment whose signal goes to the launcher's whole process group.
SIGNALS = {"start-up": "SIGTERM", "run-directory": "SIGUSR1", "first-step": "SIGUSR1",
           "checkpoint": "SIGTERM", "evaluation": "SIGUSR1", "last-step": "SIGTERM",
           "summary": "SIGUSR1"}  # fmt: skip
TO_THE_GROUP = "checkpoint"


def moments() -> list[str]:
    return list(MOMENTS) if os.environ.get("SCALETRAIN_STRESS_SEED") else list(QUICK)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("anytime") / "clean"
    result = run_cli("run", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS
    return summary


@pytest.mark.parametrize("moment", moments())
def test_a_signal_at_any_moment_exits_3_or_0_and_the_job_ends_the_same(
    tmp_path, uninterrupted, moment
):
    out = tmp_path / "run"
    event, codes = MOMENTS[moment]
    name = SIGNALS[moment]
    proc = start(*JOB, "--out", str(out))  # its own session: the launcher leads the group
    deadline = time.monotonic() + 120
    while not event(out, proc.pid):
        assert proc.poll() is None, f"the run ended before {moment}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {moment} within 120 s"
        time.sleep(0.005)
    (os.killpg if moment == TO_THE_GROUP else os.kill)(proc.pid, getattr(signal, name))
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode in codes, (moment, proc.returncode, stderr)
    assert "Traceback" not in stderr
    assert_no_orphans(out)
    if proc.returncode == PREEMPTED_EXIT_CODE:
        assert f"preempted by {name}" in stderr and "same command" in stderr, stderr
        assert not (out / "summary.json").exists()
        if moment == "start-up":  # stopped before anything was written
            assert not out.exists()
    again = run_cli("run", *JOB, "--out", str(out))
    assert again.returncode == 0, again.stderr
    if proc.returncode == 0:  # finished already: the same command has nothing to do
        assert "is complete" in again.stdout, again.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["params_sha256"] == uninterrupted["params_sha256"], moment
    assert summary["steps"] == TOTAL_STEPS


@pytest.mark.parametrize(
    "mode",
    ["restart", pytest.param("ps", marks=stress_only), pytest.param("inplace", marks=stress_only)],
)
def test_signals_from_the_final_line_until_the_process_is_gone_change_nothing(tmp_path, mode):
    """The last instants: once ``run directory:`` is printed, SIGTERM and SIGUSR1 by turns,
    every millisecond until the launcher is gone. The job is complete: exit 0. (Python's
    finalization put SIGTERM's default action back, and a signal then killed it: 143.)"""
    import threading

    out = tmp_path / "run"
    extra = {"restart": [], "ps": ["--strategy", "ps", "--nproc-per-node", "3"],
             "inplace": ["--recovery", "inplace"]}[mode]  # fmt: skip
    proc = start(*JOB, *extra, "--out", str(out))
    final = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("run directory:"):
                final.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert final.wait(180), ("no final line", proc.poll(), lines[-5:])
    sent = 0
    while proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, (signal.SIGTERM, signal.SIGUSR1)[sent % 2])
            sent += 1
        time.sleep(0.001)
    _, stderr = proc.communicate(timeout=60)
    reader.join(10)
    assert proc.returncode == 0, (proc.returncode, sent, stderr[-2000:])
    assert sent > 0 and "Traceback" not in stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == TOTAL_STEPS
    assert_no_orphans(out)
