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


def test_a_rank_the_agent_stopped_is_not_named_for_the_rank_that_died(tmp_path):
    """Rank 2 was SIGKILLed. Rank 0's collective failed first and its error file says so (a
    symptom); rank 1 was SIGTERMed by the agent before it could write one. Neither error file
    names rank 2, so the exit codes must: only -SIGKILL is a cause. The agent's own report
    (its earliest failure, rank 0) is where the death record starts."""
    import signal

    from scaletrain.launch.agent import _DeathRecorder
    from scaletrain.metrics.logs import take_exit_codes, tolerate_unreadable_error_files

    tolerate_unreadable_error_files()
    take_exit_codes()  # none left from elsewhere in this process
    errors = tmp_path / "logs" / "errors"
    errors.mkdir(parents=True)
    symptom = {"message": {"message": "RuntimeError: Connection closed by peer",
                           "extraInfo": {"timestamp": "5"}}}  # fmt: skip
    (errors / "rank0.json").write_text(json.dumps(symptom))
    for rank, code in ((0, 1), (1, -signal.SIGTERM), (2, -signal.SIGKILL)):
        ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                       error_file=str(errors / f"rank{rank}.json"))  # fmt: skip

    class Logs:
        ranks = {0: 0, 1: 1, 2: 2}

    recorder = _DeathRecorder(tmp_path, Logs())
    assert recorder.root_causes(0, take_exit_codes()) == [2]
    assert take_exit_codes() == {}  # taken once per failure
    # When the agent stopped every candidate (a SIGTERM from outside), none is dropped.
    for rank in (1, 2):
        ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=-signal.SIGTERM,
                       error_file=str(errors / f"rank{rank}.json"))  # fmt: skip
    assert recorder.root_causes(0, take_exit_codes()) == [1, 2]


def test_a_rank_whose_store_went_away_is_a_symptom_of_the_rank_that_hosted_it(tmp_path):
    """Rank 0 (host of the worker store) dies leaving an empty error file while rank 1 is in
    the group's rendezvous: rank 1's store client raises, and exits before the agent stops
    it. Rank 0 is the cause, whichever the agent reported."""
    from scaletrain.launch.agent import _DeathRecorder
    from scaletrain.metrics.logs import take_exit_codes, tolerate_unreadable_error_files

    tolerate_unreadable_error_files()
    take_exit_codes()
    errors = tmp_path / "logs" / "errors"
    errors.mkdir(parents=True)
    (errors / "rank0.json").write_text("")
    store_gone = "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection "
    store_gone += "was likely closed. Did the remote server shutdown or crash?"
    (errors / "rank1.json").write_text(json.dumps(
        {"message": {"message": store_gone, "extraInfo": {"timestamp": "5"}}}
    ))  # fmt: skip
    for rank in (0, 1):
        ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1,
                       error_file=str(errors / f"rank{rank}.json"))  # fmt: skip

    class Logs:
        ranks = {0: 0, 1: 1}

    assert _DeathRecorder(tmp_path, Logs()).root_causes(1, take_exit_codes()) == [0]
