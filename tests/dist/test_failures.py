"""A worker that fails: the launcher names the rank and the reason, stops the rest, leaves
no process behind, and never hangs."""

from __future__ import annotations

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
