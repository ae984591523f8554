"""--balance speed with real processes (ddp, and in place): one of three workers 3x slower (as
slower hardware: it sleeps twice its compute after each step) gets fewer samples; the weights
stay those of one worker trained on the same global batches, every sample is trained once per
epoch, and a restarted run continues with the shares its checkpoint holds."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from scaletrain.io import read_jsonl
from tests.conftest import assert_no_orphans, built_once, run_cli

SAMPLES = 600
# 3 workers x 16 = global steps of 48: 12 full steps and one of 24 an epoch.
BALANCED = ["--nproc-per-node", "3", "--batch-size", "16", "--balance", "speed",
            "--balance-every", "3", "--inject", "slow:rank=1:factor=3"]  # fmt: skip
# Width 32: a step's time grows with its samples (at width 8 a step was ~2 ms of mostly fixed
# cost, where any split of the two fast ranks is as good as another and noise moved it).
COMMON = ["--dataset", "digits", "--num-samples", str(SAMPLES), "--epochs", "2", "--width", "32",
          "--seed", "2", "--deterministic", "--num-threads", "1", "--log-sample-ids"]  # fmt: skip


def weights(out):
    return torch.load(out / "checkpoints" / "final.pt", weights_only=True)["model"]


def train_single(root):
    result = run_cli("run", *COMMON, "--batch-size", "48", "--out", str(root / "one"))
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    return built_once(tmp_path_factory, "balance-single", train_single) / "one"


@pytest.mark.parametrize("recovery", ["restart", "inplace"])
def test_a_slow_worker_gets_fewer_samples_and_the_math_stays_exact(tmp_path, single, recovery):
    """In place, the rates ride on each step's all-reduce and the split follows the quorum
    (strategies/inplace.py); the math is the same."""
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, *BALANCED, "--recovery", recovery, "--out", str(out))
    assert result.returncode == 0, result.stderr
    diff = max((weights(out)[k] - weights(single)[k]).abs().max().item() for k in weights(out))
    assert diff <= 1e-5, diff
    records = read_jsonl(out / "metrics.jsonl")
    late = [r for r in records if r["step"] > 12 and "share" in r]
    assert late, "the split was never re-planned"
    share = {r["rank"]: r["share"] for r in late}
    assert share[1] < 0.25 < min(share[0], share[2]), share  # the slow one: well under 1/3
    # Every step's samples are the global step's, however split.
    by_step = collections.defaultdict(int)
    for r in records:
        by_step[r["step"]] += r["samples"]
    assert set(by_step.values()) <= {48, 24}
    seen = collections.defaultdict(list)
    for r in records:
        seen[r["epoch"]] += r["sample_ids"]
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(SAMPLES)), epoch
    assert_no_orphans(out)


def test_a_restarted_run_continues_with_its_checkpointed_shares(tmp_path, single):
    out = tmp_path / "run"
    result = run_cli("run", *COMMON, *BALANCED, "--checkpoint-every", "10", "--max-restarts",
                     "1", "--inject", "slow:rank=1:factor=3,kill:rank=0:step=16",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out / "metrics.jsonl")
    [restart] = json.loads((out / "summary.json").read_text())["recoveries"]
    resumed = restart["step"]  # the checkpoint's step (10)
    saved = {r["rank"]: r.get("share") for r in records if r["attempt"] == 0
             and r["step"] == resumed}  # fmt: skip
    first = {r["rank"]: r.get("share") for r in records if r["attempt"] == 1
             and r["step"] == resumed + 1}  # fmt: skip
    assert saved == first and saved[1] is not None  # the split it had, not an even one
    diff = max((weights(out)[k] - weights(single)[k]).abs().max().item() for k in weights(out))
    assert diff <= 1e-5, diff
