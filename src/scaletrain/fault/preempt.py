"""Preemption: a cluster that takes a job away warns it first (SLURM's --signal sends SIGUSR1
or SIGTERM some time before the end, Kubernetes SIGTERM and terminationGracePeriodSeconds).
The launcher turns that signal into a request in the run directory, logs/preempt.json; every
--preempt-check-every steps the workers agree whether some rank sees it (lifecycle.py), and
if so all finish the step they are in, write one synchronous checkpoint and leave; the
launcher then exits with PREEMPTED_EXIT_CODE. Running the same command again resumes the job
from that checkpoint (launch/jobs.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.io import atomic_write_json, read_json

PREEMPT_FILE = "preempt.json"  # under logs/
PREEMPTED_EXIT_CODE = 3  # distinct from success (0), failures (1), bad input (2), hangs (75)


def preempt_path(run_dir: Path) -> Path:
    return run_dir / "logs" / PREEMPT_FILE


def request_preemption(run_dir: Path, signal_name: str) -> None:
    path = preempt_path(run_dir)
    if not path.exists():
        atomic_write_json(path, {"signal": signal_name, "requested_at": time.time()})


def preemption_request(run_dir: Path) -> dict[str, object] | None:
    """The request the launcher wrote, or None."""
    return read_json(preempt_path(run_dir))
