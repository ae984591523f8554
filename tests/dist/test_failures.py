"""A worker that fails: the launcher names the rank and the reason, stops the rest, leaves
no process behind, and never hangs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scaletrain
from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch import WorkerFailed
from tests.conftest import assert_no_orphans

TASK = str(Path(__file__).parent / "tasks" / "raising_task.py") + ":build_task"


@pytest.mark.timeout(60)
def test_user_model_raising_on_one_rank(tmp_path):
    cfg = with_overrides(
        RunConfig(),
        {"out": str(tmp_path / "run"), "nproc_per_node": 2, "task": TASK, "epochs": 1},
    )
    with pytest.raises(WorkerFailed) as info:
        scaletrain.run(cfg, show_progress=False)
    message = str(info.value)
    assert message.startswith(
        "rank 1 failed (exit code 1): RuntimeError: user model exploded on rank 1"
    )
    assert "rank1.log" in message
    assert not (tmp_path / "run" / "summary.json").exists()
    assert_no_orphans(tmp_path / "run")


def _blocked_dead_or_symptom(run_dir: str) -> None:
    """Local rank 2 is SIGKILLed; rank 1's collective fails once rank 2 is gone (a symptom);
    rank 0 is still blocked in its collective when the agent notices (no error file yet)."""
    import os
    import signal
    import time

    from scaletrain.runtime import unblock_group_signals

    unblock_group_signals()  # as every process forked from the fork server does first
    marks = Path(run_dir) / "marks"
    rank = int(os.environ["LOCAL_RANK"])
    if rank == 2:
        (marks / "victim").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    while rank == 0 or not (marks / "victim").exists():
        time.sleep(0.01)  # rank 0 forever: the agent stops it
    victim = int((marks / "victim").read_text())
    while Path(f"/proc/{victim}").exists():  # reaped: dead to the agent too
        time.sleep(0.01)
    raise RuntimeError("Connection closed by peer [127.0.0.1]:35714")


def test_a_rank_torch_stopped_when_another_died_is_not_named_for_the_dead_one(tmp_path):
    """Forked workers (torch's MultiprocessContext) are reported one failure at a time, and
    torch SIGTERMs the rest before the agent logs it: a rank that was blocked in a
    collective then has no error file, like a SIGKILLed one. Only the rank that died is."""
    from torch.distributed.elastic.multiprocessing import start_processes

    from scaletrain.launch import forkserver
    from scaletrain.launch.agent import record_worker_deaths
    from scaletrain.metrics.logs import RunLogsSpecs, tolerate_unreadable_error_files

    tolerate_unreadable_error_files()
    (tmp_path / "marks").mkdir()
    logs = RunLogsSpecs(tmp_path)
    envs = {r: {"RANK": str(10 + r), "LOCAL_RANK": str(r)} for r in range(3)}
    with record_worker_deaths(tmp_path, logs):
        context = start_processes(
            "victim", _blocked_dead_or_symptom, {r: (str(tmp_path),) for r in range(3)},
            envs, logs, start_method=forkserver.START_METHOD,
        )  # fmt: skip
        result = context.wait(timeout=60)
    assert result is not None and result.is_failed()
    [death] = [json.loads(line) for line in (tmp_path / "logs" / "incidents.jsonl").open()]
    assert death["ranks"] == [12], death
