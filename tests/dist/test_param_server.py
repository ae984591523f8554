"""The parameter server (--strategy ps) with real processes: 2 servers and 3 workers on gloo
links over loopback. bsp computes what synchronous data parallelism computes; every mode
reaches the digits floor while a process is SIGKILLed; the survivors carry on, the dead
process is restarted alone, and every sample is trained exactly once per epoch."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.fault.checkpoint import load_latest
from scaletrain.io import read_jsonl
from tests.conftest import (
    REPO,
    assert_no_orphans,
    listeners_while_running,
    processes_mentioning,
    run_cli,
    stress_only,
)
from tests.dist.test_jobs import start, wait_for_step

DIGITS = 1437  # training samples of the built-in digits set
PS = ["--strategy", "ps", "--nproc-per-node", "5", "--num-servers", "2"]
JOB = ["--batch-size", "32", "--seed", "1", "--num-threads", "1"]


def load(out):
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def weights(out):
    return torch.load(out / "checkpoints" / "final.pt", weights_only=True)["model"]


def assert_exactly_once(records, epochs):
    """Applied steps only: a step whose push server 0 did not apply trained nothing."""
    seen = collections.defaultdict(list)
    for r in records:
        if r["committed"]:
            seen[r["epoch"]] += r["sample_ids"]
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == list(range(DIGITS)), f"epoch {epoch}"


def assert_ledger_once(out, epochs):
    """Server 0's ledger (logs/ps_ledger.jsonl), the run's account of what was applied, has
    every sample once per epoch too: the account that holds when a worker dies between its
    applied push and its record."""
    ledger = read_jsonl(out / "logs" / "ps_ledger.jsonl")
    assert_exactly_once([{**r, "committed": True} for r in ledger], epochs)


def assert_continued_without(records, rank, died_at, until):
    """The other workers applied steps while ``rank`` was dead, in their first attempt."""
    others = [r for r in records if r["rank"] != rank and died_at < r["unix_time"] < until]
    assert len({r["rank"] for r in others}) == 2, "the survivors did not carry on"
    assert all(r["attempt"] == 0 for r in records if r["rank"] != rank)


def test_bsp_equals_synchronous_data_parallel(tmp_path):
    steps = ["--max-steps", "20", "--epochs", "2", "--lr", "0.05", *JOB]
    ddp = run_cli("run", "--nproc-per-node", "3", *steps, "--out", str(tmp_path / "ddp"))
    assert ddp.returncode == 0, ddp.stderr
    # The equality holds while no worker is dropped: on a loaded 2-core machine a step of
    # five processes can outlast the default 30 s barrier, and a drop changes the math (once
    # 0.011 apart here, with the machine loaded by other runs). This test is about the
    # math, so the barrier waits for every worker, and a drop would show in recoveries.
    patient = ["--barrier-timeout-s", "200"]
    ps = run_cli("run", *PS, "--consistency", "bsp", *steps, *patient,
                 "--out", str(tmp_path / "ps"))  # fmt: skip
    assert ps.returncode == 0, ps.stderr
    assert json.loads((tmp_path / "ps" / "summary.json").read_text())["recoveries"] == []
    a, b = weights(tmp_path / "ddp"), weights(tmp_path / "ps")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-5, diff
    summary, records = load(tmp_path / "ps")
    assert summary["steps"] == 20 and summary["samples"] == DIGITS + 5 * 96  # 15 steps an epoch
    assert summary["staleness_histogram"] == {"0": 60}  # 20 steps x 3 workers, never stale
    assert summary["world_size"] == 5 and summary["ps"]["num_workers"] == 3
    assert summary["ps"]["server_numel"][0] - summary["ps"]["server_numel"][1] in (0, 1)
    assert summary["ps"]["server_tensors"] == [5, 4]  # the CNN's 8 tensors; the largest is split
    assert {r["rank"] for r in records} == {0, 1, 2}


def test_bsp_drops_a_dead_worker_and_its_restart_rejoins(tmp_path):
    out = tmp_path / "run"
    # Rank 0 is slowed so the run outlasts rank 2's restart (a fresh Python importing torch).
    result = run_cli("run", *PS, "--consistency", "bsp", "--lr", "0.05", "--epochs", "8",
                     *JOB, "--max-restarts", "1", "--log-sample-ids",
                     "--inject", "kill:rank=2:step=10,slow:rank=0:factor=5",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["test_accuracy"] >= 0.95
    assert_exactly_once(records, 8)
    assert_ledger_once(out, 8)
    [death] = [r for r in summary["recoveries"] if r["kind"] == "ps-worker"]
    assert death["rank"] == 2 and death["restarted"] and death["cause"] == "killed by SIGKILL"
    assert death["detected_s"] is not None and death["requeued_samples"] > 0
    # Rejoined at the servers' current version: a later global step, not back at step 10.
    assert death["rejoined_step"] > 10
    back = [r for r in records if r["rank"] == 2 and r["attempt"] == 1]
    assert_continued_without(records, 2, death["failed_at"], back[0]["unix_time"])
    # While it was away the steps had 2 participants: 64 samples, not 96.
    by_step = collections.Counter()
    for r in records:
        by_step[r["step"]] += r["samples"]
    assert 64 in by_step.values()
    assert_no_orphans(out)


def test_asp_worker_killed_others_continue_and_its_data_is_trained_once(tmp_path):
    out = tmp_path / "run"
    # No restart: the two survivors finish the run alone. ddp's lr: under the staleness rule
    # (--lr / (1 + staleness)) the lr 0.02 this test once used trained too little, 0.942-0.969
    # over seeds 0-4 here, and CI once ended at 0.947 against a floor of 0.95. At 0.05, 16
    # runs (seeds 0-4, and seed 1 eleven times: asynchronous order differs every run) gave
    # 0.947-0.989, mean 0.975, sd 0.009. The floor is a sanity check 6 sd below the mean:
    # exactly-once and the survivors carrying on are the claims.
    result = run_cli("run", *PS, "--consistency", "asp", "--lr", "0.05", "--epochs", "8",
                     *JOB, "--log-sample-ids", "--inject", "kill:rank=1:step=10",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["test_accuracy"] >= 0.92, summary["test_accuracy"]
    assert_exactly_once(records, 8)
    assert_ledger_once(out, 8)
    [death] = summary["recoveries"]
    assert death["kind"] == "ps-worker" and death["rank"] == 1 and not death["restarted"]
    # The batch it held when it died, dealt again: a whole one, or the last of an epoch
    # (1437 = 44 x 32 + 29). Rank 1's 10th lease is the 10th only of its own: a stress round
    # saw it stall 0.3 s in its 3rd step on 2 cores while the others took the leases, so
    # its 10th was the 90th dealt, epoch 1's last, and 29 samples went back.
    assert death["requeued_samples"] in (32, DIGITS % 32)
    assert_continued_without(records, 1, death["failed_at"], float("inf"))
    # Asynchronous: gradients were applied on parameters other workers had already moved.
    hist = summary["staleness_histogram"]
    assert sum(hist.values()) == sum(1 for r in records if r["committed"])
    assert summary["max_staleness"] >= 1
    assert_no_orphans(out)


def largest_lead(records) -> int:
    """ssp's bound, checked from the workers' own clocks: when a worker starts computing its
    step k+1, the slowest other worker must have pushed at least k - S steps by then (the
    servers held the worker until that push was applied, and applied means pushed). Only
    workers still training then count: one whose data ran out has left, and the servers
    bound the others by those that remain. Returns the largest lead k - (pushes of the
    slowest other) over every step start."""
    pushed = collections.defaultdict(list)
    for r in records:
        pushed[r["rank"]].append(r["pushed_at"])
    lead = 0
    for r in records:  # r["started_at"] is when this worker started step r["clock"]
        k = r["clock"] - 1  # pushes it had completed then
        for other, times in pushed.items():
            if other != r["rank"] and max(times) > r["started_at"]:
                lead = max(lead, k - sum(1 for t in times if t <= r["started_at"]))
    return lead


# 3 workers (12-40 s) in every make stress round; make test's budget keeps the other two.
@pytest.mark.parametrize(
    "staleness,workers", [(0, 2), pytest.param(1, 3, marks=stress_only), (3, 2)]
)
def test_ssp_bound_holds_end_to_end(tmp_path, staleness, workers):
    """Real processes, one worker much slower: the fast ones are held at the bound, never
    beyond it, and they do reach it (the test is not vacuous). The slowdown multiplies the
    compute only, 2-3 ms of a ~20 ms step here (pull and push are the rest): at factor 3
    the slow worker's steady steps were only ~1.2x the fast one's, and the fast one reached
    the bound in its 5th step only because the slow one's first step (warm-up, times 3)
    was long. A fresh clone's make test once slowed the fast one's start instead (an xdist
    worker restarting beside it), and over 30 batches it never got 3 ahead. At factor 20
    the slow one's steps take ~100 ms, ~5x the fast one's, whatever the start."""
    out = tmp_path / "run"
    result = run_cli("run", "--strategy", "ps", "--nproc-per-node", str(workers + 1),
                     "--consistency", "ssp", "--staleness", str(staleness),
                     "--num-samples", "240", "--batch-size", "8", "--epochs", "1", "--seed", "1",
                     "--num-threads", "1", "--inject", "slow:rank=0:factor=20",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    _, records = load(out)
    assert {r["attempt"] for r in records} == {0} and len({r["rank"] for r in records}) == workers
    assert largest_lead(records) == staleness


# A server's death and restart from its checkpoint: make test has the hung and the frozen
# server's (both restarted from their checkpoints); this one in every make stress round.
@stress_only  # make test's budget: every make stress round runs it
def test_ssp_server_killed_restarts_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    # Adam on the servers (its state is in the checkpoint too). SGD with momentum 0.9 at
    # lr 0.02 reaches 91-96% here: stale gradients add momentum of their own. This very run,
    # 8 times (asynchronous order and the kill's moment differ every time): 0.958-0.975,
    # mean 0.968, sd 0.006. The floor is a sanity check 6.4 sd below: the claims are the
    # restored slice and that no worker restarted.
    result = run_cli("run", *PS, "--consistency", "ssp", "--staleness", "2",
                     "--optimizer", "adam", "--lr", "0.002", "--epochs", "8", *JOB,
                     "--max-restarts", "1", "--checkpoint-every", "10",
                     "--inject", "kill:rank=4:step=25", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["test_accuracy"] >= 0.93, summary["test_accuracy"]
    [death] = summary["recoveries"]
    assert death["kind"] == "ps-server" and death["server"] == 1 and death["restarted"]
    # Killed before its 25th update, it reloads its newest slice whose write was complete:
    # its copy of a cut (every 10 of server 0's updates, once the leases then out were
    # pushed: cuts.py), or a newer one written in the moment before the kill.
    events = read_jsonl(out / "logs" / "ps_events.jsonl")
    saved = [e["version"] for e in events if e["event"] == "saved" and e["server"] == 1
             and e["attempt"] == 0 and e["unix_time"] < death["failed_at"]]  # fmt: skip
    restored = death["restored_version"]
    assert 10 <= max(saved) <= restored < 25, (restored, saved)
    assert death["resumed_s"] > 0
    # Its slice lost updates 21-24; server 0's did not.
    updates = summary["ps"]["server_updates"]
    assert updates[0] > updates[1]
    assert all(r["attempt"] == 0 for r in records)  # no worker was restarted
    assert summary["ps"]["staleness_bound"] == 2
    # The servers' checkpoints are the loop's format: files listed with their sha256 in a
    # checksummed index, and loadable with weights_only=True (fault/checkpoint.py).
    for server in (0, 1):
        state, skipped = load_latest(out / "checkpoints" / f"server{server}")
        assert state is not None and not skipped and state["cut"] is not None
    assert_no_orphans(out)


def test_a_hung_server_is_ended_by_its_watchdog_and_restarted_from_its_checkpoint(tmp_path):
    """A server stuck in an update (--inject hang of its rank) holds every worker's push; its
    own watchdog ends it after --hang-timeout-s (exit 75, named in its log), its launcher
    restarts it from its newest checkpoint, the workers reconnect and the job finishes, every
    sample trained once. Before, --inject hang of a server rank was refused: nothing ended a
    silent server."""
    out = tmp_path / "run"
    result = run_cli("run", *PS, "--consistency", "bsp", "--epochs", "2", *JOB,
                     "--log-sample-ids", "--max-restarts", "1", "--checkpoint-every", "5",
                     "--hang-timeout-s", "4", "--inject", "hang:rank=4:step=8",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    [hang] = summary["recoveries"]
    assert hang["kind"] == "ps-server" and hang["server"] == 1 and hang["restarted"], hang
    assert "hang" in hang["cause"], hang
    assert "hang detected: rank 4 has been in 'apply' of step 8" in \
        (out / "logs" / "rank4.log").read_text()  # fmt: skip
    # It restored a checkpoint of before its 8th update: the 5th, or none yet (0) if that
    # write was still in flight.
    assert hang["restored_version"] in (0, 5), hang
    # Its slice trained again after it was restored (the first update of its new process).
    assert hang["next_update_s"] >= hang["resumed_s"] > 0, hang
    assert all(r["attempt"] == 0 for r in records)  # the workers only waited
    assert_exactly_once(records, 2)
    assert_ledger_once(out, 2)
    assert_no_orphans(out)


def test_a_frozen_server_is_killed_by_its_launcher_and_restarted_from_its_checkpoint(tmp_path):
    """A server frozen whole (SIGSTOP: its own watchdog is frozen with it) stops touching its
    heartbeat file; after --hang-timeout-s its launcher kills it, names why, and restarts it
    from its checkpoint; the workers reconnect and the job finishes, every sample once."""
    out = tmp_path / "run"
    proc = start(*PS, "--consistency", "bsp", "--epochs", "3", *JOB, "--log-sample-ids",
                 "--max-restarts", "1", "--checkpoint-every", "5", "--hang-timeout-s", "3",
                 "--out", str(out))  # fmt: skip
    wait_for_step(out, 5, proc)
    pid = worker_pid(out, 4)  # server 1
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    summary, records = load(out)
    [frozen] = summary["recoveries"]
    assert frozen["kind"] == "ps-server" and frozen["server"] == 1 and frozen["restarted"]
    assert "heartbeat stopped" in frozen["cause"] and "--hang-timeout-s 3" in frozen["cause"]
    assert "server rank 4: silent for" in stderr
    assert all(r["attempt"] == 0 for r in records)  # the workers only waited
    assert_exactly_once(records, 3)
    assert_ledger_once(out, 3)
    assert_no_orphans(out)


def test_bad_parameter_server_input_fails_before_any_process(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SCALETRAIN_JOIN_TOKEN", raising=False)
    # The config checks are unit-tested (tests/unit/test_ps_rules.py); here, the CLI's exit.
    cases = [
        (["--nproc-per-node", "2", "--num-servers", "2"], "2 servers leave no worker"),
        (["--consistency", "ssp"], "--consistency ssp needs --staleness"),
        (["--join-token-file", "/nonexistent/token"], "join_token_file: cannot read"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1"], "fixed set of processes"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "needs the same secret"),
    ]
    for args, message in cases[:1]:  # one through the real CLI process
        out = tmp_path / "run"
        result = run_cli("run", "--strategy", "ps", "--nproc-per-node", "3", *args,
                         "--out", str(out), timeout=60)  # fmt: skip
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
        assert not (out / "logs").exists()
    for args, message in cases[1:]:  # the rest through its main(), in this process
        out = tmp_path / "run"
        code = main(["run", "--strategy", "ps", "--nproc-per-node", "3", *args, "--out", str(out)])
        stderr = capsys.readouterr().err
        assert code == 2 and message in stderr, (args, stderr)
        assert not (out / "logs").exists()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_local_run_listens_on_loopback_only(tmp_path):
    """The launcher's store, every server's and worker's links: nothing on 0.0.0.0 or ::."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "scaletrain",
        "run",
        *PS,
        "--consistency",
        "asp",
        "--max-steps",
        "15",
        *JOB,
        "--inject",
        "slow:rank=0:factor=30",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = listeners_while_running(proc, out)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert len(seen) > 5, seen  # the store and both ends of links were seen
    assert all(address.startswith("127.0.0.1:") for address in seen), seen


