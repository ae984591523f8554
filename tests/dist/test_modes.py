"""Every flag applies in every mode, or is refused before any process starts: the matrix of
each mode (restart, inplace, ps) x each fault-tolerance, run-length and training-essentials
flag (and --balance).

A refused cell must be refused by the launcher's own pre-start checks (``describe_plan``,
which ``scaletrain run --dry-run`` prints and ``run`` calls first) with a message that names
the mode, and the command line must exit 2 without starting anything. A cell that works is
run: briefly, for real (real processes, real gloo), and its effect is checked in what the run
wrote (a checkpoint index, a recovery, the records' learning rates, ...). To keep that to a
few runs per mode, the cells that do not interfere share one run (GROUPS): each is checked
in its own output, so a flag that silently did nothing still fails its own cell.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from scaletrain.config import RunConfig, with_overrides
from scaletrain.env import STRESS_SEED
from scaletrain.io import read_jsonl
from scaletrain.launch import describe_plan
from scaletrain.launch.modes import mode_of
from tests.conftest import run_cli

MODES = {
    "restart": ({}, None),
    "inplace": ({"recovery": "inplace"}, "--recovery inplace"),
    # Local SGD in place: rounds, the quorum at each synchronization (every 2 steps here).
    "inplace-rounds": (
        {"recovery": "inplace", "strategy": "local_sgd", "sync_every": 2},
        "--recovery inplace|--strategy local_sgd",
    ),
    "ps": ({"strategy": "ps", "nproc_per_node": 3, "num_servers": 1}, "--strategy ps"),
}
# The inplace-rounds row runs its steady group in make test; its fault, compile and
# activation-checkpointing runs (the inplace row's machinery, dealt in rounds) in every
# make stress round (scripts/stress.py lists them): make test's budget. So do the inplace
# and ps rows' compile runs (23-30 s and 13 s on 2 cores, each process compiling on its own),
# and since a slow-phase make test went over budget, the restart row's (16-34 s): compile runs
# in every make stress round, in every mode.
STRESS_ONLY_GROUPS = {"inplace-rounds": {"faults", "hang", "compile", "blocks"},
                      "inplace": {"compile"}, "ps": {"compile"},
                      "restart": {"compile"}}  # fmt: skip
# 2 workers (ps: and a server), 96 digits in steps of 8 a worker: 6 steps an epoch.
BASE = {"nproc_per_node": 2, "num_samples": 96, "batch_size": 8, "model": "mlp", "width": 8,
        "epochs": 2, "seed": 1, "num_threads": 1}  # fmt: skip
FLAGS: dict[str, dict[str, Any]] = {
    "checkpoint-every": {"checkpoint_every": 2},
    "checkpoint-async": {"checkpoint_every": 2, "checkpoint_async": True},
    "hang-timeout": {"hang_timeout_s": 30.0},
    "max-steps": {"max_steps": 5},
    "inject kill": {"inject": "kill:rank=1:step=3", "max_restarts": 1},
    "inject hang": {"inject": "hang:rank=1:step=3", "hang_timeout_s": 4.0, "max_restarts": 1},
    "inject slow": {"inject": "slow:rank=1:factor=4"},
    "inject corrupt": {
        "inject": "corrupt-checkpoint:step=4,kill:rank=1:step=5",
        "checkpoint_every": 2,
        "max_restarts": 1,
    },  # fmt: skip
    "eval": {},  # the test set scored at the end: no flag, every mode reports test_accuracy
    "precision": {"precision": "bf16-mixed"},
    "grad-accum": {"grad_accum": 2},
    "clip-grad-norm": {"clip_grad_norm": 0.5},
    "lr-schedule": {"lr_schedule": "cosine", "warmup_steps": 2},
    "eval-every": {"eval_every": 2},
    "compile": {"compile": True},
    "activation-checkpointing": {"activation_checkpointing": True, "model": "transformer"},
    "balance": {"balance": "speed", "balance_every": 2},
    "compression": {"compression": "bf16"},
    # Replica groups (HSDP) of 1 rank: fsdp over 2 groups. The mode's own overrides (its
    # strategy) win over this one's (config), so ps and local SGD in place refuse it.
    "replica-size": {"strategy": "fsdp", "replica_size": 1},
    # A backup of each server's slice on the other server (the ps row runs two: WITH).
    "ps-replicas": {"ps_replicas": 1},
}
# What a cell needs beside its flag in a mode, over the mode's own overrides.
WITH = {("ps", "ps-replicas"): {"num_servers": 2, "nproc_per_node": 4}}
# (mode, flag) -> why it is refused; every other cell runs.
REFUSED = {
    ("inplace", "inject corrupt"): "a checkpoint is read only when the whole job starts again",
    ("inplace-rounds", "inject corrupt"): "as in place",
    ("inplace-rounds", "balance"): "a round is dealt evenly at each synchronization",
    ("inplace-rounds", "compression"): "local SGD averages models: no gradient hooks",
    ("ps", "checkpoint-async"): "the servers always write in the background",
    ("ps", "inject corrupt"): "the servers keep checkpoints of their own",
    ("ps", "balance"): "leases are dealt by the servers",
    ("ps", "compression"): "the servers take whole gradients",
    ("inplace-rounds", "replica-size"): "replica groups are fsdp's",
    ("ps", "replica-size"): "the servers hold the parameters; replica groups are fsdp's",
    ("restart", "ps-replicas"): "no parameter server to back up",
    ("inplace", "ps-replicas"): "no parameter server to back up",
    ("inplace-rounds", "ps-replicas"): "no parameter server to back up",
}
# Cells that run together (one run per group and mode, with every flag of the group that
# the mode accepts; a later flag's value wins). Faults get runs of their own (the damaged
# checkpoint's run kills rank 1 too, so in the restart mode it is the kill's run, and its
# synchronous checkpoints are the ones --checkpoint-every writes there, beside the steady
# run's asynchronous ones); so do the flags that change the model or its code.
# fmt: off
GROUPS = {
    "steady": ["checkpoint-every", "checkpoint-async", "hang-timeout", "max-steps",
               "inject slow", "eval", "precision", "grad-accum", "clip-grad-norm",
               "lr-schedule", "eval-every", "balance", "compression"],
    "faults": ["inject kill", "inject corrupt"],
    "hang": ["inject hang"],
    "compile": ["compile"],
    "blocks": ["activation-checkpointing"],
    "hsdp": ["replica-size"],
    "replicas": ["ps-replicas"],
}
# fmt: on
GROUP_OF = {flag: group for group, flags in GROUPS.items() for flag in flags}


def config(mode: str, flags: list[str]) -> RunConfig:
    overrides = dict(BASE)
    for flag in flags:
        overrides |= FLAGS[flag]
    overrides |= MODES[mode][0]
    for flag in flags:
        overrides |= WITH.get((mode, flag), {})
    cfg = with_overrides(RunConfig(), overrides)
    assert mode_of(cfg) == mode.partition("-")[0]
    return cfg


def argv(cfg: RunConfig, out: Path) -> list[str]:
    """The command line of ``cfg``'s fields that differ from the defaults."""
    default, args = RunConfig().to_dict(), []
    for section, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if value != default[section][key]:
                flag = "--" + key.replace("_", "-")
                args += [flag] if value is True else [flag, str(value)]
    return [*args, "--out", str(out)]


