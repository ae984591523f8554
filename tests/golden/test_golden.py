"""The golden table: fixed runs of every mode and the hash of their final weights.

A restructure must not change what training computes. Each run below has a fixed seed,
--deterministic and one thread, so its summary.json's params_sha256 is a function of the
code's math alone; tests/golden/hashes.json holds the hashes the table was recorded with.
``make golden`` runs them all and fails on any difference (about 2 minutes on 2 cores); it
is not part of make test's budget. After a change that is meant to alter the math, record
the table anew (``SCALETRAIN_GOLDEN=record make golden``) and say why in the commit.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_cli

TABLE = Path(__file__).with_name("hashes.json")
MODE = os.environ.get("SCALETRAIN_GOLDEN", "")
BASE = ["--deterministic", "--num-threads", "1", "--num-samples", "256", "--epochs", "2",
        "--batch-size", "16"]  # fmt: skip
TRANSFORMER = ["--model", "transformer", "--width", "16"]
RUNS: dict[str, list[str]] = {
    "ddp": ["--nproc-per-node", "2", "--seed", "1"],
    "ddp-powersgd": ["--nproc-per-node", "2", "--seed", "2", "--compression", "powersgd:rank=2"],
    "fsdp": ["--nproc-per-node", "2", "--seed", "3", "--strategy", "fsdp"],
    "hsdp": ["--nproc-per-node", "2", "--seed", "4", "--strategy", "fsdp", "--replica-size", "1"],
    "tensor": ["--nproc-per-node", "2", "--seed", "5", "--strategy", "tensor", "--tp", "2",
               *TRANSFORMER],
    "pipeline": ["--nproc-per-node", "2", "--seed", "6", "--strategy", "pipeline",
                 "--microbatches", "2"],
    "local_sgd": ["--nproc-per-node", "2", "--seed", "7", "--strategy", "local_sgd",
                  "--sync-every", "2"],
    "diloco": ["--nproc-per-node", "2", "--seed", "8", "--strategy", "diloco", "--sync-every",
               "2", "--optimizer", "adamw", "--lr", "0.003"],
    "ps-bsp": ["--nproc-per-node", "4", "--seed", "9", "--strategy", "ps", "--num-servers", "2",
               "--consistency", "bsp"],
    "ps-bsp-backups": ["--nproc-per-node", "6", "--seed", "10", "--strategy", "ps",
                       "--num-servers", "3", "--consistency", "bsp", "--ps-replicas", "1"],
    "inplace": ["--nproc-per-node", "2", "--seed", "11", "--recovery", "inplace"],
    "resumed": ["--nproc-per-node", "2", "--seed", "1", "--checkpoint-every", "5",
                "--max-restarts", "1", "--inject", "kill:rank=1:step=9"],
}  # fmt: skip
needs_golden = pytest.mark.skipif(not MODE, reason="runs in make golden (SCALETRAIN_GOLDEN=1)")


@needs_golden
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_final_weights_are_the_recorded_ones(tmp_path, name):
    out = tmp_path / name
    result = run_cli("run", *BASE, *RUNS[name], "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads((out / "summary.json").read_text())["params_sha256"]
    if MODE == "record":
        with TABLE.with_suffix(".lock").open("w") as lock:  # two test processes record
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
            table[name] = {"argv": [*BASE, *RUNS[name]], "params_sha256": got}
            TABLE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    assert name in table, f"{name} is not in {TABLE}: record it (SCALETRAIN_GOLDEN=record)"
    assert table[name]["argv"] == [*BASE, *RUNS[name]], "the run changed: record it anew"
    assert got == table[name]["params_sha256"], f"{name}: the final weights changed"


def test_the_resumed_run_ends_where_the_uninterrupted_one_does():
    """The table's own consistency, checked by every make test: the resumed run is ddp's
    run with a kill, so their recorded hashes are equal."""
    table = json.loads(TABLE.read_text())
    assert table["resumed"]["params_sha256"] == table["ddp"]["params_sha256"]
    assert set(table) == set(RUNS)
