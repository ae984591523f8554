"""`scaletrain bench`: a sweep of real runs gathered into one table and a CSV; points that
cannot run here are reported with the reason, and the rest still finishes."""

from __future__ import annotations

import csv

import pytest

from scaletrain.netns import unavailable_reason
from tests.conftest import run_cli

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
    lines = [line.split() for line in result.stdout.splitlines()]
    assert [row[:2] for row in lines if row and row[0] in ("8", "1024")] == [
        ["8", "ddp"], ["1024", "ddp"], ["8", "local_sgd"], ["1024", "local_sgd"],
        ["8", "ps"], ["1024", "ps"]]  # fmt: skip
    assert "assumes:" in result.stdout
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
