"""Sharded data parallel (FSDP2): the same training as one process, a fraction of the state
per rank, and checkpoints that survive a restart. Real processes, real gloo collectives."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_no_orphans, run_cli, start_local_nodes
from tests.dist.test_equivalence import train


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), 1, 115)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_one_process(tmp_path, single, world):
    """Losses step by step and final weights as one worker with the whole batch, including
    the short, unevenly split last step of each epoch."""
    ref_weights, ref = single
    weights, run = train(tmp_path, world, 115, strategy="fsdp")
    assert run["summary"]["steps"] == 20
    ref_loss = {r["step"]: r["loss"] for r in ref["records"]}
    for step in range(1, 11):
        rows = [r for r in run["records"] if r["step"] == step and r["samples"]]
        mean = sum(r["loss"] * r["samples"] for r in rows) / sum(r["samples"] for r in rows)
        assert mean == pytest.approx(ref_loss[step], abs=1e-4), f"step {step}"
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"


def test_fsdp_holds_a_share_of_the_state(tmp_path, single):
    _, ref = single
    _, run = train(tmp_path, 2, 115, strategy="fsdp")
    full = ref["summary"]["per_rank"][0]["memory"]
    for rank in run["summary"]["per_rank"]:
        mine = rank["memory"]
        # Each rank holds its shard: about half (shards are padded to equal sizes).
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert 0.45 * full[key] <= mine[key] <= 0.6 * full[key], (key, mine, full)
    assert run["summary"]["max_rank_state_bytes"] < 0.6 * ref["summary"]["max_rank_state_bytes"]


def test_fsdp_checkpoint_restart_gives_identical_weights(tmp_path):
    common = ["--nproc-per-node", "2", "--strategy", "fsdp", "--max-steps", "16",
              "--deterministic", "--seed", "5", "--num-threads", "1"]  # fmt: skip
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli("run", *common, "--out", str(clean)).returncode == 0
    result = run_cli("run", *common, "--checkpoint-every", "4", "--max-restarts", "1",
                     "--inject", "kill:rank=0:step=10", "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summaries = [json.loads((d / "summary.json").read_text()) for d in (clean, killed)]
    assert summaries[1]["recoveries"][0]["step"] == 8
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    assert_no_orphans(killed)


def test_fsdp_resumes_from_sharded_checkpoint_with_fewer_ranks(tmp_path):
    """Two nodes, one rank each; node 1 is lost. The survivor re-forms a world of one and
    loads the checkpoint both ranks wrote as shards: DCP reshards it for one rank."""
    out = tmp_path / "run"  # one run directory on a file system both "nodes" share
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--strategy", "fsdp",
            "--max-restarts", "3", "--checkpoint-every", "2", "--num-samples", "400",
            "--batch-size", "8", "--inject", "killnode:rank=1:step=6", "--keep-checkpoints", "100",
            "--timeout-s", "60", "--out", str(out)]  # fmt: skip
    nodes = start_local_nodes(2, args, "fsdp-elastic")
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert nodes[1].returncode == -9  # the lost node
    assert nodes[0].returncode == 0, outputs[0]
    summary = json.loads((out / "summary.json").read_text())
    [recovery] = summary["recoveries"]
    assert recovery["world_size"] == 1 and recovery["step"] == 4
    assert summary["world_size"] == 1 and summary["samples"] == 400
    assert (out / "checkpoints" / "step-00000004.dcp" / "__1_0.distcp").exists()  # 2 shards
    assert summary["test_accuracy"] is not None
    assert_no_orphans(out)
