"""A parameter-server job that is preempted (SIGTERM, as SLURM and Kubernetes warn a job
before taking it away): every worker leaves after its step, then each server checkpoints its
slice with nothing in flight (server 0 its data plan too), the launcher exits 3, and the same
command continues the job from those checkpoints with every sample trained once per epoch.
A job killed whole continues from the newest moment every server checkpointed: under bsp a
global step, under asp and ssp a cut (the servers copy their state together, with no push in
flight: strategies/param_server/cuts.py). Real launchers, real signals and SIGKILLs, gloo on
loopback."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from scaletrain.config import RunConfig, dumps_toml, with_overrides
from scaletrain.fault.checkpoint import load_latest, read_index
from scaletrain.fault.jobs import job_runs_path
from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
from scaletrain.io import append_jsonl, read_jsonl
from scaletrain.launch.jobs import plan_job_run
from scaletrain.strategies.param_server.cuts import consistent_checkpoint
from tests.conftest import assert_no_orphans, kill_job, run_cli, stress_only
from tests.dist.test_jobs import start, wait_for_step
from tests.dist.test_param_server import DIGITS, JOB, PS, assert_exactly_once, assert_ledger_once


# asp: the workers leave one by one while the others' pushes are still applied; bsp (every
# make stress round) leaves a step's barrier to the workers still there.
@pytest.mark.parametrize("consistency", ["asp", pytest.param("bsp", marks=stress_only)])
def test_a_preempted_parameter_server_job_continues_with_every_sample_once(tmp_path, consistency):
    out = tmp_path / "run"
    job = [*PS, "--consistency", consistency, "--lr", "0.05", "--epochs", "3", *JOB,
           "--log-sample-ids", "--out", str(out)]  # fmt: skip
    # Worker 0 is slowed (sleeps, the same math) so that the SIGTERM lands mid-run. asp's
    # goes to the launcher's whole process group (as SLURM signals every process of a job
    # step, and `timeout` its group: the fork server, in that group, once died of it and
    # every worker with it), bsp's to the launcher alone.
    proc = start(*job, "--inject", "slow:rank=0:factor=4")
    wait_for_step(out, 5, proc)
    (os.killpg if consistency == "asp" else os.kill)(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "preempted by SIGTERM" in stderr and "Traceback" not in stderr
    # Each server checkpointed once every worker had left: the slices of the same updates.
    versions = [read_index(out / "checkpoints" / f"server{k}")[-1]["step"] for k in (0, 1)]
    assert versions[0] == versions[1] > 0, versions
    assert not (out / "summary.json").exists()
    assert_no_orphans(out)

    result = run_cli("run", *job)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    [resume] = summary["recoveries"]
    assert resume["kind"] == "resume" and resume["job_run"] == 1
    assert resume["cause"] == "job run 0 preempted" and resume["step"] == versions[0]
    records = read_jsonl(out / "metrics.jsonl")
    assert {r["job_run"] for r in records} == {0, 1}
    assert_exactly_once(records, 3)  # across both runs: nothing trained twice, nothing lost
    assert_ledger_once(out, 3)
    assert summary["samples"] == 3 * DIGITS and summary["job_runs"] == 2
    # It trained on from the checkpoints (chance: 0.1). Not a claim of asp's accuracy after
    # 3 epochs at this lr: 0.59-0.75 in the runs that checked it.
    assert summary["test_accuracy"] > 0.3
    assert_no_orphans(out)


def test_a_parameter_server_job_continues_only_from_checkpoints_of_one_moment(tmp_path):
    """Refused before anything starts, and why: a job killed whole without a checkpoint of
    one cut (asp) or global step (bsp) on every server, a preempted one whose servers left
    none."""
    for consistency, message in [("asp", "killed, or its machine lost.* of one cut"),
                                 ("bsp", "without checkpoints of one global step")]:  # fmt: skip
        out = tmp_path / consistency
        out.mkdir()
        overrides = {"strategy": "ps", "nproc_per_node": 3, "consistency": consistency}
        cfg = with_overrides(RunConfig(), {**overrides, "out": str(out)})
        (out / "config.toml").write_text(dumps_toml(cfg.to_dict()))
        append_jsonl(job_runs_path(out), {"job_run": 0, "started_at": 1.0, "attempt_base": 0})
        append_jsonl(out / "metrics.jsonl", {"step": 1, "rank": 0})  # it trained, then died
        with pytest.raises(ValueError, match=message):
            plan_job_run(cfg, out, "ps")
    append_jsonl(job_runs_path(out), {"job_run": 0, "ended_at": 2.0, "how": "preempted"})
    with pytest.raises(ValueError, match="left no checkpoint"):  # preempted before it wrote
        plan_job_run(cfg, out, "ps")


def test_a_bsp_parameter_server_job_killed_whole_continues_from_its_last_common_step(tmp_path):
    """bsp: the servers apply each global step once, so the newest step every server
    checkpointed (--checkpoint-every) is a consistent state of the job: the same command
    continues from it after a whole-job SIGKILL, the steps after it trained again."""
    out = tmp_path / "run"
    # Every worker hangs before step 13 (once in the job: its first run), so the first run
    # stands still there, with checkpoints of steps 5 and 10 on both servers.
    hangs = ",".join(f"hang:rank={r}:step=13" for r in range(3))
    job = [*PS, "--consistency", "bsp", "--epochs", "2", *JOB, "--checkpoint-every", "5",
           "--log-sample-ids", "--inject", hangs, "--out", str(out)]  # fmt: skip
    proc = start(*job)
    fired = [out / "logs" / "faults" / f"hang-rank{r}-step13" for r in range(3)]
    indexes = [out / "checkpoints" / f"server{k}" for k in (0, 1)]
    deadline = time.monotonic() + 120
    while not (all(f.exists() for f in fired)
               and all(10 in [e["step"] for e in read_index(d)] for d in indexes)):  # fmt: skip
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.05)
    kill_job(proc, out)
    assert consistent_checkpoint(out, 2, "bsp") == [10, 10]

    result = run_cli("run", *job)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    [resume] = summary["recoveries"]
    assert (resume["kind"], resume["job_run"], resume["step"]) == ("resume", 1, 10)
    assert resume["lost_steps"] == 2  # steps 11 and 12, trained again
    assert "ended without a word" in resume["cause"]
    # Steps 11 and 12 of the killed run were trained again: without them, each sample once
    # (server 0's ledger: each applied lease, with the version that applied it).
    ledger = read_jsonl(out / "logs" / "ps_ledger.jsonl")
    redone = [e for e in ledger if e["job_run"] == 0 and e["version"] > 10]
    assert {e["version"] for e in redone} == {11, 12}
    kept = [{**e, "committed": True} for e in ledger if e not in redone]
    assert_exactly_once(kept, 2)
    assert summary["samples"] == 2 * DIGITS and summary["job_runs"] == 2
    assert_no_orphans(out)


def cuts_on_disk(directory) -> dict[tuple[int, ...], dict]:
    """Each intact checkpoint of a cut in a server's directory: its name -> the workers'
    last pushes it applied."""
    found = {}
    for entry in read_index(directory):
        state, _ = load_latest(directory, below=entry["step"] + 1)
        if state is not None and state["version"] == entry["step"] and state.get("cut"):
            found[tuple(state["cut"])] = state["clocks"]
    return found


@pytest.mark.parametrize("consistency", ["asp", pytest.param("ssp", marks=stress_only)])
def test_an_asynchronous_parameter_server_job_killed_whole_continues_from_its_last_cut(
    tmp_path, consistency
):
    """asp and ssp: every --checkpoint-every updates the servers take a cut (no lease out,
    each server's copy of the same pushes). A SIGKILL of the whole job mid-run, pushes in
    flight, and the same command continues from the newest cut on every server: what was
    applied after it is trained again, every other sample once per epoch. ssp's runs with
    backups of the slices (--ps-replicas 1): a whole-job kill takes them with it, and the
    cuts are what continues the job, as without them."""
    out = tmp_path / "run"
    bound = ["--staleness", "2", "--ps-replicas", "1"] if consistency == "ssp" else []
    job = [*PS, "--consistency", consistency, *bound, "--lr", "0.05", "--epochs", "2", *JOB,
           "--checkpoint-every", "8", "--log-sample-ids", "--out", str(out)]  # fmt: skip
    # Worker 0 is slowed (sleeps, the same math) so that the kill lands mid-run.
    proc = start(*job, "--inject", "slow:rank=0:factor=4")
    deadline = time.monotonic() + 120
    while (cut := consistent_checkpoint(out, 2, consistency)) is None or cut[0] < 16:
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.05)
    kill_job(proc, out)
    cut = consistent_checkpoint(out, 2, consistency)
    assert cut is not None
    # Both servers' copies of the cut hold the same pushes: each worker's last one alike,
    # and as many (no server restarted: its version counts the pushes it applied).
    copies = [load_latest(out / "checkpoints" / f"server{k}", below=cut[k] + 1)[0]
              for k in (0, 1)]  # fmt: skip
    assert copies[0]["clocks"] == copies[1]["clocks"] and copies[0]["clocks"]
    assert cut[0] == cut[1] and copies[0]["cut"] == copies[1]["cut"]
    # Every cut on disk, not only the newest: its copies hold the same pushes.
    every = [cuts_on_disk(out / "checkpoints" / f"server{k}") for k in (0, 1)]
    both = set(every[0]) & set(every[1])
    assert both, every
    for name in both:
        assert every[0][name] == every[1][name], (name, every[0][name], every[1][name])
    events = read_jsonl(out / "logs" / "ps_events.jsonl")
    taken = [e for e in events if e["event"] == "cut"]
    assert taken and all(e["paused_s"] < 30 for e in taken)

    result = run_cli("run", *job)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    [resume] = summary["recoveries"]
    assert (resume["kind"], resume["job_run"], resume["step"]) == ("resume", 1, cut[0])
    ledger = read_jsonl(out / "logs" / "ps_ledger.jsonl")
    redone = {e["version"] for e in ledger if e["job_run"] == 0 and e["version"] > cut[0]}
    assert resume["lost_steps"] == len(redone)
    assert "ended without a word" in resume["cause"]
    # Each server restored its copy of that cut.
    restored = [e for e in read_jsonl(out / "logs" / "ps_events.jsonl")
                if e["event"] == "restored" and e["attempt"] == 0]  # fmt: skip
    assert sorted((e["server"], e["version"]) for e in restored) == [(0, cut[0]), (1, cut[1])]
    # What server 0 applied after the cut was trained again; without it, each sample once
    # (server 0's ledger: each applied lease, with the version that applied it).
    kept = [{**e, "committed": True} for e in ledger
            if e["job_run"] == 1 or e["version"] <= cut[0]]  # fmt: skip
    assert_exactly_once(kept, 2)
    assert summary["samples"] == 2 * DIGITS and summary["job_runs"] == 2
    assert_no_orphans(out)
