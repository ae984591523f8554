"""Claim: a --recovery inplace job of 8 replicas keeps at least 0.90 of its fault-free
throughput through a storm of faults, a random one every 15-30 s for 5 minutes, loses no
committed step, and trains every sample of every epoch once.

Each replica is a host of the netns lab (scaletrain/netns.py: its own network namespace and
address, one switch) and computes on a sleeping device (sleeping_device.py), so 8 replicas do
not fight over 2 cores. The schedule is drawn from --seed before the job starts: at each
moment a kind and a replica (never replica 0's host, which runs torchft's lighthouse: a real
cluster runs it on a machine of its own) that is not already under a fault:

- kill: SIGKILL the replica's process; its host's supervisor starts it again, and it heals
  from a live peer.
- stop: SIGSTOP it for 10 s, then SIGCONT (a frozen process: a GC pause, a swapping host).
- cut: its host's cable is cut for 10 s (the switch port goes down), then plugged back.
- slow: its device runs 3x slower for 30 s (a throttled GPU, a noisy neighbour).

The job runs --balance speed (a slow replica gets fewer samples of each step, in proportion
to its rate) and --hang-timeout-s 2 (a collective that waits on a frozen or cut-off replica
gives up after 2 s, and the step is dealt again over the others; a killed one's peers learn
at once, from their closed connections). Throughput is the samples trained per second from
the time the job first reaches step 10 (the storm starts there) to its last step. This host's
speed drifts between phases by more than the margin a retention is judged by, so the same
job without faults runs --repeats + 1 times, interleaved with --repeats storms (fault-free,
storm, fault-free, ...): each storm's retention is its throughput over the mean of the two
fault-free runs beside it, and the floor is on their median; the spread of both is reported.

A fault counts only once it is confirmed to have landed: a kill by its replica's death in the
run's incidents, a stop by the process found in state T (stopped), a cut and a slow-down by
the lab having done them. A fault that found no process (its replica was restarting) is an
error of the schedule, and fails the run.

Reported: the schedule and, for each fault, the longest pause between committed steps it
caused and when its replica committed a step again (recovered); committed steps lost (steps
numbered twice or skipped: in place nothing rolls back, so 0); samples trained twice or never
in each epoch (the committed steps of an epoch must cover its samples exactly once; a
replica killed after its step committed and before it wrote its record leaves samples
"unrecorded", trained but not listed); final test accuracy of both runs; the retention.
Floors (exit status 1 when one is missed): both runs end with status 0, every fault recovered,
no replica died of another's fault (its process exited while only others were faulted), 0
steps lost, 0 samples twice or never, accuracy within 0.05 of the fault-free runs', every
fault landed, and the median retention >= 0.90 (--min-retention).

What the emulation leaves out: the hosts' own cores (all 8 replicas share two, and a
restarted replica's Python start-up takes seconds of them), link latency (no netem in this
kernel), and device memory. The anchor: a public run of 32 torchft + DiLoCo replica groups on
a 16-core host kept 97.7% of its fault-free throughput through 62 faults in 30 minutes.

    sudo python benchmarks/chaos.py [--replicas 8] [--duration-s 300] [--seed 0] [--repeats 2]
                                    [--kinds kill,stop,cut,slow] [--faults N] [--no-baseline]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floors import Floors  # noqa: E402
from scale import DIGITS, TASK, flags  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from scaletrain.io import read_jsonl  # noqa: E402
from scaletrain.netns import NetworkLab, unavailable_reason  # noqa: E402

FLOORS = Floors()
KINDS = ("kill", "stop", "cut", "slow")
LASTS_S = {"kill": 0.0, "stop": 10.0, "cut": 10.0, "slow": 30.0}
SLOW_FACTOR = 3.0
START_STEP = 10  # the storm (and both runs' throughput window) starts here
WAIT_S = 1500  # the longest a run may take before the benchmark calls it a hang


@dataclass
class Fault:
    at_s: float  # after the storm starts
    kind: str
    replica: int
    started: float = 0.0  # unix time, once injected
    done: bool = False  # undone (SIGCONT, cable back, full speed), or nothing to undo
    landed: bool = False  # confirmed (a kill: by the run's incidents, after the run)
    missed: str = ""  # why it did not land (no process to signal)


def schedule(seed: int, replicas: int, per_host: int, duration_s: float, kinds: list[str],
             limit: int | None, gap_s: tuple[float, float]) -> list[Fault]:  # fmt: skip
    """The storm, drawn before the job starts: a fault every gap_s, none on host 0's replicas,
    none on a replica still under one."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = rng.uniform(*gap_s)
    while t < duration_s and (limit is None or len(faults) < limit):
        busy = {f.replica for f in faults if f.at_s + LASTS_S[f.kind] + 5 > t}
        free = [r for r in range(per_host, replicas) if r not in busy]
        if free:
            faults.append(Fault(t, rng.choice(kinds), rng.choice(free)))
        t += rng.uniform(*gap_s)
    return faults


