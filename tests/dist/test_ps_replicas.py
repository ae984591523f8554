"""Replicated slices (--ps-replicas 1): every server's slice has a backup on the other
server, which holds every update before a worker hears of it; a server SIGKILLed (or hung)
mid-run is restarted and takes its slice from the backup, and the push it died with is sent
again and applied once. Nothing acknowledged is lost: bsp ends bit for bit where the same
run without the kills ends; asp counts every push once on every slice. Real launchers, real
SIGKILLs, gloo on loopback (strategies/param_server/replica.py)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from scaletrain.env import STRESS_SEED
from scaletrain.fault.internal import INTERNAL_EXIT_CODE
from scaletrain.io import read_jsonl
from tests.conftest import assert_no_orphans, run_cli, stress_only
from tests.dist.test_jobs import start, wait_for_step
from tests.dist.test_param_server import (
    DIGITS,
    JOB,
    PS,
    assert_exactly_once,
    assert_ledger_once,
    worker_pid,
)
from tests.dist.test_param_server import load as load_run

REPLICATED = [*PS, "--ps-replicas", "1", "--max-restarts", "3"]
# Ranks 3 and 4 are servers 0 and 1; each is the backup of the other's slice. Server 0 dies
# at its 5th update, server 1 (the backup that just gave server 0 its slice) at its 14th,
# and server 0's replacement at its 24th: a primary, a backup, a primary's replacement.
KILLS = "kill:rank=3:step=5,kill:rank=4:step=14,kill:rank=3:step=24"


def resent(summary) -> int:
    """Pushes sent again to a restarted server that its slice held already (all servers)."""
    return sum(r["resent_already_applied"] for r in summary["ps"]["replication"] if r)


def server_restores(summary):
    return [(r["server"], r["restored_from"]) for r in summary["recoveries"]
            if r["kind"] == "ps-server"]  # fmt: skip


def test_bsp_through_kills_of_primaries_and_backups_ends_bitwise_as_without_them(tmp_path):
    """--deterministic: the servers sum a step's pushes in worker order, so the run without
    kills is the reference to the last bit; the run with three kills must end there, and so
    must one whose server 0 is lost for good (no restart left: its backup's process serves
    its slice and deals the data from then on)."""
    job = [*REPLICATED, "--consistency", "bsp", "--epochs", "2", "--deterministic",
           "--lr", "0.05", *JOB]  # fmt: skip
    runs = {}
    lost = ["--inject", "kill:rank=3:step=14", "--max-restarts", "0"]
    acked = ["--inject", "kill-before-reply:rank=4:step=6"]
    # Server 0's link to its backup breaks after step 5, both alive; once made again (a
    # forward), server 0 dies before its reply.
    broken = ["--inject", "break-backup-link:rank=3:step=5,kill-before-reply:rank=3:step=9"]
    for name, extra in [("steady", []), ("killed", ["--inject", KILLS]), ("lost", lost),
                        ("acked", acked), ("broken", broken)]:  # fmt: skip
        out = tmp_path / name
        result = run_cli("run", *job, *extra, "--log-sample-ids", "--out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = load_run(out)
        assert_no_orphans(out)
    (steady, _), (killed, records), (taken, _) = runs["steady"], runs["killed"], runs["lost"]
    # Server 1 died with step 6 on its backup and unanswered: every worker sent its push of
    # step 6 again, and the restored server applied none of them twice.
    acked = runs["acked"][0]
    assert server_restores(acked) == [(1, "backup")], acked["recoveries"]
    assert resent(acked) >= 1, acked["ps"]["replication"]
    assert acked["params_sha256"] == steady["params_sha256"]
    assert acked["ps"]["server_updates"] == steady["ps"]["server_updates"]
    # The primary linked to the same backup process again at once and copied its slice
    # again, and the failover after it lost nothing.
    broke = runs["broken"][0]
    assert server_restores(broke) == [(0, "backup")], broke["recoveries"]
    assert broke["ps"]["lost_acknowledged_updates"] == 0
    assert broke["params_sha256"] == steady["params_sha256"]
    events = read_jsonl(tmp_path / "broken" / "logs" / "ps_events.jsonl")
    relinked = [e for e in events if e["event"] == "backup_synced" and e["server"] == 0
                and e["attempt"] == 0]  # fmt: skip
    assert [e["backup_attempt"] for e in relinked] == [0, 0], relinked
    assert "linking again as 0.1" in (tmp_path / "broken" / "logs" / "rank4.log").read_text()
    [death] = taken["recoveries"]
    assert (death["server"], death["restarted"], death["taken_over_by"]) == (0, False, 4)
    assert taken["params_sha256"] == steady["params_sha256"]
    assert server_restores(killed) == [(0, "backup"), (1, "backup"), (0, "backup")], killed
    assert killed["params_sha256"] == steady["params_sha256"]
    # Every restore came from a backup: nothing a worker had seen acknowledged was lost.
    assert all(r["lost_acknowledged_updates"] == 0 for r in killed["recoveries"])
    assert killed["ps"]["lost_acknowledged_updates"] == 0
    assert killed["ps"]["server_updates"] == steady["ps"]["server_updates"] == [
        steady["steps"]] * 2  # fmt: skip
    assert_exactly_once(records, 2)
    assert_ledger_once(tmp_path / "killed", 2)
    # The restarted server applied its next update within seconds, not --timeout-s.
    assert all(r["next_update_s"] < 10 for r in killed["recoveries"]), killed["recoveries"]


def test_asp_a_push_acknowledged_by_the_backup_but_not_answered_is_applied_once(tmp_path):
    """asp: server 0 dies after its backup holds update 6 and before the reply; the worker
    sends that push again, and the restored server counts it as held, not applied again:
    each slice applied exactly the pushes the workers recorded."""
    out = tmp_path / "run"
    result = run_cli("run", *REPLICATED, "--consistency", "asp", "--epochs", "1", *JOB,
                     "--inject", "kill-before-reply:rank=3:step=6", "--log-sample-ids",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary, records = load_run(out)
    assert server_restores(summary) == [(0, "backup")], summary["recoveries"]
    assert resent(summary) == 1, summary["ps"]["replication"]
    assert summary["ps"]["lost_acknowledged_updates"] == 0
    assert summary["ps"]["server_updates"] == [len(records)] * 2, summary["ps"]
    assert_exactly_once(records, 1)
    assert_ledger_once(out, 1)
    assert_no_orphans(out)


def test_a_primary_lost_while_its_restarted_backup_copies_is_counted_and_warned(tmp_path):
    """The window a backup cannot cover. Three servers (ranks 3-5; server k's slice backed
    up on server k+1): server 2 dies at its 8th update and comes back from its backup on
    server 0; server 1, which acknowledged alone meanwhile (its backup was server 2), dies
    as it begins to copy its slice to the restarted server 2. Server 1's slice comes back
    from its checkpoint (none: from the start), so updates its workers had seen are gone:
    the run goes on, and says how many, in a warning and in summary.json, never silently."""
    out = tmp_path / "run"
    result = run_cli("run", "--strategy", "ps", "--nproc-per-node", "6", "--num-servers", "3",
                     "--ps-replicas", "1", "--max-restarts", "3", "--consistency", "asp",
                     "--epochs", "1", *JOB, "--out", str(out),
                     "--inject", "kill:rank=5:step=8,kill-during-copy:rank=4:step=8")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary, _ = load_run(out)
    by_server = {r["server"]: r for r in summary["recoveries"] if r["kind"] == "ps-server"}
    assert set(by_server) == {1, 2}, summary["recoveries"]
    assert by_server[2]["restored_from"] == "backup"
    assert by_server[2]["lost_acknowledged_updates"] == 0
    assert by_server[1]["lost_acknowledged_updates"] >= 8, by_server[1]
    assert summary["ps"]["lost_acknowledged_updates"] == by_server[1]["lost_acknowledged_updates"]
    log = (out / "logs" / "rank4.log").read_text()
    assert "acknowledged updates lost, since its backup held no copy" in log
    assert "acknowledged updates were lost by restarted servers" in result.stderr
    assert_no_orphans(out)


@pytest.mark.parametrize("consistency", ["asp", pytest.param("ssp", marks=stress_only)])
def test_every_acknowledged_push_is_applied_once_through_server_deaths(tmp_path, consistency):
    """asp (ssp in every stress round): each worker's record is a push every server
    acknowledged; each slice applied exactly those, through three kills and a hung server
    (its watchdog ends it after --hang-timeout-s; restarted, it takes its slice from the
    backup as after a kill), and server 0's ledger has every sample once per epoch."""
    out = tmp_path / "run"
    mode = ["--consistency", consistency] + (["--staleness", "1"] if consistency == "ssp" else [])
    faults = f"{KILLS.replace('step=24', 'step=50')},hang:rank=4:step=70"
    result = run_cli("run", *REPLICATED, *mode, "--epochs", "2", "--lr", "0.02", *JOB,
                     "--hang-timeout-s", "3", "--log-sample-ids", "--inject", faults,
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary, records = load_run(out)
    assert server_restores(summary) == [(0, "backup"), (1, "backup"), (0, "backup"),
                                        (1, "backup")], summary["recoveries"]  # fmt: skip
    acknowledged = len(records)
    assert all(r["committed"] for r in records)
    assert summary["ps"]["server_updates"] == [acknowledged, acknowledged], summary["ps"]
    assert acknowledged == -(-DIGITS // 32) * 2  # every lease of both epochs, once
    assert_exactly_once(records, 2)
    assert_ledger_once(out, 2)
    restored = [e for e in read_jsonl(out / "logs" / "ps_events.jsonl") if e["event"] == "restored"]
    assert all(e["from"] == "backup" for e in restored), restored
    assert_no_orphans(out)


def test_a_backup_is_refused_where_there_is_no_other_server(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--strategy", "ps", "--nproc-per-node", "3", "--ps-replicas", "1",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "--num-servers 2 or more" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_a_job_that_loses_both_copies_of_a_slice_fails_and_says_so(tmp_path):
    """Server 1 lost for good (its slice then lives only in rank 3, its backup's process),
    then rank 3 lost too: nothing holds those slices any more. The job fails, and says
    why."""
    out = tmp_path / "run"
    result = run_cli("run", *PS, "--ps-replicas", "1", "--consistency", "asp", *JOB,
                     "--epochs", "2", "--inject", "kill:rank=4:step=10,kill:rank=3:step=30",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "both copies of a slice are gone" in result.stderr, result.stderr[-3000:]
    # Both slices are gone: server 0's (rank 3 dead, its backup rank 4 dead before) and
    # server 1's (served by rank 3): whichever the launcher names, it names both ranks.
    assert (
        "server 0's backup (rank 4) is lost too" in result.stderr
        or "rank 3, which served server 1's slice, died too" in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert_no_orphans(out)


@stress_only
@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_servers_sigkilled_at_random_moments_lose_no_acknowledged_push(tmp_path, consistency):
    """The injected kills land before an update; a SIGKILL from outside lands anywhere: in
    a forward, between a forward and its reply (the push is then on the backup and its worker
    sends it again: applied once), in a copy to a restarted backup. Six of them, at moments
    drawn from the stress seed, each once the last victim's slice and the other's are both
    backed up again (the "backup_synced" events). asp: every count exact; bsp (with
    --deterministic): also the same weights, to the bit, as the run without kills."""
    rng = random.Random(int(os.environ.get(STRESS_SEED, "0")))
    out = tmp_path / "run"
    job = [*REPLICATED, "--max-restarts", "6", "--consistency", consistency, "--epochs", "8",
           "--lr", "0.02", *JOB, "--log-sample-ids"]  # fmt: skip
    if consistency == "bsp":
        job.append("--deterministic")
    proc = start(*job, "--out", str(out))
    events = out / "logs" / "ps_events.jsonl"

    def protected(since: float) -> bool:
        """Both slices backed up by processes that synced after ``since``."""
        synced = {e["server"] for e in read_jsonl(events)
                  if e["event"] == "backup_synced" and e["unix_time"] > since}  # fmt: skip
        return synced == {0, 1}

    wait_for_step(out, 3, proc)
    for _ in range(6):
        rank = rng.choice([3, 4])
        pid = worker_pid(out, rank)
        assert pid is not None and proc.poll() is None
        time.sleep(rng.uniform(0.0, 0.3))  # a moment drawn, not a wait for an event
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not protected(killed_at):
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.02)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    summary, records = load_run(out)
    restores = server_restores(summary)
    assert len(restores) == 6 and all(source == "backup" for _, source in restores), restores
    # asp: each record is a push every server acknowledged, each applied once; bsp: each
    # global step of 3 x 32 samples applied once.
    updates = -(-DIGITS // 32) * 8 if consistency == "asp" else -(-DIGITS // 96) * 8
    if consistency == "asp":
        assert len(records) == updates
    assert summary["ps"]["server_updates"] == [updates, updates], summary["ps"]
    assert_exactly_once(records, 8)
    assert_ledger_once(out, 8)
    assert_no_orphans(out)
    if consistency == "bsp":
        steady = tmp_path / "steady"
        result = run_cli("run", *job, "--out", str(steady))
        assert result.returncode == 0, result.stderr[-3000:]
        assert load_run(steady)[0]["params_sha256"] == summary["params_sha256"]


# The digits CNN's parameter count divides by neither 3, 5 nor 7: the slices differ in
# length by one element, and each backup holds a slice of another length than its own.
@pytest.mark.parametrize(
    ("num_servers", "consistency"),
    [
        (3, "bsp"),
        pytest.param(5, "asp", marks=stress_only),
        pytest.param(7, "ssp", marks=stress_only),
    ],  # fmt: skip
)
def test_uneven_slices_are_backed_up_and_train_as_without_backups(
    tmp_path, num_servers, consistency
):
    """A fault-free run with backups ends where the run without them ends (bsp: to the bit,
    under --deterministic), for a server count that does not divide the parameters. The
    backups' copies started sized like their own server's slice, failed on the first copy,
    and held the job until gloo's timeout."""
    mode = ["--consistency", consistency] + (["--staleness", "1"] if consistency == "ssp" else [])
    job = ["--strategy", "ps", "--nproc-per-node", str(num_servers + 3), "--num-servers",
           str(num_servers), *mode, *JOB, "--epochs", "1", "--timeout-s", "60"]  # fmt: skip
    if consistency == "bsp":
        job.append("--deterministic")
    runs = {}
    for name, extra in [("plain", []), ("backed", ["--ps-replicas", "1"])]:
        out = tmp_path / name
        result = run_cli("run", *job, *extra, "--out", str(out), timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = load_run(out)[0]
        assert_no_orphans(out)
    plain, backed = runs["plain"], runs["backed"]
    numels = backed["ps"]["server_numel"]
    assert len(set(numels)) == 2, numels  # the count does not divide: the case in question
    forwards = [r["forwards"] for r in backed["ps"]["replication"]]
    assert all(f > 0 for f in forwards), backed["ps"]["replication"]
    assert backed["ps"]["server_updates"] == plain["ps"]["server_updates"]
    if consistency == "bsp":
        assert backed["params_sha256"] == plain["params_sha256"]


# Both ends of slice 0's replication in one process; the backup's copy is one element short
# of the primary's slice (a bug in how a server sizes it). The primary waits for the ACK of
# its first forward on a link whose timeout is 300 s.
MISSIZED_BACKUP = """
import logging, threading, torch, torch.distributed as dist
from torch import nn
from scaletrain.strategies.param_server import replica
logging.basicConfig(level=logging.INFO)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
common = dict(num_servers=2, num_workers=1, attempt=0, store=store, timeout_s=300,
              new_store=lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False),
              stop=threading.Event())
sgd = lambda params: torch.optim.SGD(params, lr=0.1)
replica.Backup(index=1, param=torch.zeros(5), build_optimizer=sgd,
               on_promote=lambda state: None, **common).start()
param = nn.Parameter(torch.zeros(6))
state = {"param": param.detach().clone(), "optimizer": sgd([param]).state_dict(),
         "book": replica.Applied().encode()}
lock = threading.Condition()
primary = replica.Primary(index=0, lock=lock, full_state=lambda: state,
                          on_synced=lambda attempt: None, **common)
primary.start()
with lock:
    lock.wait_for(lambda: primary.link is not None)
    primary.forward(replica.Applied(version=1))
print("the primary went on")
"""


def test_a_backup_that_fails_but_not_by_a_death_ends_its_process_at_once(tmp_path):
    """A bug on the backup's side (here a copy of the wrong size) is not a lost primary:
    the process exits with the internal-failure status within seconds, and its launcher
    fails the job (never restarted: the same code would fail the same way). Caught and
    logged as a lost link, it left the primary waiting for its ACK until the link's timeout."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", MISSIZED_BACKUP], capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode == INTERNAL_EXIT_CODE, result.stderr[-3000:]
    assert "internal failure in the backup of slice 0" in result.stderr, result.stderr[-3000:]
    assert "this backup's (5,)" in result.stderr
    assert "the primary went on" not in result.stdout
