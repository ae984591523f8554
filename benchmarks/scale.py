"""Claim: every mode runs at 1, 2, 4, 8, 16 and 32 processes on this 2-core machine, keeps its
promises at 32 (the sample-weighted math, every sample once per epoch), and where the time
goes grows no faster than the world does.

Each worker computes on a *sleeping device* (sleeping_device.py: the MLP's real arithmetic is
tiny; each layer sleeps --device-ms per sample forward, twice that backward), so 32 workers do
not fight over 2 cores and what is measured is scaletrain's machinery and the communication.
What the emulation leaves out: a device's own memory and host link, kernels that overlap
communication on their own streams, and the real network between hosts (every process here
talks over loopback; benchmarks over shaped links are the netns lab's). What it cannot hide:
every process still imports torch and builds its model on the 2 shared cores, so start-up
grows with W here where a cluster's hosts would each start their own.

Weak scaling: every world trains 2 samples per worker per step, 12 steps an epoch, 4
epochs, a checkpoint every 10 steps. For each run the table gives launch to first step (and
its phases: interpreter start to torch imported, the process group, the model built and
wrapped), the steady step split into compute (the sleeping device), communication and the
loop's own overhead, last step to summary.json, a checkpoint's save, peak memory and open
file descriptors per process.

Growth is judged: a start-up, step or recovery term that grows faster than W^1.2 from W=8 to
the largest W fails a floor, unless the benchmark attributes it to the emulation with a
measured reason: the run's processes kept this host's cores at least 80% busy over the whole
command (their CPU seconds, sampled from /proc, over the wall time times the cores). Then
the term measures 2 cores shared by W processes, not scaletrain, and the attribution is
printed with its figures. The loop's own overhead, the finish, memory and descriptors are
printed with their growth, not judged (milliseconds, where noise moves the exponent).

Checks (exit status 1 when one fails): every run completes; the 32-worker ddp run (per-worker
batch 2) ends with the weights of one process with batch 64 (within 1e-5); every run trains every
sample of every epoch exactly once (--log-sample-ids); in place without faults, every step's
quorum holds every replica (none heals at every step, its gradients never counted); the cost
model, calibrated from the 1-worker ddp run and a probe of this host, predicts the mean step
of ddp, local_sgd and ps at 8, 16 and 32 within 20% (predict.csv).

    python benchmarks/scale.py [--worlds 1,2,4,8,16,32] [--modes ddp,fsdp,...] [--device-ms 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from floors import Floors  # noqa: E402

from scaletrain.io import read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLOORS = Floors()
TASK = str(REPO / "benchmarks" / "sleeping_device.py") + ":build_task"
DIGITS = 1437
STEPS = 12  # an epoch's steps
# 4 epochs, 48 steps: with 2 the mean step of local SGD (H=4: 6 synchronizing steps, which
# ranged 54-145 ms in one run at W=16) moved by a fifth between two runs of the same command,
# as much as the cost model's floor; start-up, not steps, is most of each run's time.
EPOCHS = 4

Overrides = dict[str, Any]


def ps(w: int) -> Overrides | None:
    """4 servers and 28 workers at 32: a server per 8 processes."""
    if w < 2:
        return None
    return {"strategy": "ps", "num_servers": max(1, w // 8), "barrier_timeout_s": 300.0}


# mode -> world size -> the mode's flags (None: the mode cannot run at that size).
MODES: dict[str, Callable[[int], Overrides | None]] = {
    "ddp": lambda w: {},
    # fsdp and fsdp x tp run fewer epochs: nothing predicts their steps, and they are the
    # slowest (at 32, 0.8 s and 3.4 s a step: fsdp x tp's run alone took 377 s of a
    # 36-minute make scale at 4 epochs). Their step is the median after the first 3 steps.
    "fsdp": lambda w: {"strategy": "fsdp", "epochs": 2},
    "local_sgd": lambda w: {"strategy": "local_sgd", "sync_every": 4},
    "diloco": lambda w: {"strategy": "diloco", "sync_every": 4},
    "ps": ps,
    "inplace": lambda w: {"recovery": "inplace", "checkpoint_every": 0},
    "pipeline": lambda w: (
        None if w < 2 or w % 2 else {"strategy": "pipeline", "stages": 2, "microbatches": 2}
    ),
    "fsdp_tp": lambda w: (
        None
        if w < 2 or w % 2
        else {"strategy": "fsdp", "tp": 2, "model": "transformer", "epochs": 1}
    ),
    "balance": lambda w: {"balance": "speed", "balance_every": 5},
}


def flags(overrides: Overrides) -> list[str]:
    out: list[str] = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def launch(out: Path, w: int, overrides: Overrides, device_ms: float) -> dict[str, Any]:
    """One run of ``w`` processes; its summary, or {"error": ...}."""
    per_worker = 2
    samples = min(DIGITS, STEPS * per_worker * w)
    base: Overrides = {
        "task": TASK, "dataset": "digits", "model": "mlp", "width": 16,
        "nproc_per_node": w, "batch_size": per_worker, "num_samples": samples, "epochs": EPOCHS,
        "seed": 1, "num_threads": 1, "checkpoint_every": 10, "log_sample_ids": True,
        "timeout_s": 600.0,
    }  # fmt: skip
    cmd = [sys.executable, "-m", "scaletrain", "run", *flags({**base, **overrides}),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, SCALETRAIN_DEVICE_MS=str(device_ms))
    started = time.monotonic()
    with CpuMeter(str(out)) as meter:
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=1500)  # fmt: skip
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1][:200] if result.stderr else "?"}
    summary = json.loads((out / "summary.json").read_text())
    summary["command_s"] = time.monotonic() - started
    # The CPU of the run's processes over what the host's cores could give in that time.
    summary["cpu_s"] = meter.cpu_s()
    summary["cores_busy"] = summary["cpu_s"] / (summary["command_s"] * (os.cpu_count() or 1))
    return summary


class CpuMeter:
    """The CPU seconds of every process whose command line names ``mark`` (the run's
    launcher and workers), sampled from /proc every 0.2 s while the block runs: the
    workers are forked by a fork server and reaped there, so the kernel's accounting of
    this process's children never sees them."""

    def __init__(self, mark: str) -> None:
        self.mark = mark.encode()
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CpuMeter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop.wait(0.2):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    if self.mark not in (proc / "cmdline").read_bytes():
                        continue
                    fields = (proc / "stat").read_text().rpartition(")")[2].split()
                except OSError:
                    continue
                self.seen[proc.name] = (int(fields[11]) + int(fields[12])) / tick

    def cpu_s(self) -> float:
        return float(sum(self.seen.values()))


