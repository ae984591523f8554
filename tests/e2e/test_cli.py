"""The command line as a user runs it: real processes, real exit codes, real files."""

from __future__ import annotations

import json
import socket

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, assert_no_orphans, run_cli, stress_only


def read_summary(out):
    return json.loads((out / "summary.json").read_text())


def test_digits_two_workers_reach_95_percent(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "run",
        "--nproc-per-node",
        "2",
        "--strategy",
        "ddp",
        "--dataset",
        "digits",
        "--model",
        "cnn",
        "--epochs",
        "8",
        "--batch-size",
        "32",
        "--lr",
        "0.05",
        "--seed",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = read_summary(out)
    assert summary["test_accuracy"] >= 0.95
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 64
    assert str(out) in result.stdout and "test accuracy" in result.stdout
    # Run directory contract.
    assert (out / "config.toml").read_text().count("nproc_per_node = 2") == 1
    assert sorted(p.name for p in (out / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * summary["steps"]
    assert {r["rank"] for r in records} == {0, 1}
    assert (out / "checkpoints" / "final.pt").exists()
    # TensorBoard scalars, one point per step per rank, readable by tensorboard itself.
    for rank in (0, 1):
        events = EventAccumulator(str(out / "events" / f"rank{rank}"))
        events.Reload()
        loss = events.Scalars("train/loss")
        assert [e.step for e in loss] == list(range(1, summary["steps"] + 1))
        mine = [r["loss"] for r in records if r["rank"] == rank]
        assert [e.value for e in loss] == pytest.approx(mine, rel=1e-6)
    assert_no_orphans(out)


def test_config_file_and_flags_override_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        "[launch]\nnproc_per_node = 2\n[train]\nepochs = 3\nbatch_size = 8\nmax_steps = 5\n"
        "[data]\ndataset = 'synthetic'\nnum_samples = 256\nimage_size = 16\n[model]\nwidth = 8\n"
    )
    out = tmp_path / "run"
    result = run_cli("run", "--config", str(config), "--batch-size", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = read_summary(out)
    assert summary["steps"] == 5 and summary["global_batch_size"] == 8
    resolved = (out / "config.toml").read_text()
    assert "batch_size = 4" in resolved and 'dataset = "synthetic"' in resolved
    assert f'out = "{out}"' in resolved


# 17-22 s; every make stress round runs it (make test: every bitwise resume test compares
# two --deterministic runs of one seed)
@stress_only
def test_deterministic_runs_give_identical_weights(tmp_path):
    def weights_hash(name: str, seed: int) -> str:
        out = tmp_path / name
        args = ["--nproc-per-node", "2", "--max-steps", "15", "--deterministic"]
        result = run_cli("run", *args, "--seed", str(seed), "--out", str(out))
        assert result.returncode == 0, result.stderr
        return str(read_summary(out)["params_sha256"])

    assert weights_hash("a", 5) == weights_hash("b", 5) != weights_hash("other-seed", 6)


def test_user_task_example(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "run",
        "--task",
        "examples/tabular_task.py:build_task",
        "--nproc-per-node",
        "2",
        "--epochs",
        "10",
        "--batch-size",
        "16",
        "--lr",
        "0.003",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert read_summary(out)["test_accuracy"] >= 0.9


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "magic"], "unknown strategy 'magic'; known strategies: ddp, diloco"),
        (["--compression", "zip"], "unknown compressor 'zip'; valid: none, fp16, bf16, topk"),
        (["--compression", "powersgd:rank=0"], "powersgd rank must be an integer >= 1"),
        (["--compression", "topk:ratio=2"], "topk ratio must be a fraction in (0, 1]"),
        (
            ["--strategy", "local_sgd", "--compression", "fp16"],
            "--strategy local_sgd does not use gradient hooks; --compression applies to: ddp",
        ),
        (["--sync-every", "0"], "sync_every: must be >= 1"),
        (["--dataset", "imagenet"], "known datasets: digits, synthetic"),
        (["--model", "resnet"], "known models: cnn, mlp"),
        (["--nproc-per-node", "0"], "nproc_per_node: must be >= 1"),
        (["--lr", "-0.1"], "lr: must be > 0"),
        (["--config", "/nonexistent/run.toml"], "cannot read config file"),
        (["--task", "nowhere.py:build"], "task: file nowhere.py does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, args, expected):
    result = run_cli("run", *args, "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_malformed_config_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nepochs = = 3\n")
    result = run_cli("run", "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr and "Traceback" not in result.stderr


def test_rendezvous_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(
            "run", "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(tmp_path / "r"), timeout=60
        )
    assert result.returncode == 2
    assert f"port {port} is already in use" in result.stderr


def test_user_model_raising_on_one_rank(tmp_path):
    out = tmp_path / "run"
    task = str(REPO / "tests" / "dist" / "tasks" / "raising_task.py") + ":build_task"
    result = run_cli("run", "--nproc-per-node", "2", "--task", task, "--out", str(out), timeout=60)
    assert result.returncode == 1
    assert (
        "rank 1 failed (exit code 1): RuntimeError: user model exploded on rank 1" in result.stderr
    )
    assert_no_orphans(out)


def test_refuses_to_overwrite_a_finished_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    result = run_cli("run", "--out", str(out), timeout=60)
    assert result.returncode == 2 and "already holds a run" in result.stderr
    assert (out / "summary.json").read_text() == "{}"


# Every make stress round (make test's budget: nodes rendezvous in make test's lost-node test,
# tests/dist/test_recovery.py).
@stress_only
def test_two_nodes_rendezvous_like_torchrun(tmp_path):
    """Two launchers (one per 'node', on this machine) meet at a c10d rendezvous on node 0."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = []
    for node in (0, 1):
        args = ["run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                "--max-steps", "10", "--out", str(tmp_path / f"node{node}")]  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "scaletrain", *args], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL))  # fmt: skip
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    summaries = [tmp_path / f"node{n}" / "summary.json" for n in (0, 1)]
    written = [json.loads(p.read_text()) for p in summaries if p.exists()]
    assert len(written) == 1  # rank 0 lives on one of the nodes and writes the summary
    assert written[0]["world_size"] == 2 and written[0]["steps"] == 10
    for n in (0, 1):
        assert_no_orphans(tmp_path / f"node{n}")


def test_shard_then_train_from_shards_and_refuse_a_corrupted_one(tmp_path):
    shards = tmp_path / "shards"
    result = run_cli("shard", "digits", str(shards), "--shard-size", "300", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "train: 1,437 samples in 5 shards" in result.stdout
    out = tmp_path / "run"
    result = run_cli("run", "--data", str(shards), "--nproc-per-node", "2", "--epochs", "8",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert read_summary(out)["test_accuracy"] >= 0.95

    bad = shards / "train" / "shard-00002.images.npy"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    out2 = tmp_path / "run2"
    result = run_cli("run", "--data", str(shards), "--verify", "--out", str(out2), timeout=60)
    assert result.returncode == 2
    assert f"shard file {bad} is corrupted" in result.stderr
    assert not out2.exists()  # nothing written for a run that never started
    bad.write_bytes(bytes(data[:-5000]))
    result = run_cli("run", "--data", str(shards), "--out", str(out2), timeout=60)
    assert result.returncode == 2 and "is truncated" in result.stderr
