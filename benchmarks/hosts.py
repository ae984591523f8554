"""Claim: 8 hosts x 4 workers, over shaped links, survive a host's cable cut for 10 s and
another host powered off mid-epoch, in ddp (restart mode) and with the parameter server, and
finish with every sample of every epoch trained exactly once.

The netns lab (scaletrain/netns.py) gives each host its own network namespace and address,
all on one switch; every link is shaped to --rate (1 Gbit/s) by tbf. Each worker computes on
a sleeping device (sleeping_device.py), so 32 workers do not fight over 2 cores. What the lab
leaves out: link latency (this kernel has no netem, so a hop costs what a veth pair costs,
tens of microseconds, not the 0.5 ms of a switched network), and the hosts' own cores and
disks (all 32 processes share two cores and one file system; the run directory is shared, as
restart recovery across nodes needs).

ddp: --nnodes 6:8 (the job goes on with 6 hosts or more), a checkpoint every 5 steps. Host 3's
cable is cut at step 10 and plugged back 10 s later; once the job trains again, host 5 is
powered off (every process SIGKILLed at once). ps: the 4 servers on host 7, 28 workers on hosts
0-6, bsp; host 3's cable is cut for 10 s, then host 5 is powered off.

Checks (exit status 1 when one fails): host 0's job ends with status 0, its summary.json says
how the world changed, and every sample of every epoch is trained exactly once (the steps that
were kept). The table: the longest stall between two steps after each fault, the job's wall
time, the world it ended with; the JSON rows add each recovery as summary.json reports it.

    sudo python benchmarks/hosts.py [--modes ddp,ps] [--hosts 8] [--workers-per-host 4]
                                    [--faults cut,power-off] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from floors import Floors  # noqa: E402
from scale import DIGITS, TASK, exactly_once, flags  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from scaletrain.io import read_jsonl  # noqa: E402
from scaletrain.netns import NetworkLab, unavailable_reason  # noqa: E402

FLOORS = Floors()
CUT_S = 10.0
WAIT_S = 900  # the longest any phase may take before the benchmark calls it a hang


def job_flags(mode: str, per_host: int, samples: int) -> list[str]:
    base: dict[str, Any] = {
        "task": TASK, "dataset": "digits", "model": "mlp", "width": 16, "batch_size": 2,
        "num_samples": samples, "epochs": 4, "seed": 1, "num_threads": 1,
        "log_sample_ids": True, "timeout_s": 20.0,
    }  # fmt: skip
    if mode == "ddp":
        base |= {"checkpoint_every": 5, "max_restarts": 6, "hang_timeout_s": 8.0,
                 "rdzv_last_call_s": 5, "rdzv_keep_alive_s": 2}  # fmt: skip
    else:  # the last host's processes are the servers: one per worker process there
        # 28 workers share each epoch's steps: more epochs, for both faults to land mid-run.
        base |= {"strategy": "ps", "num_servers": per_host, "consistency": "bsp",
                 "barrier_timeout_s": 5.0, "lr": 0.05, "epochs": 16}  # fmt: skip
    return flags(base)


def records(out: Path) -> list[dict[str, Any]]:
    return read_jsonl(out / "metrics.jsonl")  # none yet, or a torn last line: skipped


def wait_for(what: str, predicate: Any, first: subprocess.Popen[str]) -> float:
    """Until ``predicate()`` (polling the run directory: the job's own records); the time."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if first.poll() is not None:
            err = first.communicate()[1].strip().splitlines()[-3:]
            raise RuntimeError(
                f"host 0's job ended (status {first.returncode}) before {what}: {err}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {WAIT_S} s")
        time.sleep(0.2)
    return time.time()


def recovered(mode: str, out: Path, fault_at: float, first: subprocess.Popen[str]) -> float:
    """Wait until the job trains again after a fault at ``fault_at`` (ddp: a step of a newer
    attempt, the world restarted without the lost host; ps: steps well after the barrier
    dropped the lost workers); the stall: the longest pause between two consecutive steps
    (of any rank) from the fault to then."""
    attempt = max((r.get("attempt", 0) for r in records(out)), default=0)
    if mode == "ddp":
        wait_for(
            "a step after the restart",
            lambda: any(r.get("attempt", 0) > attempt for r in records(out)),
            first,
        )
    else:
        wait_for(
            "steps after the barrier dropped the lost workers",
            lambda: any(r["unix_time"] > fault_at + 10 for r in records(out)),
            first,
        )
    times = sorted(r["unix_time"] for r in records(out))
    before = max((t for t in times if t <= fault_at), default=fault_at)
    window = [before, *(t for t in times if t > fault_at)]
    return max(b - a for a, b in zip(window, window[1:], strict=False))


def run_mode(
    mode: str, root: Path, hosts: int, per_host: int, rate: str, faults: list[str]
) -> dict[str, Any]:
    out = root / mode
    samples = DIGITS
    args = job_flags(mode, per_host, samples)
    env = {"SCALETRAIN_DEVICE_MS": "2", "SCALETRAIN_JOIN_TOKEN": f"hosts benchmark {mode}"}
    cut, dead = 1 + hosts // 4, hosts - 3  # 3 and 5 of 8; never the servers' last host
    row: dict[str, Any] = {"mode": mode, "processes": hosts * per_host}
    started = time.time()
    with NetworkLab(hosts, rate=rate) as lab:
        lab.wait_ready()
        nnodes = f"{hosts - 2}:{hosts}" if mode == "ddp" else ""
        procs = lab.launch_scaletrain(args, out, nproc_per_node=per_host, nnodes=nnodes,
                                      shared_out=True, env=env)  # fmt: skip
        first = procs[0]
        at = wait_for("step 10", lambda: any(r["step"] >= 10 for r in records(out)), first)
        row["first_steps_s"] = at - started
        if "cut" in faults:
            lab.link_down(cut)
            cut_at = time.time()
            # The cable stays out CUT_S, whatever the job does meanwhile (an event here would
            # be the job's, and the fault is the world's: it lasts as long as it lasts).
            time.sleep(CUT_S)
            lab.link_up(cut)
            row["cut_stall_s"] = recovered(mode, out, cut_at, first)
        if "power-off" in faults:
            lab.kill_host(dead)
            row["power_off_stall_s"] = recovered(mode, out, time.time(), first)
        try:
            first.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            first.kill()
            raise RuntimeError(f"host 0's job did not end within {WAIT_S} s") from None
        row["wall_s"] = time.time() - started
        row["host0_status"] = first.returncode
        # The other hosts end by themselves (done, or given up once cut off); the lab kills
        # what is left when it closes.
        statuses = []
        for proc in procs[1:]:
            try:
                statuses.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                statuses.append(None)
        row["other_statuses"] = statuses
    ok = row["host0_status"] == 0 and (out / "summary.json").exists()
    FLOORS.check(f"{mode} on {hosts} hosts x {per_host}: host 0's job ends with status 0", ok)
    if not ok:
        log = out / "logs"
        print(f"{mode}: host 0 ended with status {row['host0_status']}; see {log}", flush=True)
        return row
    summary = json.loads((out / "summary.json").read_text())
    row["world_at_end"] = summary["world_size"]
    row["test_accuracy"] = summary.get("test_accuracy")
    row["recoveries"] = [
        {k: r.get(k) for k in ("cause", "kind", "world_size", "detected_s", "recovery_s",
                               "resumed_s", "rank", "ranks")}
        for r in summary.get("recoveries", [])
    ]  # fmt: skip
    once = exactly_once(out, samples)
    row["exactly_once"] = once
    FLOORS.check(f"{mode} on {hosts} hosts: every sample once per epoch", once)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="ddp,ps")
    parser.add_argument("--hosts", type=int, default=8, help="4 or more")
    parser.add_argument("--workers-per-host", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--faults", default="cut,power-off", help="cut, power-off, or both")
    parser.add_argument("--out", default=str(REPO / "runs" / "hosts"))
    args = parser.parse_args()
    if args.hosts < 4 or not set(args.faults.split(",")) <= {"cut", "power-off"}:
        parser.error("--hosts: 4 or more; --faults: cut, power-off, or cut,power-off")
    reason = unavailable_reason()
    if reason:
        sys.exit(f"error: the netns lab is unavailable here: {reason}")
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    rows = []
    for mode in args.modes.split(","):
        print(f"{mode}: {args.hosts} hosts x {args.workers_per_host} over {args.rate} ...",
              flush=True)  # fmt: skip
        try:
            row = run_mode(mode, root, args.hosts, args.workers_per_host, args.rate,
                           args.faults.split(","))  # fmt: skip
        except RuntimeError as e:
            FLOORS.check(f"{mode} on {args.hosts} hosts completes", False)
            print(f"{mode}: {e}; see {root / mode}", flush=True)
            continue
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    (root / "hosts.json").write_text(json.dumps(rows, indent=1))
    print(
        f"\n{'mode':>5} {'procs':>6} {'to step 10':>11} {'cut: stall':>11} "
        f"{'power-off: stall':>17} {'wall':>7} {'world at end':>13} {'once':>5}"
    )
    for r in rows:
        print(f"{r['mode']:>5} {r['processes']:>6} {r.get('first_steps_s', 0):>10.1f}s "
              f"{r.get('cut_stall_s', 0):>10.1f}s {r.get('power_off_stall_s', 0):>16.1f}s"
              f" {r.get('wall_s', 0):>6.0f}s {r.get('world_at_end', '-'):>13} "
              f"{str(r.get('exactly_once', '-')):>5}")  # fmt: skip
    FLOORS.table(
        f"{args.hosts} emulated hosts x {args.workers_per_host} workers over {args.rate} links: "
        "a host's cable cut at step 10 for 10 s, then a host powered off",
        ["mode", "processes", "to step 10", "cable cut: longest stall",
         "power-off: longest stall", "wall", "world at the end", "every sample once"],
        [[r["mode"], r["processes"], f"{r.get('first_steps_s', 0):.1f} s",
          f"{r.get('cut_stall_s', 0):.1f} s", f"{r.get('power_off_stall_s', 0):.1f} s",
          f"{r.get('wall_s', 0):.0f} s", r.get("world_at_end", "-"),
          "yes" if r.get("exactly_once") else "NO"] for r in rows],
    )  # fmt: skip
    print(f"\nrun directories: {root}")
    FLOORS.finish()


if __name__ == "__main__":
    os.umask(0o022)
    main()
