"""The scale benchmarks' machinery, small enough for every `make test`: 16 workers on
sleeping devices (benchmarks/sleeping_device.py) through ddp, then 16 in-place replicas with
one killed; every sample of every epoch once, and the table that `make scale` prints for
1 to 32 written with every column. Then 16 workers on 4 emulated hosts with one powered off
(benchmarks/hosts.py, which `make scale-hosts` runs at 8 hosts x 4)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from scaletrain.netns import unavailable_reason
from tests.conftest import REPO

REASON = unavailable_reason()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"netns lab unavailable: {REASON}")


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


@needs_lab
def test_sixteen_workers_on_four_hosts_survive_a_power_off(tmp_path):
    """benchmarks/hosts.py small: 4 hosts x 4 workers over shaped links in the netns lab,
    ddp in restart mode; one host powered off mid-run; the job ends on the other three with
    every sample of every epoch once."""
    result = subprocess.run(
        [sys.executable, "benchmarks/hosts.py", "--hosts", "4", "--modes", "ddp",
         "--faults", "power-off", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every floor met (2)" in result.stdout
    [row] = json.loads(next(tmp_path.glob("*/hosts.json")).read_text())
    assert row["processes"] == 16 and row["world_at_end"] == 12 and row["exactly_once"]
    [lost] = row["recoveries"]
    assert lost["kind"] == "restart" and len(lost["ranks"]) >= 1, lost
