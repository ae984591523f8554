"""benchmarks/hosts.py small enough for `make stress` (84 s, more than `make test`'s budget
allows; every stress round runs it): 16 workers on 4 emulated hosts, ddp in restart mode, one
host powered off mid-run. `make scale-hosts` runs 8 hosts x 4 with a cable cut too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scaletrain.netns import unavailable_reason
from tests.conftest import REPO, stress_only

REASON = unavailable_reason()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"netns lab unavailable: {REASON}")


@needs_lab
@stress_only
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
