"""The network-namespace lab: hosts with their own addresses and shaped links, a scaletrain job
across them, and nothing left behind, also when the test body fails. Skips without root or
iproute2."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from scaletrain.io import read_jsonl
from scaletrain.netns import NetworkLab, parse_rate, sweep_stale, tbf_args, unavailable_reason
from tests.conftest import stress_only

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
def test_two_shaped_hosts_reach_each_other_then_nothing_is_left():
    # A job across shaped hosts: test_bench's --bandwidth point; across three: below.
    with NetworkLab(2, rate="100mbit") as lab:
        made = {lab.switch, *(h.netns for h in lab.hosts)}
        assert made <= namespaces()
        qdisc = subprocess.run(
            ["tc", "-n", lab.hosts[1].netns, "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc and "100Mbit" in qdisc
        lab.wait_ready()
        # Host 1 reaches host 0 by its own address, over the bridge.
        connect = "import socket; socket.create_connection(('10.200.0.1', 9), 2)"
        probe = lab.run(1, ["python3", "-c", connect], capture_output=True, text=True)
        assert "Connection refused" in probe.stderr  # reached the host; nothing listens on 9
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
def test_a_process_not_yet_inside_its_namespace_is_killed_too():
    """``ip netns exec`` may not have entered the namespace when the lab closes (a CI run
    closed the lab in that instant: the namespace was gone and the process failed with 255
    instead of being killed). Modelled here by a process that never enters it."""
    with NetworkLab(1) as lab:
        lab.command = lambda host, argv: argv  # type: ignore[method-assign]
        outside = lab.popen(0, ["sleep", "300"])
    try:
        assert outside.wait(timeout=10) == -9
    finally:
        outside.kill()


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


def _records(out):
    # Read while the job appends: a torn last line is skipped, not a JSONDecodeError.
    return read_jsonl(out / "metrics.jsonl")


def _wait_for(predicate, procs, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the job did not get there in time"
        assert procs[0].poll() is None, procs[0].communicate()
        time.sleep(0.2)


def _workers(lab, host):
    """(global rank, ps role or "") of each worker process now running on ``host``. Every
    worker is forked from its launcher's fork server, so its environment in /proc is the
    server's: its command line says its rank and role (worker.forked)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", lab.hosts[host].netns], capture_output=True, text=True
    ).stdout.split()
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        title = re.search(r"scaletrain\.worker .* \(rank (\d+)\)(?: ps (\w+))?", cmdline)
        if title:
            found.append((int(title.group(1)), title.group(2) or ""))
    return found


def _worker_ranks(lab, host):
    """The global ranks of the workers now running on ``host``."""
    return sorted(rank for rank, _ in _workers(lab, host))


