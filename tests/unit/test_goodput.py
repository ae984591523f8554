"""The job's time from its records alone: what was kept, what was redone, and where the rest
went, across a restart and two job runs. No process started."""

from __future__ import annotations

import pytest

from scaletrain.metrics.goodput import job_time


def step(rank, step_, end, attempt=0, job_run=0, step_s=1.0, checkpoint_s=0.0, **extra):
    return {"rank": rank, "step": step_, "unix_time": end, "step_s": step_s, "attempt": attempt,
            "job_run": job_run, "checkpoint_s": checkpoint_s, **extra}  # fmt: skip


def test_a_restart_and_a_resume_itemized():
    # Job run 0 starts at 100; the first step begins at 102 (2 s startup). Steps 1-4 of
    # attempt 0 on two ranks side by side, step 4 checkpoints for 0.5 s; step 5 dies.
    records = [step(r, s, 102 + s, checkpoint_s=0.5 if s == 4 else 0.0)
               for r in (0, 1) for s in range(1, 5)]  # fmt: skip
    # Attempt 1 resumes from the checkpoint of step 4 (the death detected 1 s after the last
    # step) and records steps 5 and 6 from 110; the machine is then lost at 112.5 (the job
    # run ends). Job run 1 starts at 130 and, from the same checkpoint, trains 5-7 again:
    # attempt 1's steps 5 and 6 were thrown away.
    records += [step(r, 5, 111, attempt=1) for r in (0, 1)]
    records += [step(r, 6, 112, attempt=1) for r in (0, 1)]
    records += [step(r, s, 128 + s, attempt=2, job_run=1) for r in (0, 1) for s in (5, 6, 7)]
    job_runs = [
        {"job_run": 0, "started_at": 100.0}, {"job_run": 0, "ended_at": 112.5},
        {"job_run": 1, "started_at": 130.0},
    ]  # fmt: skip
    recoveries = [{"kind": "restart", "detected_s": 1.0}, {"kind": "resume", "detected_s": None}]
    job = job_time(records, job_runs, recoveries, end=136.0)
    assert job["wall_s"] == 36.0 and job["job_runs"] == 2
    lost = job["lost"]
    # Kept: steps 1-4 (4 s, less 0.5 s of checkpoint) and attempt 2's 5-7 (3 s).
    assert job["kept_s"] == pytest.approx(3.5 + 3.0)
    assert lost["checkpoint_s"] == pytest.approx(0.5)
    assert lost["redone_s"] == pytest.approx(2.0)  # attempt 1's steps 5 and 6
    assert lost["startup_s"] == pytest.approx(2.0 + 2.0)  # 100 -> 102, 130 -> 132
    assert lost["between_job_runs_s"] == pytest.approx(130.0 - 112.5)
    assert lost["finish_s"] == pytest.approx(136.0 - 135.0)
    # The rest: from the last step of attempt 0 (106) to attempt 1's first (110), of which
    # 1 s detection; and 0.5 s after attempt 1's last step before the job run ended.
    assert lost["failure_detection_s"] == pytest.approx(1.0)
    assert lost["restart_s"] == pytest.approx(4.0 - 1.0 + 0.5)
    assert lost["between_steps_s"] == pytest.approx(0.0)  # the steps follow each other
    assert job["kept_s"] + sum(lost.values()) == pytest.approx(job["wall_s"])
    assert job["goodput"] == pytest.approx(6.5 / 36.0)


def test_a_push_the_servers_did_not_apply_is_lost_time():
    records = [step(0, 1, 11, committed=True), step(0, 2, 12, committed=False)]
    job = job_time(records, [{"job_run": 0, "started_at": 10.0}], [], end=12.0)
    assert job["kept_s"] == 1.0 and job["lost"]["redone_s"] == 1.0


def test_without_a_job_record_the_job_starts_at_its_first_step():
    job = job_time([step(0, 1, 11)], [], [], end=11.0)
    assert job["wall_s"] == 1.0 and job["goodput"] == 1.0


def test_a_rank_waiting_while_rank_0_writes_is_not_training():
    """Step 4: rank 0 writes the checkpoint for 0.5 s; rank 1, done at 104, starts step 5 and
    waits in its all-reduce until rank 0 joins at 104.5. The 0.5 s is checkpoint time."""
    records = [
        step(0, 4, 104.5, step_s=1.5, checkpoint_s=0.5), step(1, 4, 104.0),
        step(0, 5, 105.5), step(1, 5, 105.5, step_s=1.5),
    ]  # fmt: skip
    job = job_time(records, [{"job_run": 0, "started_at": 103.0}], [], end=105.5)
    assert job["lost"]["checkpoint_s"] == pytest.approx(0.5)
    assert job["kept_s"] == pytest.approx(2.0)


def test_a_run_without_a_fault_loses_no_time_to_restarts():
    """The loop's own time between steps (here 0.25 s after each of 4 steps on 2 ranks) is
    named as such; a run that never failed reports no restart (it once said "restart 0.3 s"
    of a 32-rank run without a fault)."""
    records = [step(r, s, 101 + 1.25 * s, step_s=1.0) for r in (0, 1) for s in range(1, 5)]
    job = job_time(records, [{"job_run": 0, "started_at": 100.0}], [], end=106.5)
    lost = job["lost"]
    assert lost["restart_s"] == 0.0 and lost["failure_detection_s"] == 0.0
    assert lost["between_steps_s"] == pytest.approx(3 * 0.25)
    assert job["kept_s"] + sum(lost.values()) == pytest.approx(job["wall_s"])
