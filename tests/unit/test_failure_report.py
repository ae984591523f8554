"""The launcher's failure paragraph names the rank that caused the failure, not its victims."""

from __future__ import annotations

import json
import os

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from scaletrain.metrics.logs import describe_failure


def failure(tmp_path, rank, message, mtime_ns):
    path = tmp_path / f"rank{rank}.json"
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "5"}}}))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_cause_is_named_before_symptoms_in_the_same_second(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank1.log").write_text("line a\nValueError: bad batch\n")
    failures = {
        # rank 0's symptom was written first, within the same second as rank 1's cause
        0: failure(tmp_path, 0, "RuntimeError: Read error: Connection reset by peer", 1_000),
        1: failure(tmp_path, 1, "ValueError: bad batch", 2_000),
    }
    text = describe_failure(failures, tmp_path)
    assert text.startswith("rank 1 failed (exit code 1): ValueError: bad batch.")
    assert "Other ranks: rank 0: RuntimeError: Read error: Connection reset by peer." in text
    assert "    ValueError: bad batch" in text  # the log's last lines


def test_earliest_cause_wins_among_causes(tmp_path):
    (tmp_path / "logs").mkdir()
    failures = {
        0: failure(tmp_path, 0, "KeyError: 'x'", 2_000),
        1: failure(tmp_path, 1, "ValueError: first", 1_000),
    }
    assert describe_failure(failures, tmp_path).startswith("rank 1 failed")


def test_a_rank_stopped_by_the_agent_is_a_victim(tmp_path):
    (tmp_path / "logs").mkdir()
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file="<N/A>")
    cause = failure(tmp_path, 1, "RuntimeError: user model exploded", 10**20)
    text = describe_failure({0: stopped, 1: cause}, tmp_path)
    assert text.startswith("rank 1 failed (exit code 1): RuntimeError: user model exploded.")
    assert "rank 0: killed by SIGTERM" in text
