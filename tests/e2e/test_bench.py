"""`scaletrain bench`: a sweep of real runs gathered into one table and a CSV; points that
cannot run here are reported with the reason, and the rest still finishes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from scaletrain.netns import unavailable_reason
from tests.conftest import REPO, run_cli

JOB = ["--dataset", "digits", "--max-steps", "20", "--num-threads", "1"]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_sweep_table_csv_and_a_point_that_cannot_run(tmp_path):
    out = tmp_path / "sweep"
    result = run_cli("bench", "--nproc", "1,2", "--strategy", "ddp,ps", *JOB, "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = read_csv(out / "bench.csv")
    assert [(r["nproc"], r["strategy"]) for r in rows] == [
        ("1", "ddp"), ("2", "ddp"), ("1", "ps"), ("2", "ps")]  # fmt: skip
    one, two = rows[0], rows[1]
    assert one["status"] == two["status"] == "ok"
    assert float(one["speedup"]) == 1.0 and float(one["efficiency"]) == 1.0
    assert float(two["samples_per_s"]) > 0
    assert float(two["speedup"]) == pytest.approx(
        float(two["samples_per_s"]) / float(one["samples_per_s"])
    )
    assert float(two["mb_per_step"]) > 0 and float(one["mb_per_step"]) == 0
    # One process cannot be both a parameter server and a worker; two can.
    ps_one, ps_two = rows[2:]
    assert ps_one["status"].startswith("cannot run: num_servers: 1 servers leave no worker")
    assert ps_one["samples_per_s"] == ""
    assert ps_two["status"] == "ok" and float(ps_two["samples_per_s"]) > 0
    assert "skip [1]" in result.stdout and "[1] cannot run: num_servers" in result.stdout
    assert (out / "ddp-none-loopback-w2" / "summary.json").exists()
    # The sweep's 1-worker run calibrates the cost model for a cluster this machine is not.
    result = run_cli("predict", "--calibrate", str(out / "ddp-none-loopback-w1"),
                     "--workers", "8,1024", "--bandwidth", "10gbit",
                     "--methods", "ddp,local_sgd:8,ps:4", timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps, failures = result.stdout.split("failures: goodput")
    lines = [line.split() for line in steps.splitlines()]
    assert [row[:2] for row in lines if row and row[0] in ("8", "1024")] == [
        ["8", "ddp"], ["1024", "ddp"], ["8", "local_sgd"], ["1024", "local_sgd"],
        ["8", "ps"], ["1024", "ps"]]  # fmt: skip
    assert "assumes:" in result.stdout
    # The failures' table: a row for each W, of W nodes (one device a node).
    assert [row[:2] for row in (line.split() for line in failures.splitlines())
            if row and row[0] in ("8", "1024")] == [["8", "8"], ["1024", "1024"]]  # fmt: skip
    # Probing the host the workers share needs to know it is shared.
    result = run_cli("predict", "--calibrate", str(out / "ddp-none-loopback-w1"),
                     "--workers", "8", "--probe-host", timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "error: --probe-host probes the host the workers share: give --cores" in result.stderr


def test_bad_sweep_values_are_refused(tmp_path):
    for args, message in [(["--nproc", "0"], "--nproc values must be >= 1"),
                          (["--nproc", "two"], "--nproc must be ints")]:  # fmt: skip
        result = run_cli("bench", *args, "--out", str(tmp_path / "s"), timeout=60)
        assert result.returncode == 2
        assert message in result.stderr


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_sweep_over_a_shaped_link(tmp_path):
    out = tmp_path / "sweep"
    job = ["--dataset", "digits", "--max-steps", "6", "--num-threads", "1"]
    result = run_cli("bench", "--nproc", "2", "--bandwidth", "200mbit", *job, "--out", str(out))
    assert result.returncode == 0, result.stderr
    [row] = read_csv(out / "bench.csv")
    assert row["status"] == "ok" and row["bandwidth"] == "200mbit"
    assert float(row["comm_share"]) > 0


def test_predict_from_a_description_without_a_run(tmp_path):
    """`scaletrain predict --params ... --step-ms ... --cluster ...`: the model and the cluster
    described, the predictions as JSON; the flags override the preset; a missing or
    contradictory description is the user's error (exit 2), not a traceback."""
    described = ["predict", "--params", "25.6M", "--step-ms", "100", "--batch-size", "32",
                 "--workers", "1,8,64", "--methods", "ddp,local_sgd:8"]  # fmt: skip
    result = run_cli(*described, "--cluster", "dgx-a100", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["method"], r["workers"]) for r in rows] == [
        ("ddp", 1), ("ddp", 8), ("ddp", 64),
        ("local_sgd H=8", 1), ("local_sgd H=8", 8), ("local_sgd H=8", 64),
    ]  # fmt: skip
    assert set(rows[0]) == {"method", "workers", "step_s", "samples_per_s", "efficiency",
                            "failures"}  # fmt: skip
    # Failures: a DGX A100 node every 7.9 h x 1,024 / 8 on average (the default); at 64
    # devices the job's MTBF is an eighth of that; checkpoints of 12 bytes a parameter at
    # 1 GB/s.
    failures = rows[2]["failures"]
    assert failures["job_mtbf_s"] == pytest.approx(7.9 * 1024 / 8 / 8 * 3600)
    assert failures["checkpoint_interval_s"] == pytest.approx(
        (2 * 12 * 25.6e6 / 1e9 * failures["job_mtbf_s"]) ** 0.5
    )
    assert 0 < failures["goodput_restart"] < failures["goodput_inplace"] < 1
    assert rows[0]["step_s"] == pytest.approx(0.1) and rows[0]["samples_per_s"] == pytest.approx(
        320
    )
    # 64 A100s: 8 nodes of 8 on NVLink (300 GB/s each way), 1600 Gbit/s between nodes, 10 us;
    # 102.4 MB of fp32 gradients.
    within = 2 * 7 / 8 * 102.4e6 / 300e9 + 14 * 10e-6
    across = 2 * 7 / 8 * 102.4e6 / 200e9 + 14 * 10e-6
    assert rows[2]["step_s"] == pytest.approx(0.1 + within + across)
    # bf16 gradients and a slower node link given by hand over the preset's.
    result = run_cli(*described, "--cluster", "dgx-a100", "--bandwidth", "100Gb/s",
                     "--grad-bytes-per-param", "2", "--json")  # fmt: skip
    slow = json.loads(result.stdout)[2]
    across = 2 * 7 / 8 * 51.2e6 / 12.5e9 + 14 * 10e-6
    assert slow["step_s"] == pytest.approx(0.1 + 2 * 7 / 8 * 51.2e6 / 300e9 + 14e-5 + across)
    # The sharded, tensor-parallel and co-located methods on the same cluster: HSDP in
    # node-sized groups moves fewer bytes across nodes than FSDP over all 64.
    result = run_cli(*described[:-1], "fsdp,hsdp:8,tp:8:100,ps-colocated", "--cluster",
                     "dgx-a100", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {(r["method"], r["workers"]): r for r in json.loads(result.stdout)}
    assert set(rows) == {(m, w) for m in ("fsdp", "hsdp S=8", "tp T=8", "ps co-located")
                         for w in (1, 8, 64)}  # fmt: skip
    assert rows["hsdp S=8", 64]["step_s"] < rows["fsdp", 64]["step_s"]
    assert rows["hsdp S=8", 8]["step_s"] == pytest.approx(rows["fsdp", 8]["step_s"])
    assert rows["tp T=8", 8]["samples_per_s"] < 8 * 320
    # --params counted from the model that the config flags describe.
    from scaletrain.config import RunConfig, with_overrides
    from scaletrain.task import build_task

    model = {"model": "cnn", "dataset": "synthetic", "width": 8}
    task = build_task(with_overrides(RunConfig(), model))
    count = sum(p.numel() for p in task.model.parameters())
    by_model = run_cli("predict", *described[3:], "--model", "cnn", "--dataset", "synthetic",
                       "--width", "8", "--json")  # fmt: skip
    by_count = run_cli(*described[:2], str(count), *described[3:], "--json")
    assert by_model.returncode == 0, by_model.stderr
    assert json.loads(by_model.stdout) == json.loads(by_count.stdout)
    # The table names the cluster's sources.
    result = run_cli(*described, "--cluster", "dgx-a100")
    assert result.returncode == 0 and "DGX A100 datasheet" in result.stdout, result.stdout
    # A reader that leaves early (`... --json | head`): exit 1, no traceback.
    many = ",".join(map(str, range(1, 401)))  # ~100 KB of JSON: more than a pipe holds
    with subprocess.Popen([sys.executable, "-m", "scaletrain", *described[:8], many, "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                          stdin=subprocess.DEVNULL) as proc:  # fmt: skip
        assert proc.stdout and proc.stderr
        assert proc.stdout.read(10)
        proc.stdout.close()
        errors = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 1 and "Traceback" not in errors, errors
    for args, message in [
        ([*described[:3]], "give --calibrate RUN_DIR"),
        ([*described, "--calibrate", str(tmp_path)], "one or the other"),
        ([*described, "--cluster", "nope"], "no cluster named 'nope'"),
        ([*described, "--gpus-per-node", "8"], "give --intra-bandwidth"),
        ([*described, "--bandwidth", "fast"], "--bandwidth: expected bits"),
        ([*described, "--overlap", "2"], "--overlap is a share"),
        ([*described, "--model", "cnn"], "--params gives the count"),
        ([*described, "--node-mtbf-h", "0"], "--node-mtbf-h must be above 0"),
        ([*described[:-1], "hsdp:3"], "must divide the workers"),
        ([*described[:-1], "hsdp"], "cannot read method 'hsdp'"),
    ]:
        result = run_cli(*args)
        assert result.returncode == 2 and "error:" in result.stderr, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_plan_ranks_configurations_for_the_work_within_the_limits():
    """`scaletrain plan`: a 1B-parameter model on 8-512 devices of a named cluster, 100M
    samples: every configuration as JSON, the ranked ones first (by time to train, each but
    the first saying why it is behind), then the ones a deadline set aside; the table names
    the winner and the cluster's sources; a work or limit given wrong is the user's error."""
    described = ["plan", "--params", "1B", "--step-ms", "400", "--batch-size", "8",
                 "--cluster", "dgx-h100", "--grad-bytes-per-param", "2", "--samples", "100M",
                 "--methods", "ddp,fsdp"]  # fmt: skip
    result = run_cli(*described, "--deadline", "12h", "--price-per-gpu-hour", "2", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    ranked = [r for r in rows if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert rows[: len(ranked)] == ranked and ranked
    assert [r["time_s"] for r in ranked] == sorted(r["time_s"] for r in ranked)
    assert all(r["time_s"] <= 12 * 3600 and not r["excluded"] for r in ranked)
    assert all("past the deadline" in r["excluded"] for r in rows[len(ranked) :])
    assert all(r["loses_because"] for r in ranked[1:]) and not ranked[0]["loses_because"]
    assert {r["workers"] for r in rows} == {8, 16, 32, 64, 128, 256, 512}
    assert all(r["cost"] == pytest.approx(2 * r["gpu_hours"]) for r in rows)
    # --tokens over --seq-len is the same work in samples.
    limits = ["--deadline", "12h", "--price-per-gpu-hour", "2", "--json"]
    tokens = run_cli(*described[:-4], "--tokens", "409.6B", "--seq-len", "4096", "--methods",
                     "ddp,fsdp", *limits)  # fmt: skip
    assert json.loads(tokens.stdout) == rows
    table = run_cli(*described, "--top", "2")
    assert table.returncode == 0, table.stderr
    best = ranked[0]
    assert f"{best['workers']}" in table.stdout and "the next one, not shown" in table.stdout
    assert "dgx-h100: " in table.stdout
    for args, message in [
        (described[:-4], "give the work as --samples N or as --tokens N"),
        ([*described, "--tokens", "1B"], "give the work as --samples N or as --tokens N"),
        ([*described[:-4], "--tokens", "1B"], "give --seq-len"),
        ([*described, "--deadline", "soon"], "--deadline: expected a duration"),
        ([*described, "--top", "0"], "--top must be at least 1"),
        ([*described, "--budget-gpu-hours", "-3"], "--budget-gpu-hours must be above 0"),
        ([*described, "--epochs", "0"], "--epochs must be above 0"),
        (described[:1] + described[3:], "plan: give --calibrate RUN_DIR"),
    ]:
        result = run_cli(*args)
        assert result.returncode == 2 and "error:" in result.stderr, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
