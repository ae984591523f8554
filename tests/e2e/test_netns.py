"""The network-namespace lab: hosts with their own addresses and shaped links, a scaletrain job
across them, and nothing left behind, also when the test body fails. Skips without root or
iproute2."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from scaletrain.netns import NetworkLab, parse_rate, sweep_stale, tbf_args, unavailable_reason

REASON = unavailable_reason()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"netns lab unavailable: {REASON}")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rates_parse_and_bad_ones_are_refused():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert tbf_args("1gbit")[:3] == ["tbf", "rate", "1000000000"]
    with pytest.raises(ValueError, match="expected e.g. 100mbit or 1gbit"):
        parse_rate("fast")


@needs_lab
def test_job_across_two_shaped_hosts_then_nothing_left(tmp_path):
    with NetworkLab(2, rate="100mbit") as lab:
        made = {lab.switch, *(h.netns for h in lab.hosts)}
        assert made <= namespaces()
        qdisc = subprocess.run(
            ["tc", "-n", lab.hosts[1].netns, "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # Host 1 reaches host 0 by its own address, over the bridge.
        connect = "import socket; socket.create_connection(('10.200.0.1', 9), 2)"
        probe = lab.run(1, ["python3", "-c", connect], capture_output=True, text=True)
        assert "Connection refused" in probe.stderr  # reached the host; nothing listens on 9
        lab.wait_ready()
        procs = lab.launch_scaletrain(["--max-steps", "6", "--seed", "2"], tmp_path)
        outputs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["comm_bytes_per_step"] > 0
    assert not made & namespaces()


@needs_lab
def test_failure_inside_the_lab_kills_its_processes_and_removes_it():
    with pytest.raises(RuntimeError, match="test body failed"), NetworkLab(1) as lab:
        sleeper = lab.popen(0, ["sleep", "300"])
        made = {lab.switch, lab.hosts[0].netns}
        raise RuntimeError("test body failed")
    assert sleeper.wait(timeout=10) == -9
    assert not made & namespaces()


@needs_lab
def test_namespaces_of_a_dead_lab_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"scaletrain-{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{dead.pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        sweep_stale()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
