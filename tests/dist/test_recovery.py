"""Checkpoint, kill, resume: real workers, real SIGKILLs, torch's elastic agent restarting.

- A worker killed mid-run (max-restarts 1): the group restarts from the newest checkpoint and
  ends with bit-identical weights to an uninterrupted run (--deterministic, CPU).
- A whole node killed mid-epoch (3 nodes, --nnodes 2:3): the 2 survivors re-rendezvous, resume
  from the checkpoint and re-split the rest of the epoch; the sample ids trained on (kept up to
  the step each attempt was resumed from) are exactly the dataset, each once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.conftest import REPO, assert_no_orphans, run_cli


def summary_of(out):
    return json.loads((out / "summary.json").read_text())


def test_killed_worker_restarts_from_checkpoint_with_identical_weights(tmp_path):
    common = ["--nproc-per-node", "2", "--max-steps", "20", "--deterministic", "--seed", "3"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli("run", *common, "--out", str(clean)).returncode == 0
    result = run_cli("run", *common, "--checkpoint-every", "3", "--max-restarts", "1",
                     "--inject", "kill:rank=1:step=8", "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of(killed)
    assert summary["params_sha256"] == summary_of(clean)["params_sha256"]
    assert summary["steps"] == 20
    [recovery] = summary["recoveries"]
    assert recovery["kind"] == "restart" and recovery["attempt"] == 1
    assert recovery["step"] == 6  # the newest checkpoint before the kill at step 8
    assert recovery["lost_steps"] == 1  # step 7 was trained, then lost with the group
    assert "killed by SIGKILL" not in result.stderr  # recovered: not reported as a failure
    assert_no_orphans(killed)


def test_node_lost_mid_epoch_survivors_train_each_sample_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"  # one run directory on a file system all "nodes" share
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    nodes = []
    for node in (0, 1, 2):
        args = ["run", "--nnodes", "2:3", "--node-rank", str(node), "--nproc-per-node", "1",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
                "--max-restarts", "3", "--checkpoint-every", "1", "--log-sample-ids",
                "--dataset", "digits", "--num-samples", "600", "--batch-size", "8",
                "--epochs", "1", "--inject", "killnode:rank=2:step=8", "--timeout-s", "60",
                "--out", str(out)]  # fmt: skip
        nodes.append(subprocess.Popen([sys.executable, "-m", "scaletrain", *args], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL))  # fmt: skip
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert nodes[2].returncode == -9  # the lost node
    assert [nodes[0].returncode, nodes[1].returncode] == [0, 0], outputs[:2]
    summary = summary_of(out)
    [recovery] = summary["recoveries"]
    assert recovery["world_size"] == 2 and summary["world_size"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in records if r["attempt"] == 0} == {0, 1, 2}
    resumed_at = {r["attempt"]: r["step"] for r in summary["recoveries"]}
    kept = [
        i
        for r in records
        if r["attempt"] + 1 not in resumed_at or r["step"] <= resumed_at[r["attempt"] + 1]
        for i in r["sample_ids"]
    ]
    assert sorted(kept) == list(range(600))
    assert summary["samples"] == 600
    assert_no_orphans(out)
