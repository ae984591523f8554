"""Every flag applies in every mode, or is refused before any process starts.

The matrix: each mode (restart, inplace, ps) x each fault-tolerance and run-length flag. A
refused cell must be refused by the launcher's own pre-start checks (``describe_plan``, which
``scaletrain run --dry-run`` prints and ``run`` calls first) with a message that names the mode.
A cell that works must name the end-to-end test that runs that flag in that mode, and that
test must exist and pass the flag: a claim without a test is not a claim.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch import describe_plan
from scaletrain.launch.modes import mode_of
from tests.conftest import REPO, run_cli

MODES = {
    "restart": ({}, None),
    "inplace": ({"recovery": "inplace"}, "--recovery inplace"),
    "ps": ({"strategy": "ps", "nproc_per_node": 3, "num_servers": 1}, "--strategy ps"),
}
FLAGS = {
    "checkpoint-every": {"checkpoint_every": 5},
    "checkpoint-async": {"checkpoint_every": 5, "checkpoint_async": True},
    "hang-timeout": {"hang_timeout_s": 6.0},
    "max-steps": {"max_steps": 10},
    "inject kill": {"inject": "kill:rank=1:step=5"},
    "inject hang": {"inject": "hang:rank=1:step=5"},
    "inject slow": {"inject": "slow:rank=1:factor=2"},
    "inject corrupt": {"inject": "corrupt-checkpoint:step=5", "checkpoint_every": 5},
    "eval": {},  # the test set scored at the end: no flag, every mode reports test_accuracy
}
RECOVERY = "tests/dist/test_recovery.py::"
INPLACE = "tests/dist/test_inplace.py::"
PS = "tests/dist/test_param_server.py::"
REFUSED = "refused"
# (mode, flag) -> REFUSED, or (the test that runs it end to end, text that test must contain).
CELLS: dict[tuple[str, str], str | tuple[str, str]] = {
    ("restart", "checkpoint-every"): (
        RECOVERY + "test_killed_worker_restarts_from_checkpoint_with_identical_weights",
        '"--checkpoint-every"',
    ),
    ("restart", "checkpoint-async"): (
        RECOVERY + "test_killed_worker_restarts_from_checkpoint_with_identical_weights",
        '"--checkpoint-async"',
    ),
    ("restart", "hang-timeout"): (
        RECOVERY + "test_hung_worker_is_detected_named_and_recovered",
        '"--hang-timeout-s"',
    ),
    ("restart", "max-steps"): (
        RECOVERY + "test_an_empty_error_file_is_a_death_like_any_other_and_the_job_restarts",
        '"--max-steps"',
    ),
    ("restart", "inject kill"): (
        RECOVERY + "test_killed_worker_restarts_from_checkpoint_with_identical_weights",
        '"kill:rank=1:step=8"',
    ),
    ("restart", "inject hang"): (
        RECOVERY + "test_hung_worker_is_detected_named_and_recovered",
        '"hang:rank=1:step=5"',
    ),
    ("restart", "inject slow"): (
        RECOVERY + "test_per_rank_random_streams_continue_exactly_after_a_restart",
        "slow:rank=1:factor=2",
    ),
    ("restart", "inject corrupt"): (
        RECOVERY + "test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one",
        "corrupt-checkpoint",
    ),
    ("restart", "eval"): (
        RECOVERY + "test_node_lost_mid_epoch_survivors_train_each_sample_once",
        '"test_accuracy"',
    ),
    ("inplace", "checkpoint-every"): REFUSED,  # nothing is rolled back: no checkpoints
    ("inplace", "checkpoint-async"): REFUSED,
    ("inplace", "hang-timeout"): (
        "tests/e2e/test_netns.py::test_inplace_across_three_hosts_survives_a_dead_host_then_a_cut_cable",
        '"--hang-timeout-s"',
    ),
    ("inplace", "max-steps"): (
        INPLACE + "test_max_steps_ends_every_replica_at_that_step",
        '"--max-steps"',
    ),
    ("inplace", "inject kill"): (
        INPLACE + "test_survivors_continue_and_a_restarted_worker_rejoins",
        "kill:rank=1:step=10",
    ),
    ("inplace", "inject hang"): REFUSED,  # measured: the job never ended
    ("inplace", "inject slow"): (
        INPLACE + "test_survivors_continue_and_a_restarted_worker_rejoins",
        "slow:rank=0:factor=6",
    ),
    ("inplace", "inject corrupt"): REFUSED,
    ("inplace", "eval"): (
        INPLACE + "test_survivors_continue_and_a_restarted_worker_rejoins",
        '"test_accuracy"',
    ),
    # The servers checkpoint every N of their updates.
    ("ps", "checkpoint-every"): (
        PS + "test_ssp_server_killed_restarts_from_its_checkpoint",
        '"--checkpoint-every"',
    ),
    # They always write in the background: the flag would ask for nothing.
    ("ps", "checkpoint-async"): REFUSED,
    ("ps", "hang-timeout"): REFUSED,  # --barrier-timeout-s and --timeout-s drop silent peers
    ("ps", "max-steps"): (PS + "test_bsp_equals_synchronous_data_parallel", '"--max-steps"'),
    ("ps", "inject kill"): (
        PS + "test_asp_worker_killed_others_continue_and_its_data_is_trained_once",
        '"kill:',
    ),
    ("ps", "inject hang"): REFUSED,  # measured: the job never ended
    ("ps", "inject slow"): (PS + "test_ssp_bound_holds_end_to_end", '"slow:rank=0:factor=3"'),
    ("ps", "inject corrupt"): REFUSED,  # the servers keep checkpoints of their own
    ("ps", "eval"): (
        PS + "test_ssp_server_killed_restarts_from_its_checkpoint",
        '"test_accuracy"',
    ),
}


def config(mode: str, flag: str) -> RunConfig:
    cfg = with_overrides(RunConfig(), {**MODES[mode][0], **FLAGS[flag]})
    assert mode_of(cfg) == mode
    return cfg


@cache
def source_of(node_id: str) -> str:
    """The test function's source, its decorators (parametrize) included."""
    path, name = node_id.split("::")
    text = (REPO / path).read_text()
    [func] = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name]
    first = min([func.lineno] + [d.lineno for d in func.decorator_list])
    return "\n".join(text.splitlines()[first - 1 : func.end_lineno])


def test_the_matrix_is_whole():
    assert set(CELLS) == {(m, f) for m in MODES for f in FLAGS}


@pytest.mark.parametrize(("mode", "flag"), sorted(CELLS))
def test_every_cell_works_or_is_refused_before_start(mode, flag):
    cell = CELLS[(mode, flag)]
    cfg = config(mode, flag)
    if cell == REFUSED:
        with pytest.raises(ValueError, match=MODES[mode][1]):
            describe_plan(cfg)
        return
    describe_plan(cfg)  # accepted by every pre-start check
    node_id, text = cell
    assert Path(REPO / node_id.split("::")[0]).exists(), node_id
    assert text in source_of(node_id), f"{node_id} does not run {flag} ({text})"


def test_a_refused_flag_is_the_users_mistake_and_nothing_starts(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--recovery", "inplace", "--checkpoint-every", "5",
                     "--inject", "hang:rank=1:step=3", "--out", str(out))  # fmt: skip
    assert result.returncode == 2
    assert "error:" in result.stderr and "--recovery inplace" in result.stderr
    assert "checkpoint_every" in result.stderr and "hang" in result.stderr  # both, at once
    assert "Traceback" not in result.stderr
    assert not out.exists()