class Run:
    def __init__(self, out: Path, stderr: str) -> None:
        self.out, self.stderr = out, stderr
        self.summary = json.loads((out / "summary.json").read_text())
        self.records = read_jsonl(out / "metrics.jsonl")

    def log(self, rank: int) -> str:
        return (self.out / "logs" / f"rank{rank}.log").read_text()


@cache
def group_run(mode: str, group: str, root: Path) -> Run:
    flags = [f for f in GROUPS[group] if (mode, f) not in REFUSED]
    out = root / f"{mode}-{group}"
    result = run_cli("run", *argv(config(mode, flags), out), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return Run(out, result.stderr)


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("modes")


def server_index(run: Run) -> Path:
    return run.out / "checkpoints" / "server0" / "index.json"


def checkpointed(run: Run, mode: str) -> None:
    index = server_index(run) if mode == "ps" else run.out / "checkpoints" / "index.json"
    assert json.loads(index.read_text()), index


def per_rank(run: Run, key: str) -> dict[int, float]:
    return {r["rank"]: r[key] for r in run.summary["per_rank"]}


def ran(run: Run, mode: str) -> None:
    """--hang-timeout-s in a healthy run: nothing to detect; the run went through with the
    watchdog (or torchft's quorum timeout) set to it. "inject hang" checks what it does."""
    assert run.summary["steps"] > 0


def stopped_at_max_steps(run: Run, mode: str) -> None:
    assert run.summary["steps"] == 5


def rank_1_died_and_recovered(run: Run, mode: str) -> None:
    dead = [r for r in run.summary["recoveries"] if 1 in (r.get("rank"), *r.get("ranks", []))]
    assert dead, run.summary["recoveries"]


def hang_detected(run: Run, mode: str) -> None:
    assert any("hang" in str(r.get("cause")) for r in run.summary["recoveries"]), run.summary


def slowed_rank_took_longer(run: Run, mode: str) -> None:
    compute = per_rank(run, "compute_s")
    assert compute[1] > compute[0], compute


def damaged_checkpoint_skipped(run: Run, mode: str) -> None:
    """The newest checkpoint (step 4) was damaged: the restart resumed from step 2's."""
    assert run.summary["recoveries"][0]["step"] == 2, run.summary["recoveries"]


def scored(run: Run, mode: str) -> None:
    assert run.summary["test_accuracy"] is not None


def in_bf16(run: Run, mode: str) -> None:
    assert run.summary["precision"] == "bf16-mixed"


def accumulated(run: Run, mode: str) -> None:
    assert run.summary["grad_accum"] == 2
    assert run.summary["global_batch_size"] == 2 * 2 * BASE["batch_size"]


def clipped(run: Run, mode: str) -> None:
    assert run.summary["clip_grad_norm"]["max_norm"] == 0.5
    if mode != "ps":  # ps bsp: the server clips the aggregate; the workers record no norm
        assert any("grad_norm" in r for r in run.records)


def scheduled(run: Run, mode: str) -> None:
    """Warmup, then cosine: the records' learning rates take several values."""
    assert len({r["lr"] for r in run.records if r.get("lr")}) > 2


def evaluated_during_training(run: Run, mode: str) -> None:
    assert any("test_accuracy" in r for r in run.records)


def compiled(run: Run, mode: str) -> None:
    assert run.summary["compiled_graphs"] > 0


def blocks_recomputed(run: Run, mode: str) -> None:
    assert "activation checkpointing: " in run.log(0), run.log(0)[-2000:]


def rebalanced(run: Run, mode: str) -> None:
    """Each rank's share of a step was re-planned from its measured speed."""
    assert len({r["share"] for r in run.records if "share" in r}) > 1


def compressed(run: Run, mode: str) -> None:
    """bf16 on the wire: half the bytes of fp32."""
    assert abs(run.summary["compression_ratio"] - 2.0) < 0.02, run.summary["compression_ratio"]


def in_replica_groups(run: Run, mode: str) -> None:
    assert run.summary["hsdp"] == {"replica_size": 1, "replica_groups": 2}, run.summary


def replicated(run: Run, mode: str) -> None:
    """Every reply was preceded by a forward to the slice's backup (more forwards than
    updates: hellos and leaves are forwarded too), and both servers applied every step."""
    ps = run.summary["ps"]
    assert ps["replicas"] == 1 and len(ps["replication"]) == 2, ps
    for forwarded, updates in zip(ps["replication"], ps["server_updates"], strict=True):
        assert forwarded["forwards"] >= updates > 0, ps
    assert ps["server_updates"][0] == ps["server_updates"][1] == run.summary["steps"], ps


# What each cell's flag must have done, read off its run.
EFFECTS: dict[str, Callable[[Run, str], None]] = {
    "checkpoint-every": checkpointed,
    "checkpoint-async": checkpointed,
    "hang-timeout": ran,
    "max-steps": stopped_at_max_steps,
    "inject kill": rank_1_died_and_recovered,
    "inject hang": hang_detected,
    "inject slow": slowed_rank_took_longer,
    "inject corrupt": damaged_checkpoint_skipped,
    "eval": scored,
    "precision": in_bf16,
    "grad-accum": accumulated,
    "clip-grad-norm": clipped,
    "lr-schedule": scheduled,
    "eval-every": evaluated_during_training,
    "compile": compiled,
    "activation-checkpointing": blocks_recomputed,
    "balance": rebalanced,
    "compression": compressed,
    "replica-size": in_replica_groups,
    "ps-replicas": replicated,
}


def test_the_matrix_is_whole():
    assert set(EFFECTS) == set(FLAGS) == set(GROUP_OF)
    assert {m for m, _ in REFUSED} <= set(MODES) and {f for _, f in REFUSED} <= set(FLAGS)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_every_cell_works_or_is_refused_before_start(root, mode, flag):
    cfg = config(mode, [flag])
    if (mode, flag) in REFUSED:
        with pytest.raises(ValueError, match=MODES[mode][1]):
            describe_plan(cfg)
        return
    describe_plan(cfg)  # accepted by every pre-start check
    if GROUP_OF[flag] in STRESS_ONLY_GROUPS.get(mode, ()) and not os.environ.get(STRESS_SEED):
        pytest.skip("runs in make stress (make test's budget)")
    EFFECTS[flag](group_run(mode, GROUP_OF[flag], root), mode)


def test_a_refused_flag_is_the_users_mistake_and_nothing_starts(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--strategy", "ps", "--checkpoint-every", "5", "--checkpoint-async",
                     "--inject", "corrupt-checkpoint:step=3", "--out", str(out))  # fmt: skip
    assert result.returncode == 2
    assert "error:" in result.stderr and "--strategy ps" in result.stderr
    assert "checkpoint_async" in result.stderr and "corrupt" in result.stderr  # both, at once
    assert "Traceback" not in result.stderr
    assert not out.exists()
