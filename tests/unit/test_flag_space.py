"""The flag-space fuzzer, refusals half: many random combinations of the flags (strategy,
world size, --tp, --recovery, --precision, --grad-accum, --clip-grad-norm, the schedule,
--eval-every, --compile, --activation-checkpointing, --balance, --compression, checkpoints,
batch size, --max-steps, model, dataset, and each strategy's own) go through the command
line's every pre-start check (``scaletrain run ... --dry-run``, in this process: nothing
starts). Each is accepted (exit 0), or refused with exit 2 and "error:" naming a flag the draw
set; never a traceback or another exit status. The accepted ones are what the training half
(tests/dist/test_flag_space.py) runs for real.

``make test`` checks a fixed set of draws (hypothesis, derandomized); ``make stress`` new
ones each round (SCALETRAIN_STRESS_SEED).
"""

from __future__ import annotations

import os
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletrain.cli import run_command
from scaletrain.config import leaf_fields
from tests.flagspace import argv, draw

STRESS = bool(os.environ.get("SCALETRAIN_STRESS_SEED"))
# What a refusal may name besides a leaf: the pieces of one flag's value.
ALIASES = {"join token": "join_token_file"}


def named_flags(message: str) -> set[str]:
    """The config leaves a refusal names ("field: why", parts joined by "; ")."""
    names = set(re.findall(r"(?:^|; )([a-z_ ]+): ", message))
    return {ALIASES.get(n, n) for n in names} & set(leaf_fields())


def check(d: dict, capsys) -> int:
    code = run_command(["run", *argv(d), "--out", "/nonexistent/never-written", "--dry-run"])
    err = capsys.readouterr().err
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("scaletrain: error: "), err
        names = named_flags(err.removeprefix("scaletrain: error: "))
        assert names, f"the refusal names no flag: {err}"
        assert names & (set(d) | {"out"}), f"names {names}, none of them drawn: {err}"
    return code


@settings(max_examples=1000 if STRESS else 300, deadline=None, database=None,
          derandomize=not STRESS, suppress_health_check=list(HealthCheck))  # fmt: skip
@given(seed=st.integers(0, 2**32 - 1))
def test_every_combination_is_accepted_or_refused_naming_a_flag(seed, capsys):
    check(draw(random.Random(seed)), capsys)


def test_the_checks_can_fail(capsys):
    """Not vacuous: a refusal that names no drawn flag, or a traceback, fails the check."""
    with pytest.raises(AssertionError, match="none of them drawn"):
        check({"strategy": "ps", "nproc_per_node": 1}, capsys)  # "num_servers: ..." not drawn