def _listeners(lab, host):
    """Local addresses of every listening TCP socket on ``host``."""
    out = lab.run(host, ["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


@needs_lab
@stress_only  # 64-100 s; every make stress round runs it
def test_three_hosts_survive_a_dead_host_then_a_cut_cable(tmp_path):
    """ddp on hosts in restart mode, --nnodes 1:3. Hosts 0 and 1 start training; host 2
    joins late, and the world grows to three. Every process of host 2 is SIGKILLed
    (a crashed machine: its peers' connections are reset): hosts 0 and 1 go on as a world of
    two. Then host 1's cable is cut (silence: nothing is reset), and host 0's watchdog names
    it; host 0 finishes alone. Host 1, cut off, gives up with a clear message instead of
    waiting in torch's store client for good. Every listening socket is on a host's own
    address, none on every interface. Across the four worlds, every sample is trained once
    per epoch."""
    out = tmp_path / "run"  # one run directory: the hosts share this file system
    args = ["--epochs", "4", "--checkpoint-every", "5", "--max-restarts", "3", "--seed", "1",
            "--hang-timeout-s", "6", "--timeout-s", "12", "--rdzv-last-call-s", "3",
            "--rdzv-keep-alive-s", "2", "--log-sample-ids"]  # fmt: skip

    def trained(ranks, steps):  # the newest world has these ranks and trained this far
        records = _records(out)
        newest = max((r["attempt"] for r in records), default=-1)
        mine = [r for r in records if r["attempt"] == newest]
        return {r["rank"] for r in mine} == ranks and max(r["step"] for r in mine) >= steps

    with NetworkLab(3) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain(args, out, nnodes="1:3", shared_out=True, hosts=[0, 1])
        _wait_for(lambda: trained({0, 1}, 3), procs)
        procs += lab.launch_scaletrain(args, out, nnodes="1:3", shared_out=True, hosts=[2])
        _wait_for(lambda: trained({0, 1, 2}, 8), procs)
        for host in lab.hosts:
            listening = _listeners(lab, host.index)
            assert listening and all(a.startswith(f"{host.ip}:") for a in listening), listening
        assert f"{lab.hosts[0].ip}:29500" in _listeners(lab, 0)  # the rendezvous, bound
        lost = _worker_ranks(lab, 2)
        assert lab.kill_host(2) and lost
        killed_at = time.time()
        attempt = max(r["attempt"] for r in _records(out))
        _wait_for(lambda: any(r["attempt"] > attempt and r["step"] >= 25 for r in _records(out)),
                  procs)  # fmt: skip
        cut = _worker_ranks(lab, 1)
        lab.link_down(1)
        cut_at = time.time()
        outputs = [p.communicate(timeout=240) for p in procs[:2]]
        assert procs[0].returncode == 0, outputs[0]
        assert procs[1].returncode == 69, outputs[1]  # rendezvous.UNREACHABLE_EXIT_CODE
        assert "has not answered" in outputs[1][1] and "Traceback" not in outputs[1][1]
    summary = json.loads((out / "summary.json").read_text())
    # The world goes 2 -> 3 -> 2 -> 1 (the global batch with it) at points set by timing, so
    # the accuracy varies: 0.983 in 3 runs here, 0.944-0.961 when host 2 started with the
    # others. The floor is a sanity check below that; exactly-once is the claim.
    assert summary["test_accuracy"] >= 0.93 and summary["world_size"] == 1
    resumed_at = {r["attempt"]: r["step"] for r in summary["recoveries"]}
    kept = collections.defaultdict(list)  # epoch -> sample ids of steps that were kept
    for r in _records(out):
        if r["attempt"] + 1 not in resumed_at or r["step"] <= resumed_at[r["attempt"] + 1]:
            kept[r["epoch"]] += r["sample_ids"]
    assert sorted(kept) == [0, 1, 2, 3]
    assert all(sorted(ids) == list(range(1437)) for ids in kept.values())
    grown, first, second = summary["recoveries"]
    assert grown["cause"] == "node-joined" and grown["world_size"] == 3, grown
    assert first["cause"] == "node-lost" and first["ranks"] == lost, first
    assert first["world_size"] == 2 and first["detected_at"] - killed_at < 5
    assert second["cause"] == "hang" and second["ranks"] == cut, second
    assert second["world_size"] == 1
    # Host 0's watchdog fires once host 0 has made no progress for --hang-timeout-s 6, counted
    # from its own last progress, which can come before the cut (it entered the step's
    # all-reduce, then the cable went): a fresh clone once saw 5.97 s from the cut.
    [report] = [i for i in read_jsonl(out / "logs" / "incidents.jsonl")
                if i["kind"] == "hang" and i["detected_at"] == second["detected_at"]]  # fmt: skip
    assert not report["store_unreachable"]  # host 0's report: it could read every heartbeat
    assert report["detected_at"] - report["waited_since"] >= 6
    assert cut_at < second["detected_at"] < cut_at + 6 + 5


@needs_lab
@stress_only  # 32-35 s; every make stress round runs it (make test: test_bench.py's shaped link)
def test_parameter_server_across_three_hosts_survives_a_cut_worker_host(tmp_path):
    """--strategy ps on three hosts, two processes each: hosts 0 and 1 run the four workers,
    host 2 both servers (the world's last ranks). The store is node 0's, on its address; the
    job shares one secret. Mid-run host 1's cable is cut: the bsp barrier drops its workers
    after --barrier-timeout-s, the others train on, node 0 counts host 1's ranks as lost
    once it has been silent for --timeout-s (it waited for them for good before), and
    host 1 gives up on the job by itself."""
    out = tmp_path / "run"
    args = ["--strategy", "ps", "--num-servers", "2", "--consistency", "bsp", "--lr", "0.05",
            "--epochs", "8", "--batch-size", "32", "--seed", "1", "--num-threads", "1",
            "--timeout-s", "10", "--barrier-timeout-s", "3"]  # fmt: skip
    with NetworkLab(3) as lab:
        made = {lab.switch, *(h.netns for h in lab.hosts)}
        lab.wait_ready()
        secret = {"SCALETRAIN_JOIN_TOKEN": "one secret per job"}
        procs = lab.launch_scaletrain(args, out, nproc_per_node=2, shared_out=True, env=secret)
        roles = {}
        while len(roles) < 6:
            for host in range(3):
                for rank, role in _workers(lab, host):
                    roles[rank] = (host, role)
            assert procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.1)
        _wait_for(lambda: any(r["step"] >= 20 for r in _records(out)), procs)
        lab.link_down(1)
        outputs = [p.communicate(timeout=240) for p in procs]
        assert procs[0].returncode == 0 and procs[2].returncode == 0, outputs
        assert procs[1].returncode == 1 and "lost node 0's store" in outputs[1][1], outputs[1]
    assert not made & namespaces()  # the lab is gone, and everything in it
    assert roles == {0: (0, "worker"), 1: (0, "worker"), 2: (1, "worker"), 3: (1, "worker"),
                     4: (2, "server"), 5: (2, "server")}  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.95 and summary["world_size"] == 6
    assert summary["ps"]["num_workers"] == 4
    lost = [r for r in summary["recoveries"] if "went silent" in r["cause"]]
    assert sorted(r["rank"] for r in lost) == [2, 3], summary["recoveries"]
    dropped = {r["rank"] for r in summary["recoveries"] if r["kind"] == "ps-drop"}
    assert dropped == {2, 3}, summary["recoveries"]  # by the barrier, before node 0 gave up


@needs_lab
@stress_only  # 41-50 s; every make stress round runs it (make test: test_bench.py's shaped link)
def test_inplace_across_three_hosts_survives_a_dead_host_then_a_cut_cable(tmp_path):
    """--recovery inplace on three hosts: host 0 hosts torchft's lighthouse on its address,
    each replica listens on its own host's address. Host 2 is SIGKILLed whole, then host 1's
    cable is cut; host 0 trains on without restarting or rolling back, each time. Host 1,
    cut off, fails with the supervisor's account once its replica cannot reach the
    lighthouse."""
    out = tmp_path / "run"
    args = ["--recovery", "inplace", "--epochs", "4", "--max-restarts", "0", "--seed", "1",
            "--hang-timeout-s", "6", "--timeout-s", "10"]  # fmt: skip
    with NetworkLab(3) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain(args, out, shared_out=True)
        _wait_for(lambda: any(r["step"] >= 8 for r in _records(out)), procs)
        for host in lab.hosts:  # lighthouse, stores, manager and checkpoint servers
            listening = _listeners(lab, host.index)
            assert len(listening) >= 4, listening
            assert all(a.startswith(f"{host.ip}:") for a in listening), listening
        assert _worker_ranks(lab, 2) == [2] and _worker_ranks(lab, 1) == [1]
        lab.kill_host(2)
        _wait_for(lambda: any(r["step"] >= 25 for r in _records(out)), procs)
        lab.link_down(1)
        outputs = [p.communicate(timeout=240) for p in procs[:2]]
        assert procs[0].returncode == 0, outputs[0]
        # Host 1 notices the cut when its all-reduce times out (--hang-timeout-s 6) or its
        # quorum cannot reach the lighthouse. Where the cut lands decides whether host 0 is
        # done by then. Cut after host 0 got host 1's last bytes of an all-reduce but before
        # host 1 got host 0's, host 0 commits that step and trains on alone at once (its
        # lighthouse misses host 1's heartbeats) while host 1 waits out its 6 s: a stress
        # round saw host 0 finish 4 s before host 1 noticed. Host 1 then finds the run
        # ended (the shared run directory holds host 0's final report) and leaves without
        # training it again: "done", exit 0. Otherwise it fails with the supervisor's account.
        log1 = (out / "logs" / "rank1.log").read_text()
        if procs[1].returncode == 0:
            [line] = [x for x in log1.splitlines() if "the other replicas finished the run" in x]
            seen_at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
            seen_at += int(line[20:23]) / 1000
            final = out / "logs" / "final" / "rank0.json"
            assert final.stat().st_mtime <= seen_at + 0.001, (final.stat().st_mtime, line)
        else:
            assert "every replica failed" in outputs[1][1], outputs[1]
    # Either way host 1 never trained alone: each step it recorded, host 0 trained with it.
    records = _records(out)
    with_two = {r["step"] for r in records if r["rank"] == 0 and r["participants"] >= 2}
    assert {r["step"] for r in records if r["rank"] == 1} <= with_two
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.95 and summary["replicas_agree"]
    killed, cut = summary["recoveries"]
    assert killed["rank"] == 2 and killed["cause"].startswith("left") and killed["lost_steps"] == 0
    # Killed between collectives, host 2 is noticed by the lighthouse (0.5 s without
    # heartbeats); killed while the survivors wait on it in torchft's quorum or commit, by
    # that wait's timeout (--hang-timeout-s 6): measured 0.5-1 s and 6.0 s here.
    assert killed["world_size"] == 2 and killed["detected_s"] < 6 + 5, killed
    assert cut["rank"] == 1 and cut["world_size"] == 1
    # Where the cut lands decides how it is noticed: between collectives the lighthouse
    # misses the replica's heartbeats (0.5 s); inside an all-reduce, that collective's
    # timeout (--hang-timeout-s 6) ends it. Either way, within the timeout and some slack.
    assert cut["detected_s"] < 6 + 5, cut
