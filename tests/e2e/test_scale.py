"""The scale benchmark's machinery, small enough for every `make test`: 16 workers on
sleeping devices (benchmarks/sleeping_device.py) through ddp, then 16 in-place replicas with
one killed; every sample of every epoch once, and the table that `make scale` prints for
1 to 32 written with every column."""

from __future__ import annotations

import csv
import subprocess
import sys

from tests.conftest import REPO


def test_sixteen_workers_and_a_fault_through_the_scale_benchmark(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/scale.py", "--worlds", "16", "--modes", "ddp",
         "--fault-worlds", "16", "--fault-modes", "inplace", "--kills", "1",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every floor met" in result.stdout
    assert "inplace W=16  1 recoveries" in result.stdout, result.stdout
    [row] = list(csv.DictReader((tmp_path / "scale.csv").open()))
    assert row["mode"] == "ddp" and row["W"] == "16"
    for column in ("launch_to_first_step_s", "imports_s", "group_s", "model_s", "step_ms",
                   "compute_ms", "comm_ms", "overhead_ms", "peak_rss_mb", "open_fds"):  # fmt: skip
        assert float(row[column]) > 0, column
    # The sleeping device: 2 ms per sample forward and 4 backward, 2 samples a step.
    assert 12.0 <= float(row["compute_ms"]) < 40.0, row["compute_ms"]