def read_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def exactly_once(out: Path, num_samples: int) -> bool:
    """Every sample of every epoch trained once: the steps that were kept (a ps push not
    applied trained nothing; in the restart mode, an attempt's steps after the checkpoint
    the next attempt resumed from were redone, and count once, in the later attempt)."""
    ledger = read_jsonl(out / "logs" / "ps_ledger.jsonl")
    if ledger and len({r["server_attempt"] for r in ledger}) == 1:
        # Under a parameter server a sample is trained when server 0 applied its lease: the
        # ledger is the account (a worker may die between that and writing its record). A
        # server 0 that restarted rolled back to its checkpoint, and what it had committed
        # since is dealt again: then the workers' kept records are the account.
        by_epoch: dict[int, list[int]] = defaultdict(list)
        for r in ledger:
            by_epoch[r["epoch"]] += r["sample_ids"]
        return bool(by_epoch) and all(
            sorted(ids) == list(range(num_samples)) for ids in by_epoch.values()
        )
    summary = json.loads((out / "summary.json").read_text())
    resumed_at = {r["attempt"]: r["step"] for r in summary.get("recoveries", [])
                  if r.get("kind") in ("restart", "resume") and "attempt" in r}  # fmt: skip
    seen: dict[int, list[int]] = defaultdict(list)
    for r in read_records(out):
        if not r.get("committed", True) or not r["samples"]:
            continue
        later = resumed_at.get(r.get("attempt", 0) + 1)
        if later is None or r["step"] <= later:
            seen[r["epoch"]] += r["sample_ids"]
    return bool(seen) and all(sorted(ids) == list(range(num_samples)) for ids in seen.values())


