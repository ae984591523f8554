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
from scaletrain.launch.modes import INPLACE_STRATEGIES
from tests.flagspace import COMPRESSIONS, DOCUMENTED, FIXED, argv, draw

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


# The modes a value is checked in: the mode's own settings win over a value's needs.
MODE_BASES = {
    "restart": {"nproc_per_node": 2},
    "inplace": {"nproc_per_node": 2, "recovery": "inplace"},
    "ps": {"strategy": "ps", "nproc_per_node": 3, "num_servers": 1},
}
# (mode, key, value or None for every value) -> what the refusal says: the cells the modes
# table (launch/modes.py) and the strategies' own checks refuse. Every other documented
# value, alone with what it needs, must be accepted in every mode.
REFUSED_ALONE = {
    ("inplace", "nnodes", "1:2"): "inplace recovery starts a fixed set of replicas",
    ("inplace", "inject", "corrupt-checkpoint:step=3"): "a checkpoint is read only when",
    ("inplace", "compression", "powersgd:rank=2"): "carries fp16 and bf16 gradients",
    ("inplace", "compression", "topk:ratio=0.1"): "carries fp16 and bf16 gradients",
    ("inplace", "compression", "sign"): "carries fp16 and bf16 gradients",
    ("ps", "nnodes", "1:2"): "a parameter server job has a fixed set of processes",
    ("ps", "recovery", "inplace"): "the parameter server recovers its own way",
    ("ps", "checkpoint_async", True): "always write their checkpoints in the background",
    ("ps", "checkpoint_every", "auto"): "auto sets the training loop's interval",
    ("ps", "mtbf_s", 60.0): "auto sets the training loop's interval",
    ("ps", "inject", "corrupt-checkpoint:step=3"): "the servers keep their own",
    ("ps", "balance", "speed"): "balance: under --strategy ps",
    ("ps", "balance_every", 2): "balance: under --strategy ps",
    ("ps", "nproc_per_node", 1): "leave no worker",
    ("ps", "precision", "fp16-mixed"): "needs a loss scaler",
    **{("ps", "compression", c): "does not use gradient hooks" for c in COMPRESSIONS},
}


def mode_of(chosen: dict) -> str:
    if chosen.get("strategy") == "ps":
        return "ps"
    return "inplace" if chosen.get("recovery") == "inplace" else "restart"


def expected_refusal(mode: str, key: str, value: object, chosen: dict) -> str | None:
    """What the refusal of ``chosen`` must say, or None where it must be accepted."""
    if mode == "inplace" and chosen.get("strategy", "ddp") not in INPLACE_STRATEGIES:
        return "--recovery inplace runs data parallel training"
    if mode == "inplace" and chosen.get("strategy") == "fsdp" and not chosen.get("replica_size"):
        return "--strategy fsdp recovers whole replica groups"
    return REFUSED_ALONE.get((mode, key, value))


def alone_cases() -> list[tuple[str, str, object, dict]]:
    """(mode, key, value, config) for every documented value in every mode it applies to:
    the value and what it needs over the mode's settings, where they keep that mode (a
    value that needs the parameter server is not checked under --recovery inplace)."""
    cases = []
    for mode, base in MODE_BASES.items():
        for key, values in DOCUMENTED.items():
            for value, needs in values:
                chosen = {**base, **needs, key: value}
                if mode_of(chosen) == mode:
                    cases.append((mode, key, value, chosen))
    return cases


def test_every_documented_value_alone_is_accepted_where_its_mode_supports_it(capsys):
    """Each key, each value its help documents, with what it needs, in each mode: refused
    only where the modes table says so (naming the key), accepted everywhere else. A wrong
    refusal (a valid flag refused before start) fails here, which the refusals half cannot
    see: a refusal naming a drawn flag passes there."""
    wrong = []
    for mode, key, value, chosen in alone_cases():
        code = run_command(["run", *argv(chosen), "--out", "/nonexistent/never", "--dry-run"])
        err = capsys.readouterr().err
        expected = expected_refusal(mode, key, value, chosen)
        if expected is None and code != 0:
            wrong.append(f"{mode}: --{key} {value} refused: {err.strip()}")
        elif expected is not None and (code != 2 or expected not in err):
            wrong.append(f"{mode}: --{key} {value} expected refused ({expected!r}): {code} {err}")
    assert not wrong, "\n".join(wrong)


def test_every_configuration_key_is_drawn_or_fixed_for_a_reason():
    """A new key of RunConfig fails here until it is in DOCUMENTED (with its values, so
    the fuzzer draws it and the check above checks it) or in FIXED (with why not)."""
    keys = set(leaf_fields())
    assert set(DOCUMENTED) | set(FIXED) == keys, sorted(keys ^ (set(DOCUMENTED) | set(FIXED)))
    assert not set(DOCUMENTED) & set(FIXED)
    rng, seen = random.Random(0), set()
    for _ in range(3000):
        seen |= set(draw(rng))
    assert set(DOCUMENTED) <= seen, sorted(set(DOCUMENTED) - seen)


def test_the_acceptance_rate_of_draws_is_printed_and_not_collapsed(capsys):
    """The share of draws every check accepts: printed (make stress keeps it in its logs),
    and above a floor, so a check that starts refusing valid combinations shows."""
    rng, accepted, total = random.Random(20261207), 0, 400
    for _ in range(total):
        d = draw(rng)
        accepted += run_command(["run", *argv(d), "--out", "/nonexistent/x", "--dry-run"]) == 0
    capsys.readouterr()
    rate = accepted / total
    with capsys.disabled():
        print(f"\nflag-space draws accepted: {accepted} of {total} ({rate:.0%})")
    assert rate >= 0.3, rate


def test_a_pipeline_of_a_model_it_cannot_cut_is_refused_naming_the_strategy(capsys):
    """Found by a make stress round's draw: the refusal named "pipeline", no flag."""
    d = {"strategy": "pipeline", "nproc_per_node": 2, "task": "examples/tabular_task.py:build_task"}
    assert check(d, capsys) == 2