@pytest.mark.parametrize(
    ("optimizer", "consistency"),
    # Each optimizer and each asynchronous rule once, crossed (the other two pairings were
    # measured alike, below; the fuzzer draws them too). Adam under ssp runs in every make
    # stress round (make test's budget): make test keeps the rule's SGD case.
    [(["--optimizer", "sgd", "--lr", "0.05"], ["--consistency", "asp"]),
     pytest.param(["--optimizer", "adam", "--lr", "0.002"],
                  ["--consistency", "ssp", "--staleness", "2"], marks=stress_only)],
    ids=["sgd-asp", "adam-ssp2"],
)  # fmt: skip
def test_asynchronous_modes_train_with_ddps_optimizer_flags(tmp_path, optimizer, consistency):
    """The staleness-aware rule (the default: each push at --lr / (1 + its staleness)) lets
    asp and ssp(2) train with what trains ddp. Measured over seeds 0-4, 15 epochs, 3 workers
    and 2 servers: SGD 0.05 m0.9 asp 0.975-0.986, ssp(2) 0.969-0.986; Adam 0.002 asp
    0.975-0.986, ssp(2) 0.975-0.986 (under the plain rule, SGD diverged to 0.10-0.17). Seed 0
    run 8 times each (the asynchronous order differs every run): asp 0.975-0.989, ssp(2)
    0.975-0.986, Adam asp 0.969-0.986, ssp(2) 0.981-0.986; sd 0.002-0.006: the floor is at
    least 4.7 sd below each mean."""
    out = tmp_path / "run"
    result = run_cli("run", *PS, *consistency, *optimizer, "--epochs", "15", "--seed", "0",
                     "--num-threads", "1", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["test_accuracy"] >= 0.95, summary["test_accuracy"]
    # Each push's factor of --lr is the rule's for its staleness (server 0's).
    for r in records:
        if r["committed"]:
            assert r["lr_factor"] <= 1.0
    assert any(r["lr_factor"] < 1.0 for r in records)  # some pushes were stale, and damped


def worker_pid(out, rank):
    """The process of parameter-server worker ``rank`` of the run in ``out``."""
    for pid in processes_mentioning(str(out)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        # A worker names itself "... -m scaletrain.worker RUN_DIR (rank R)" (worker.forked).
        if b"scaletrain.worker" in cmdline and f"(rank {rank})".encode() in cmdline:
            return pid
    return None


def test_ssp_drops_a_frozen_worker_from_the_bound_after_the_hang_timeout(tmp_path):
    """A worker frozen (SIGSTOP: its own watchdog is frozen with it) holds the others at the
    staleness bound; after --hang-timeout-s without a push the servers drop it, name it, and
    deal its lease to the others, who go on; resumed, it joins again. Every sample once."""
    out = tmp_path / "run"
    proc = start("--strategy", "ps", "--consistency", "ssp", "--staleness", "1",
                 "--nproc-per-node", "4", "--num-servers", "1", "--epochs", "2",
                 "--hang-timeout-s", "3", "--log-sample-ids", "--num-threads", "1",
                 "--out", str(out))  # fmt: skip
    wait_for_step(out, 5, proc)
    pid = worker_pid(out, 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    events = out / "logs" / "ps_events.jsonl"
    deadline = time.monotonic() + 60
    while not any(e["event"] == "worker_lost" and e["worker"] == 1 for e in read_jsonl(events)):
        assert time.monotonic() < deadline and proc.poll() is None, "worker 1 was not dropped"
        time.sleep(0.1)
    stopped_at = time.time()
    os.kill(pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    summary, records = load(out)
    drops = [r for r in summary["recoveries"] if r["kind"] == "ps-drop"]
    assert any(d["rank"] == 1 and "--hang-timeout-s" in d["cause"] for d in drops), drops
    # The others trained on while it was frozen, and it trained again after it was resumed.
    assert any(r["rank"] != 1 and r["unix_time"] > stopped_at for r in records)
    assert any(r["rank"] == 1 and r["unix_time"] > stopped_at for r in records)
    server_log = (out / "logs" / "rank3.log").read_text()  # ranks 0-2 work, 3 serves
    assert "dropping worker 1 from the staleness bound" in server_log
    assert_ledger_once(out, 2)
    assert_no_orphans(out)