def fault_runs(w: int, kills: int | None = None) -> dict[str, Overrides]:
    """The restart mode with 3 of W workers killed at different steps; in place with 4
    replicas killed; ps with a server and 3 workers killed (``kills``: that many of each
    instead, the server first)."""
    spread = [max(1, w // 4), max(1, w // 2), w - 1][: 3 if kills is None else kills]
    kills_at = zip(spread, (6, 14, 22), strict=False)
    restart = ",".join(f"kill:rank={r}:step={s}" for r, s in kills_at)
    # Later than the others' kills: every replica has trained a few steps by then.
    inplace = ",".join(f"kill:rank={r}:step={14 + 2 * i}"
                       for i, r in enumerate(range(1, w, max(1, w // 4)))
                       if i < (4 if kills is None else kills))  # fmt: skip
    # At least 2 servers, and the last one killed: not server 0, whose coordinator restored
    # from its checkpoint would deal the samples since then again (a restored slice loses
    # the updates since its checkpoint: no shard has a backup yet).
    # ssp (staleness 4): the workers advance together, so each reaches the step it dies at
    # (under asp the workers that imported torch first took most of the leases at 32).
    servers = max(2, w // 8)
    targets = sorted({max(1, w // 4), max(1, w // 2), w - servers - 1})
    workers = [f"kill:rank={r}:step={8 + 4 * i}" for i, r in enumerate(targets)]
    ps_kills = ",".join([f"kill:rank={w - 1}:step=10", *workers][: 4 if kills is None else kills])
    return {
        "restart": {"max_restarts": 3, "checkpoint_every": 5, "inject": restart},
        "inplace": {"recovery": "inplace", "checkpoint_every": 0, "max_restarts": 1,
                    "inject": inplace},
        "ps": {**(ps(w) or {}), "num_servers": servers, "max_restarts": 1,
               "checkpoint_every": 5, "inject": ps_kills, "consistency": "ssp",
               "staleness": 4},
    }  # fmt: skip


def steady(out: Path) -> dict[str, float]:
    """Median per-step times (ms) after the first 3 steps, over rank 0's records: the step,
    its compute (the device), communication, and the loop's own share (the rest of the step,
    plus the gap before the next step)."""
    mine = [r for r in read_records(out) if r["rank"] == 0 and r["step"] > 3]
    if len(mine) < 3:
        return {}
    gaps = [
        b["unix_time"] - b["step_s"] - a["unix_time"] for a, b in zip(mine, mine[1:], strict=False)
    ]
    step = statistics.median(r["step_s"] for r in mine)
    compute = statistics.median(r["compute_s"] for r in mine)
    comm = statistics.median(r["comm_s"] for r in mine)
    waited = statistics.median(r["wait_s"] + r["data_s"] for r in mine)
    return {
        "step_ms": 1e3 * step,
        "compute_ms": 1e3 * compute,
        "comm_ms": 1e3 * comm,
        "overhead_ms": 1e3
        * (max(step - compute - waited, 0.0) + max(statistics.median(gaps), 0.0)),
    }


def run_checked(
    out: Path, what: str, w: int, overrides: Overrides, device_ms: float
) -> tuple[dict[str, Any], bool] | None:
    """One run, its floors checked (it completes; every sample once per epoch): (summary,
    exactly once), or None when it failed."""
    summary = launch(out, w, overrides, device_ms)
    ok = "error" not in summary
    FLOORS.check(f"{what} at W={w} completes", ok)
    if not ok:
        print(f"{what:>9} W={w:<3} FAILED: {summary['error']}", flush=True)
        return None
    once = exactly_once(out, min(DIGITS, STEPS * 2 * w))
    FLOORS.check(f"{what} at W={w}: every sample once per epoch", once)
    return summary, once


def row_of(mode: str, w: int, summary: dict[str, Any], out: Path) -> dict[str, Any]:
    startup = summary.get("startup", {})
    lost = summary.get("time_lost", {})
    ckpt = summary.get("checkpointing") or {}
    return {
        "mode": mode,
        "W": w,
        "launch_to_first_step_s": lost.get("startup_s"),
        "imports_s": startup.get("imported_s"),
        "group_s": startup.get("group_s"),
        "model_s": startup.get("model_s"),
        **steady(out),
        "finish_s": lost.get("finish_s"),
        "checkpoint_save_s": ckpt.get("cost_s"),
        "peak_rss_mb": summary.get("max_rank_peak_rss_bytes", 0) / 1e6,
        "open_fds": summary.get("max_rank_open_fds"),
        "command_s": summary.get("command_s"),
        "cores_busy": summary.get("cores_busy"),
    }


COLUMNS = (
    "launch_to_first_step_s", "imports_s", "group_s", "model_s", "step_ms", "compute_ms",
    "comm_ms", "overhead_ms", "finish_s", "checkpoint_save_s", "peak_rss_mb", "open_fds",
)  # fmt: skip


def growth(rows: list[dict[str, Any]], column: str) -> float | None:
    """The exponent k of column ~ W^k between W=8 and the largest W (None without both)."""
    by_w = {r["W"]: r.get(column) for r in rows if r.get(column)}
    big = max(by_w, default=0)
    if 8 not in by_w or big <= 8 or by_w[8] <= 0:
        return None
    return math.log(by_w[big] / by_w[8]) / math.log(big / 8)


SATURATED = 0.8  # the cores this busy over a whole run: its terms measure the shared host
GROWTH_FLOOR = 1.2


def judge_growth(what: str, k: float | None, largest: dict[str, Any] | None) -> str:
    """A floor: ``what`` grows no faster than W^1.2, or the run at the largest W saturated
    this host's cores (the attribution, printed with its figures)."""
    if k is None:
        return ""
    if k <= GROWTH_FLOOR:
        FLOORS.check(f"{what} grows no faster than W^{GROWTH_FLOOR}", True)
        return f"{k:.2f}"
    busy = (largest or {}).get("cores_busy") or 0.0
    attributed = busy >= SATURATED
    FLOORS.check(f"{what} grows no faster than W^{GROWTH_FLOOR} (or the emulation's cores "
                 "explain it)", attributed)  # fmt: skip
    reason = (
        f"the emulation: W={largest['W']}'s processes kept the cores {busy:.0%} busy"
        if attributed and largest
        else "NOT explained by shared cores: a finding"
    )
    return f"{k:.2f} ({reason})"


def equivalence(root: Path, device_ms: float) -> float:
    """Max |w32 - w1| over the final weights: the sweep's 32-worker ddp run (batch 2 each, its
    all-reduce as measured, not ordered) against 1 worker with batch 64 on the same samples
    and flags."""
    import torch

    single = root / "equal-w1"
    summary = launch(single, 1, {"batch_size": 64, "num_samples": STEPS * 2 * 32}, device_ms)
    if "error" in summary:
        print(f"the 1-worker run failed: {summary['error']}")
        return math.inf
    runs = {w: torch.load(out / "checkpoints" / "final.pt", weights_only=True)["model"]
            for w, out in ((32, root / "ddp-w32"), (1, single))}  # fmt: skip
    return max((runs[32][k] - runs[1][k]).abs().max().item() for k in runs[1])


def mean_step_s(out: Path) -> float:
    """Rank 0's mean step after the first 3, checkpoint writes left out (the lowest rank that
    records: a worker under ps). The mean, not the median: local SGD's synchronizing steps
    are one in H and cost most of the time."""
    records = read_records(out)
    first = min(r["rank"] for r in records)
    mine = [r for r in records if r["rank"] == first and r["step"] > 3]
    return statistics.mean(r["step_s"] - r["checkpoint_s"] for r in mine)


PREDICTED = {"ddp": "ddp", "local_sgd": "local_sgd:4", "ps": "ps"}


def sleeping_device_waits() -> int:
    """Wake-ups of the host in a step of the runs' model on the sleeping device."""
    import torch
    from sleeping_device import device_waits

    from scaletrain.models.mlp import build_mlp

    return device_waits(build_mlp((8, 8), 10, width=16), torch.zeros(2, 8, 8))


def check_predictions(root: Path, worlds: list[int], modes: list[str]) -> list[dict[str, Any]]:
    """The cost model, calibrated from the 1-worker ddp run and a probe of this host at each W
    (analysis/probe.py: W processes that sleep the device's time, do a step's host work and
    all-reduce a few KB), predicts the mean step of ddp, local_sgd and ps at 8, 16 and 32:
    within 20% of the measured."""
    from scaletrain.analysis import costmodel
    from scaletrain.analysis.probe import probe_host, probe_ps

    big = [w for w in worlds if w >= 8]
    wanted = [m for m in PREDICTED if m in modes]
    if not (root / "ddp-w1" / "summary.json").exists() or not big or not wanted:
        return []
    m = costmodel.calibrate_run(root / "ddp-w1")
    device_s = m["compute_s"] - m["cpu_s"]
    # The host work cut into the sleeping device's wake-ups of a step (its layers' sleeps).
    host = probe_host(device_s, big, pieces=sleeping_device_waits())
    # ps runs bsp here: its rounds probed as such, with the servers make scale gives each W.
    ps_host = probe_ps(device_s, [(w, (ps(w) or {})["num_servers"]) for w in big]) \
        if "ps" in wanted else ()  # fmt: skip
    cal = costmodel.Calibration(
        compute_s=m["compute_s"], batch_size=int(m["batch_size"]), grad_bytes=int(m["grad_bytes"]),
        latency_s=30e-6, bandwidth_Bps=1.25e9, cores=os.cpu_count() or 1, cpu_s=m["cpu_s"],
        host=host, ps_host=ps_host,
    )  # fmt: skip
    print(f"\nthe cost model at scale: calibrated from ddp-w1 ({m['compute_s'] * 1e3:.1f} ms a "
          f"step, {m['cpu_s'] * 1e3:.2f} ms of it host CPU); the host probed at W: "
          + ", ".join(f"W={p.world} all-reduce {p.collective_cpu_s * 1e3:.1f} ms CPU, host "
                      f"work x{p.slowdown:.2f}, free steps' x{p.free_slowdown:.2f} and "
                      f"{p.free_wait_s * 1e3:.1f} ms waiting" for p in host)
          + "".join(f"; ps W={w} K={k}: push and pull {x * 1e3:.2f} ms CPU a worker, "
                    f"{y * 1e3:.2f} ms a push a server, host work x{f:.2f}"
                    for w, k, x, y, f in ps_host))  # fmt: skip
    rows = []
    for mode in wanted:
        for w in big:
            out = root / f"{mode}-w{w}"
            if not (out / "summary.json").exists():
                continue
            if mode == "ps":
                servers = (ps(w) or {})["num_servers"]
                p = costmodel.predict_ps(cal, w - servers, servers)
            else:
                p = costmodel.predict_method(cal, PREDICTED[mode], w)
            measured = mean_step_s(out)
            ratio = p.step_s / measured
            rows.append({"mode": mode, "W": w, "predicted_ms": 1e3 * p.step_s,
                         "measured_ms": 1e3 * measured, "ratio": ratio})  # fmt: skip
            within = FLOORS.check(f"{mode} at W={w}: predicted within 20% of measured",
                                  abs(ratio - 1) <= 0.2)  # fmt: skip
            print(f"  {mode:>9} W={w:<3} predicted {1e3 * p.step_s:7.1f} ms, measured "
                  f"{1e3 * measured:7.1f} ms: {ratio:.2f} {within}", flush=True)  # fmt: skip
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4,8,16,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--device-ms", type=float, default=2.0)
    parser.add_argument(
        "--fault-worlds",
        default="8,16,32",
        help="world sizes of the runs with failures ('' for none)",
    )
    parser.add_argument("--fault-modes", default="restart,inplace,ps")
    parser.add_argument("--kills", type=int, default=None,
                        help="processes killed per run with failures (3, 4, 4)")  # fmt: skip
    parser.add_argument("--out", default=str(REPO / "runs" / "scale"))
    return parser.parse_args()


def sweep(args: argparse.Namespace, root: Path, worlds: list[int]) -> list[dict[str, Any]]:
    """Every mode at every W without failures: a row each, its floors checked."""
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        for w in worlds:
            overrides = MODES[mode](w)
            if overrides is None:
                continue
            out = root / f"{mode}-w{w}"
            checked = run_checked(out, mode, w, overrides, args.device_ms)
            if checked is None:
                continue
            summary, once = checked
            if mode == "inplace":  # no fault: every quorum holds every replica
                held = {r["participants"] for r in read_records(out)}
                FLOORS.check(f"inplace at W={w}: every step's quorum holds all {w} replicas",
                             held == {w})  # fmt: skip
            row = row_of(mode, w, summary, out)
            rows.append(row)
            print(f"{mode:>9} W={w:<3} start {row['launch_to_first_step_s']:.1f} s, step "
                  f"{row.get('step_ms', math.nan):.1f} ms (overhead "
                  f"{row.get('overhead_ms', math.nan):.1f}), finish {row['finish_s']:.1f} s, "
                  f"{row['peak_rss_mb']:.0f} MB, {row['open_fds']} fds; once per epoch: "
                  f"{'yes' if once else 'NO'}", flush=True)  # fmt: skip
    FLOORS.table(
        f"every mode at each W, no failure ({args.device_ms:g} ms a sample on a sleeping device)",
        ["mode", "W", "launch to first step", "step", "compute", "communication", "overhead",
         "finish", "peak RSS", "open fds"],
        [[r["mode"], r["W"], f"{r['launch_to_first_step_s']:.1f} s",
          *(f"{r.get(c, math.nan):.1f} ms" for c in ("step_ms", "compute_ms", "comm_ms",
                                                     "overhead_ms")),
          f"{r['finish_s']:.1f} s", f"{r['peak_rss_mb']:.0f} MB", r["open_fds"]] for r in rows],
    )  # fmt: skip
    table = Path(args.out) / "scale.csv"
    table.parent.mkdir(parents=True, exist_ok=True)
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "W", *COLUMNS, "command_s", "cores_busy"],
                                extrasaction="ignore")  # fmt: skip
        writer.writeheader()
        writer.writerows(rows)
    print(f"\ntable: {table}")
    return rows


def judge_growths(modes: list[str], rows: list[dict[str, Any]]) -> None:
    print(f"\ngrowth from W=8 to the largest (exponent k of W^k; a floor at {GROWTH_FLOOR} for "
          "start-up, step and recovery, unless the run saturated the cores):")  # fmt: skip
    grown = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        largest = max(mine, key=lambda r: r["W"], default=None)
        judged = {
            c: judge_growth(f"{mode}'s {c}", growth(mine, c), largest)
            for c in ("launch_to_first_step_s", "step_ms")
        }
        seen = {c: growth(mine, c) for c in ("overhead_ms", "finish_s", "peak_rss_mb", "open_fds")}
        shown = [f"{c} {v}" for c, v in judged.items() if v]
        shown += [f"{c} {k:.2f}" for c, k in seen.items() if k is not None]
        if shown:
            print(f"  {mode}: {', '.join(shown)}")
            exponents = [f"{k:.2f}" if k is not None else "-" for k in seen.values()]
            grown.append([mode, *(judged[c] or "-" for c in judged), *exponents])
    FLOORS.table(
        f"growth from W=8 to the largest: the exponent k of W^k (floor {GROWTH_FLOOR} for "
        "start-up and step, unless the run kept the cores busy)",
        ["mode", "start-up", "step", "overhead", "finish", "peak RSS", "open fds"], grown,
    )  # fmt: skip


def failure_runs(args: argparse.Namespace, root: Path) -> None:
    """Runs with failures at each of --fault-worlds: each recovers and trains every sample
    once; the time back to training judged for its growth with W."""
    print("\nfailures (each run: where it recovered, and every sample once per epoch):")
    recovered: dict[str, list[dict[str, Any]]] = {}
    failures = []
    for w in [int(x) for x in args.fault_worlds.split(",")]:
        for name, overrides in fault_runs(w, args.kills).items():
            if name not in args.fault_modes.split(","):
                continue
            out = root / f"faults-{name}-w{w}"
            checked = run_checked(out, f"{name} with failures", w, overrides, args.device_ms)
            if checked is None:
                continue
            summary, once = checked
            recs = summary["recoveries"]
            detected = [r.get("detected_s") for r in recs if r.get("detected_s") is not None]
            resumed = [r.get("resumed_s") for r in recs if r.get("resumed_s") is not None]
            longest = [max(x, default=math.nan) for x in (detected, resumed)]
            goodput = f"{summary.get('goodput') or 0:.0%}"
            print(f"  {name:>8} W={w:<3} {len(recs)} recoveries; detected in "
                  f"{longest[0]:.1f} s at most, training again {longest[1]:.1f} s later at "
                  f"most; goodput {goodput}; once per epoch: {'yes' if once else 'NO'}",
                  flush=True)  # fmt: skip
            failures.append([name, w, len(recs), *(f"{x:.1f} s" for x in longest), goodput,
                             "yes" if once else "NO"])  # fmt: skip
            recovered.setdefault(name, []).append(
                {"W": w, "resumed_s": max(resumed, default=None),
                 "cores_busy": summary.get("cores_busy")})  # fmt: skip
    FLOORS.table(
        "runs with failures: the longest detection and return to training",
        ["recovery", "W", "recoveries", "detected", "training again", "goodput",
         "every sample once"], failures,
    )  # fmt: skip
    for name, runs in recovered.items():
        largest = max(runs, key=lambda r: r["W"])
        shown = judge_growth(f"{name}'s recovery", growth(runs, "resumed_s"), largest)
        if shown:
            print(f"  {name}: the death to training again grows as W^{shown}")


def main() -> None:
    args = parse_args()
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"sleeping device: {args.device_ms:g} ms per sample forward, twice that backward; "
          f"runs under {root}", flush=True)  # fmt: skip
    rows = sweep(args, root, worlds)
    judge_growths(args.modes.split(","), rows)
    if args.fault_worlds:
        failure_runs(args, root)
    predicted = check_predictions(root, worlds, args.modes.split(","))
    if predicted:
        FLOORS.table(
            "the cost model, calibrated from ddp at W=1 and a probe of the host, against the "
            "measured mean step",
            ["mode", "W", "predicted", "measured", "ratio"],
            [[r["mode"], r["W"], f"{r['predicted_ms']:.1f} ms", f"{r['measured_ms']:.1f} ms",
              f"{r['ratio']:.2f}"] for r in predicted],
        )  # fmt: skip
        with (Path(args.out) / "predict.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(predicted[0]))
            writer.writeheader()
            writer.writerows(predicted)
    ddp_runs = [
        root / f"ddp-w{w}" for w in worlds if (root / f"ddp-w{w}" / "summary.json").exists()
    ]
    if len(ddp_runs) > 1:
        from scaletrain.analysis.report import write_report

        print(f"report of the ddp runs: {write_report(ddp_runs, Path(args.out) / 'report.html')}")
    if (root / "ddp-w32" / "summary.json").exists():
        diff = equivalence(root, args.device_ms)
        print(
            f"\n32 workers x 2 vs 1 worker x 64: max weight difference {diff:.2e} "
            f"{FLOORS.check('32 x 2 equals 1 x 64 within 1e-5', diff <= 1e-5)}"
        )
        FLOORS.headline("32 workers x batch 2 against 1 worker x batch 64, final weights",
                        f"{diff:.1e} apart (floor 1e-5)")  # fmt: skip
    met = FLOORS.checked - len(FLOORS.missed)
    FLOORS.headline(
        f"every mode at {min(worlds)} to {max(worlds)} processes, failures at "
        f"{args.fault_worlds or 'none'}, every sample once per epoch",
        f"{met} of {FLOORS.checked} floors met"
        + (f" (missed: {'; '.join(FLOORS.missed)})" if FLOORS.missed else ""),
    )
    FLOORS.finish()


if __name__ == "__main__":
    main()
