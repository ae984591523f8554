"""The job's runs as the run directory records them (logs/job_runs.jsonl): which job run is
the current one and the number of its first attempt. Node 0's launcher writes the line
before the rendezvous (launch/jobs.py); every process reads it here, so all nodes' workers
label their records alike even when another node started first."""

from __future__ import annotations

from pathlib import Path

from scaletrain.io import read_jsonl


def job_runs_path(run_dir: Path) -> Path:
    return run_dir / "logs" / "job_runs.jsonl"


def current_job_run(run_dir: Path) -> tuple[int, int]:
    """(job run, its first attempt number) of the latest job run started; (0, 0) before any."""
    started = [j for j in read_jsonl(job_runs_path(run_dir)) if "started_at" in j]
    if not started:
        return 0, 0
    return int(started[-1]["job_run"]), int(started[-1]["attempt_base"])