def job_args(epochs: int, batch: int) -> list[str]:
    return flags({
        "task": TASK, "dataset": "digits", "model": "mlp", "width": 16, "batch_size": batch,
        "num_samples": DIGITS, "epochs": epochs, "seed": 1, "num_threads": 1,
        "log_sample_ids": True, "recovery": "inplace", "balance": "speed",
        "balance_every": 3, "max_restarts": 100, "hang_timeout_s": 2.0, "timeout_s": 20.0,
    })  # fmt: skip


def records(out: Path) -> list[dict[str, Any]]:
    return read_jsonl(out / "metrics.jsonl")  # none yet, or a torn last line: skipped


def replica_pid(lab: NetworkLab, replica: int, per_host: int) -> int | None:
    """The worker process of ``replica``, if it runs now."""
    pids = subprocess.run(["ip", "netns", "pids", lab.hosts[replica // per_host].netns],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        # A replica names itself "... -m scaletrain.worker RUN_DIR (rank R)" (worker.forked).
        if b"scaletrain.worker" in cmdline and f"(rank {replica})".encode() in cmdline:
            return int(pid)
    return None


def signal_replica(lab: NetworkLab, replica: int, per_host: int, sig: int) -> None:
    pid = replica_pid(lab, replica, per_host)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stopped_now(pid: int, wait_s: float = 1.0) -> bool:
    """Whether process ``pid`` is in state T (stopped) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("State:") and line.split()[1] in ("T", "t"):
                    return True
        time.sleep(0.01)
    return False


def confirm_kills(faults: list[Fault], incidents: list[dict[str, Any]]) -> None:
    """A kill landed when the run's incidents record its replica's death after it."""
    for f in faults:
        if f.kind == "kill" and f.started and not f.missed:
            f.landed = any(i["rank"] == f.replica and i.get("died_at", 0) >= f.started - 0.5
                           for i in incidents)  # fmt: skip
            f.missed = "" if f.landed else "no death of its replica in the run's incidents"


class Storm:
    """Injects the schedule's faults at their times and undoes each after it lasted."""

    def __init__(self, lab: NetworkLab, faults: list[Fault], per_host: int, slow_dir: Path) -> None:
        self.lab, self.faults, self.per_host, self.slow_dir = lab, faults, per_host, slow_dir
        self.stopped: dict[int, int] = {}  # replica -> the pid SIGSTOPped

    def inject(self, fault: Fault) -> None:
        fault.started = time.time()
        r = fault.replica
        pid = replica_pid(self.lab, r, self.per_host) if fault.kind in ("kill", "stop") else None
        if fault.kind in ("kill", "stop") and pid is None:
            fault.missed, fault.done = "no process of its replica to signal", True
        elif fault.kind == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
            fault.done = True  # landed once the run's incidents have its death
        elif fault.kind == "stop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
                self.stopped[r] = pid  # type: ignore[assignment]
            fault.landed = stopped_now(pid)  # type: ignore[arg-type]
            fault.missed = "" if fault.landed else "its process was not stopped"
        elif fault.kind == "cut":
            self.lab.link_down(r // self.per_host)  # every replica of its host
            fault.landed = True
        else:
            (self.slow_dir / f"rank{r}").write_text(f"{SLOW_FACTOR}\n")
            fault.landed = True
        print(f"  {fault.started - self.t0:6.1f} s  {fault.kind:<4} replica {r}", flush=True)

    def undo(self, fault: Fault) -> None:
        fault.done = True
        r = fault.replica
        if fault.kind == "stop" and r in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.stopped.pop(r), signal.SIGCONT)
        elif fault.kind == "cut":
            self.lab.link_up(r // self.per_host)
        elif fault.kind == "slow":
            (self.slow_dir / f"rank{r}").unlink(missing_ok=True)

    def run(self, job: subprocess.Popen[str]) -> None:
        """Until every fault is injected and undone, or the job ends."""
        self.t0 = time.time()
        while job.poll() is None:
            now = time.time() - self.t0
            for fault in self.faults:
                if not fault.started and now >= fault.at_s:
                    self.inject(fault)
                elif fault.started and not fault.done and now >= fault.at_s + LASTS_S[fault.kind]:
                    self.undo(fault)
            if all(f.done for f in self.faults):
                return
            time.sleep(0.05)
        for fault in self.faults:  # the job ended first: leave nothing frozen or cut
            if fault.started and not fault.done:
                self.undo(fault)


def wait_for_step(out: Path, step: int, job: subprocess.Popen[str]) -> float:
    deadline = time.monotonic() + WAIT_S
    while not any(r["step"] >= step for r in records(out)):
        if job.poll() is not None:
            raise RuntimeError(f"host 0's job ended (status {job.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} within {WAIT_S} s")
        time.sleep(0.1)
    return time.time()


def run_job(root: Path, name: str, replicas: int, per_host: int, args: list[str],
            faults: list[Fault]) -> dict[str, Any]:  # fmt: skip
    out = root / name
    slow_dir = root / f"{name}-slow"
    slow_dir.mkdir(parents=True)
    env = {"SCALETRAIN_DEVICE_MS": "4", "SCALETRAIN_DEVICE_SLOW_DIR": str(slow_dir)}
    row: dict[str, Any] = {"run": name, "replicas": replicas}
    started = time.time()
    with NetworkLab(replicas // per_host) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain(args, out, shared_out=True, env=env, nproc_per_node=per_host,
                                      output=root / f"{name}-hosts")  # fmt: skip
        job = procs[0]
        row["storm_start"] = wait_for_step(out, START_STEP, job)
        row["to_step_10_s"] = row["storm_start"] - started
        if faults:
            print(f"{name}: the storm starts at step {START_STEP}", flush=True)
            Storm(lab, faults, per_host, slow_dir).run(job)
        try:
            job.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            job.kill()
            raise RuntimeError(f"host 0's job did not end within {WAIT_S} s") from None
        row["status"] = job.returncode
        for proc in procs[1:]:  # the others end by themselves; the lab kills what is left
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
    row["wall_s"] = time.time() - started
    ok = row["status"] == 0 and (out / "summary.json").exists()
    FLOORS.check(f"{name}: host 0's job ends with status 0", ok)
    if not ok:
        err = (root / f"{name}-hosts" / "host0.err").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{name}: host 0 ended with status {row['status']}: {err}")
    summary = json.loads((out / "summary.json").read_text())
    row["test_accuracy"] = summary.get("test_accuracy")
    row["lost_steps"] = sum(r.get("lost_steps", 0) for r in summary.get("recoveries", []))
    # A replica that died without a fault of its own: the storm's damage spread.
    targets = {f.replica for f in faults}
    deaths = read_jsonl(out / "logs" / "incidents.jsonl")
    confirm_kills(faults, deaths)
    row["collateral_deaths"] = [
        i["rank"] for i in deaths if i.get("kind") == "inplace" and i["rank"] not in targets
    ]
    row |= account(records(out), DIGITS, row["storm_start"])
    return row


def account(recs: list[dict[str, Any]], num_samples: int, since: float) -> dict[str, Any]:
    """Steps and samples, from the records of the committed steps (one per participant)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_step[r["step"]].append(r)
    last = max(by_step)
    gaps = [s for s in range(1, last + 1) if s not in by_step]
    by_epoch: dict[int, list[int]] = defaultdict(list)
    dealt: Counter[int] = Counter()
    unrecorded = 0
    for rs in by_step.values():
        epoch, global_samples = rs[0]["epoch"], rs[0]["global_samples"]
        dealt[epoch] += global_samples
        ids = [i for r in rs for i in r["sample_ids"][: r["samples"]]]
        by_epoch[epoch] += ids
        unrecorded += global_samples - len(ids)
    twice = sum(c - 1 for ids in by_epoch.values() for c in Counter(ids).values() if c > 1)
    twice += sum(max(0, n - num_samples) for n in dealt.values())
    never = sum(max(0, num_samples - n) for n in dealt.values())
    ends = {s: max(r["unix_time"] for r in rs) for s, rs in by_step.items()}
    window = [s for s in by_step if ends[s] > since]
    span = max(ends.values()) - since
    trained = sum(by_step[s][0]["global_samples"] for s in window)
    return {
        "steps": last, "steps_missing": len(gaps), "epochs": len(dealt),
        "samples_twice": twice, "samples_never": never, "samples_unrecorded": unrecorded,
        "samples_per_s": trained / span if span > 0 else 0.0,
        "step_ends": sorted(ends.values()),
    }  # fmt: skip


def fault_outcomes(faults: list[Fault], recs: list[dict[str, Any]],
                   step_ends: list[float]) -> list[dict[str, Any]]:  # fmt: skip
    """For each fault: the longest pause between committed steps from it to 15 s after it
    ended (or to the next fault), and the first step its replica committed after it ended
    (None: never again)."""
    out = []
    started = sorted(f.started for f in faults if f.started)
    for f in faults:
        if not f.started:
            continue
        end = f.started + LASTS_S[f.kind]
        upto = min([end + 15] + [t for t in started if t > f.started])
        window = [t for t in step_ends if f.started <= t <= upto]
        before = max((t for t in step_ends if t < f.started), default=f.started)
        pauses = [b - a for a, b in zip([before, *window], window, strict=False)]
        back = [r["unix_time"] for r in recs if r["rank"] == f.replica and r["unix_time"] > end]
        out.append({
            "kind": f.kind, "replica": f.replica, "at_s": round(f.at_s, 1),
            "longest_pause_s": round(max(pauses, default=0.0), 2),
            "back_after_s": round(min(back) - end, 2) if back else None,
        })  # fmt: skip
    return out


def report_storm(root: Path, name: str, storm: dict[str, Any], faults: list[Fault]) -> None:
    """One storm's faults (each confirmed, its pause and its recovery) and its floors."""
    outcomes = fault_outcomes(faults, records(root / name), storm["step_ends"])
    storm["faults"] = outcomes
    print(f"\n{name}:\n{'fault':>5} {'replica':>8} {'at':>7} {'longest pause':>14} "
          f"{'back after':>11}")  # fmt: skip
    for o in outcomes:
        back = "never" if o["back_after_s"] is None else f"{o['back_after_s']:.1f}s"
        print(f"{o['kind']:>5} {o['replica']:>8} {o['at_s']:>6.0f}s "
              f"{o['longest_pause_s']:>13.1f}s {back:>11}")  # fmt: skip
    missed = [f"{f.kind} of replica {f.replica} at {f.at_s:.0f} s: {f.missed}"
              for f in faults if not f.landed]  # fmt: skip
    storm["faults_missed"] = missed
    landed = [o for o, f in zip(outcomes, [f for f in faults if f.started], strict=True)
              if f.landed]  # fmt: skip
    recovered = sum(o["back_after_s"] is not None for o in landed)
    print(
        f"faults scheduled {len(faults)}, landed {len(landed)}, recovered {recovered}; "
        f"committed steps lost {storm['lost_steps'] + storm['steps_missing']}; samples twice "
        f"{storm['samples_twice']}, never {storm['samples_never']} (unrecorded "
        f"{storm['samples_unrecorded']})"
    )
    for line in missed:
        print(f"  did not land (an error of the schedule): {line}")
    print(f"replicas that died without a fault of their own: {storm['collateral_deaths']}")
    FLOORS.check(f"{name}: every scheduled fault landed", not missed)
    FLOORS.check(f"{name}: every fault recovered", recovered == len(landed))
    FLOORS.check(f"{name}: no replica died of another's fault", not storm["collateral_deaths"])
    FLOORS.check(f"{name}: no committed step lost",
                 storm["lost_steps"] + storm["steps_missing"] == 0)  # fmt: skip
    FLOORS.check(f"{name}: every sample of every epoch once",
                 storm["samples_twice"] == storm["samples_never"] == 0)  # fmt: skip


def judge_retention(rows: dict[str, dict[str, Any]], repeats: int, floor: float) -> None:
    """Each storm against the mean of the fault-free runs before and after it; the floor on
    the median, with the spread of both printed."""
    base = [rows[f"fault-free-{i}"]["samples_per_s"] for i in range(1, repeats + 2)]
    kept = []
    for i in range(1, repeats + 1):
        storm = rows[f"storm-{i}"]
        storm["retention"] = storm["samples_per_s"] / ((base[i - 1] + base[i]) / 2)
        kept.append(storm["retention"])
    median = statistics.median(kept)
    rows["retention"] = {"each": kept, "median": median, "min": min(kept), "max": max(kept),
                         "fault_free_samples_per_s": base,
                         "fault_free_spread": max(base) / min(base)}  # fmt: skip
    ok = FLOORS.check(f"median retention >= {floor}", median >= floor)
    print(f"\nsamples/s from step {START_STEP}: fault-free {', '.join(f'{b:.0f}' for b in base)} "
          f"(spread {max(base) / min(base):.2f}x); retention {', '.join(f'{k:.3f}' for k in kept)}"
          f", median {median:.3f} {ok}")  # fmt: skip
    accuracy = [rows[n]["test_accuracy"] for n in rows if "test_accuracy" in rows[n]]
    ref = statistics.mean(rows[f"fault-free-{i}"]["test_accuracy"] for i in range(1, repeats + 2))
    close = FLOORS.check("accuracy within 0.05 of the fault-free runs'",
                         all(abs(a - ref) <= 0.05 for a in accuracy))  # fmt: skip
    print(f"test accuracy: {', '.join(f'{a:.3f}' for a in accuracy)} {close}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--per-host", type=int, default=1, help="replicas on each host")
    parser.add_argument("--duration-s", type=float, default=300.0, help="the storm's length")
    parser.add_argument(
        "--epochs", type=int, default=0, help="default: what lasts --duration-s and a minute"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--faults", type=int, default=None, help="at most this many")
    parser.add_argument("--gap-s", default="15,30", help="between faults: MIN,MAX seconds")
    parser.add_argument("--min-retention", type=float, default=0.90)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="storms, each between two fault-free runs (default 2: 5 runs)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the fault-free run (no retention, no accuracy check)",
    )
    parser.add_argument("--out", default=str(REPO / "runs" / "chaos"))
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    gap = tuple(float(x) for x in args.gap_s.split(","))
    hosts, left = divmod(args.replicas, args.per_host)
    if not set(kinds) <= set(KINDS) or hosts < 2 or left or len(gap) != 2:
        parser.error(f"--kinds: some of {','.join(KINDS)}; --replicas: 2 hosts' worth or "
                     "more, a multiple of --per-host; --gap-s: MIN,MAX")  # fmt: skip
    reason = unavailable_reason()
    if reason:
        sys.exit(f"error: the netns lab is unavailable here: {reason}")
    batch = 8
    # A step takes about 8 samples x 4 ms x 3 (forward, backward) on the device, and some
    # machinery; an epoch of 1437 digits is 1437 / (8 x replicas) steps.
    steps_per_epoch = DIGITS / (batch * args.replicas)
    epochs = args.epochs or max(2, round((args.duration_s + 60) / (0.13 * steps_per_epoch)))
    faults = schedule(args.seed, args.replicas, args.per_host, args.duration_s, kinds,
                      args.faults, gap)  # fmt: skip
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    job = job_args(epochs, batch)
    print(f"{args.replicas} replicas in place, {epochs} epochs; the storm (seed {args.seed}):")
    for f in faults:
        print(f"  {f.at_s:6.1f} s  {f.kind:<4} replica {f.replica}")
    rows: dict[str, dict[str, Any]] = {}
    storms: list[tuple[str, list[Fault]]] = []
    try:
        for i in range(1, args.repeats + 2):
            if not args.no_baseline:
                print(f"\nthe same job without faults ({i}) ...", flush=True)
                name = f"fault-free-{i}"
                rows[name] = run_job(root, name, args.replicas, args.per_host, job, [])
            if i <= args.repeats:
                print(f"\nthe storm ({i}) ...", flush=True)
                storm_faults = copy.deepcopy(faults)
                name = f"storm-{i}"
                rows[name] = run_job(root, name, args.replicas, args.per_host, job, storm_faults)
                storms.append((name, storm_faults))
    except RuntimeError as e:
        FLOORS.check("every run completes", False)
        print(f"{e}; see {root}", flush=True)
        FLOORS.finish()
        return
    for name, storm_faults in storms:
        report_storm(root, name, rows[name], storm_faults)
    for row in rows.values():
        row.pop("step_ends", None)
    if not args.no_baseline:
        judge_retention(rows, args.repeats, args.min_retention)
    (root / "chaos.json").write_text(json.dumps(rows, indent=1))
    print(f"\nrun directories: {root}")
    FLOORS.finish()


if __name__ == "__main__":
    os.umask(0o022)
    main()
