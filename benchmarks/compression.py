"""Claim: compression and less frequent synchronization buy speed where the network is the
bottleneck, close to what Amdahl's law allows.

Two workers train a 4.2M-parameter MLP (16.8 MB of fp32 gradients per step) on synthetic
32x32 images, one worker thread each, on plain loopback and, through the network-namespace lab
(scaletrain/netns.py), on links shaped to 1 Gbit/s and 100 Mbit/s. For none, fp16, top-k,
PowerSGD, sign, local_sgd and diloco it prints the mean step time over the steady steps (after
a warm-up, a whole number of local_sgd periods), bytes sent per step per rank, the speedup over
uncompressed ddp on the same network, and the Amdahl bound 1 / ((1 - f) + f / c): f is the
share of the uncompressed step spent blocked on communication, c the measured reduction of
bytes per step. Floor: at 100 Mbit/s PowerSGD reaches >= 0.8 of its bound.

Each network's methods run in turn, --repeats times (interleaved, so a burst of load from
another tenant of a shared machine hits all methods alike); each figure is the median over
the repeats of a run's mean steady step time, and PowerSGD's share of its bound is also
printed per repeat.

    python benchmarks/compression.py [--networks loopback,1gbit,100mbit] [--repeats 3]

The shaped networks need root and iproute2; without them those rows are skipped, saying why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from floors import Floors  # noqa: E402

from scaletrain.netns import NetworkLab, unavailable_reason  # noqa: E402

FLOORS = Floors()

WARMUP = 4
SYNC_EVERY = 8
METHODS: dict[str, list[str]] = {
    "none": [],
    "fp16": ["--compression", "fp16"],
    "topk": ["--compression", "topk:ratio=0.01"],
    "powersgd": ["--compression", "powersgd:rank=4"],
    "sign": ["--compression", "sign"],
    "local_sgd": ["--strategy", "local_sgd", "--sync-every", str(SYNC_EVERY)],
    "diloco": ["--strategy", "diloco", "--sync-every", str(SYNC_EVERY), "--optimizer", "adamw",
               "--lr", "0.001"],
}  # fmt: skip


def job_flags(args: argparse.Namespace) -> list[str]:
    steps = WARMUP + args.steady_steps
    return (
        f"--dataset synthetic --image-size 32 --model mlp --width 256 --num-threads 1 "
        f"--batch-size {args.batch_size} --max-steps {steps} --seed 0"
    ).split()


def run_loopback(flags: list[str], out: Path) -> Path:
    cmd = [sys.executable, "-m", "scaletrain", "run", "--nproc-per-node", "2", "--out", str(out)]
    result = subprocess.run(cmd + flags, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd + flags)}\n{result.stderr[-3000:]}")
    return out


def run_shaped(rate: str, flags: list[str], out: Path) -> Path:
    with NetworkLab(2, rate=rate) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain(flags, out)
        outputs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"run failed at {rate}: {' '.join(flags)}\n{outputs[0][1][-3000:]}")
    return out / "node0"  # rank 0 (node 0) writes metrics and summary


def measure(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["rank"] == 0 and r["step"] > WARMUP]
    return {
        "step_s": statistics.fmean(r["step_s"] for r in steady),
        "wait_s": statistics.fmean(r["wait_s"] for r in steady),
        "bytes": statistics.fmean(r["comm_bytes"] for r in steady),
        "accuracy": json.loads((run_dir / "summary.json").read_text())["test_accuracy"],
    }


def amdahl(f: float, c: float) -> float:
    return 1 / ((1 - f) + f / c)


def share_of_bound(base: dict[str, float], run: dict[str, float]) -> float:
    """A run's speedup over the uncompressed one, as a share of its Amdahl bound."""
    c = base["bytes"] / run["bytes"] if run["bytes"] else float("inf")
    speedup = base["step_s"] / run["step_s"]
    return speedup / amdahl(base["wait_s"] / base["step_s"], c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", default="loopback,1gbit,100mbit")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steady-steps", type=int, default=2 * SYNC_EVERY)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    flags = job_flags(args)
    verdicts = []
    speedups: dict[str, float] = {}
    print(
        "model: mlp width 256 (4.2M parameters, 16.8 MB fp32 gradients), 2 workers, "
        f"batch {args.batch_size} per worker, mean over {args.steady_steps} steady steps"
    )
    for network in args.networks.split(","):
        if network != "loopback" and unavailable_reason():
            print(f"\n{network}: skipped ({unavailable_reason()})")
            continue
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods.split(",")}
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for method, results in runs.items():
                    out = Path(tmp) / f"{method}-{repeat}"
                    method_flags = flags + METHODS[method]
                    if network == "loopback":
                        run_dir = run_loopback(method_flags, out)
                    else:
                        run_dir = run_shaped(network, method_flags, out)
                    results.append(measure(run_dir))
        rows = {
            m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()
        }
        base = rows["none"]
        f = base["wait_s"] / base["step_s"]
        print(f"\n{network}: uncompressed step {base['step_s'] * 1e3:.0f} ms, "
              f"blocked on communication f = {f:.0%}")  # fmt: skip
        print(f"{'method':<10} {'step ms':>8} {'MB/step':>8} {'c':>7} {'speedup':>8} "
              f"{'bound':>7} {'of bound':>8}")  # fmt: skip
        table = []
        for method, row in rows.items():
            c = base["bytes"] / row["bytes"] if row["bytes"] else float("inf")
            speedup = base["step_s"] / row["step_s"]
            bound = amdahl(f, c)
            print(f"{method:<10} {row['step_s'] * 1e3:8.0f} {row['bytes'] / 1e6:8.2f} {c:7.1f} "
                  f"{speedup:8.2f} {bound:7.2f} {speedup / bound:8.0%}")  # fmt: skip
            step_ms, mb = f"{row['step_s'] * 1e3:.0f}", f"{row['bytes'] / 1e6:.2f}"
            table.append([method, step_ms, mb, f"{c:.1f}", f"{speedup:.2f}x", f"{bound:.2f}x",
                          f"{speedup / bound:.0%}"])  # fmt: skip
            if network == "100mbit" and method in ("powersgd", "local_sgd"):
                speedups[method] = speedup
            if network == "100mbit" and method == "powersgd":
                ok = speedup >= 0.8 * bound
                pairs = zip(runs["none"], runs["powersgd"], strict=True)
                each = [share_of_bound(b, r) for b, r in pairs]
                verdicts.append(
                    f"PowerSGD at 100 Mbit/s: {speedup / bound:.0%} of its Amdahl bound (floor "
                    f"80%): {FLOORS.check('PowerSGD at 100 Mbit/s >= 80% of Amdahl', ok)}; "
                    "per repeat: " + ", ".join(f"{e:.0%}" for e in each)
                )
        FLOORS.table(
            f"{network}: the uncompressed step {base['step_s'] * 1e3:.0f} ms, f = {f:.0%} of it "
            "blocked on communication",
            ["method", "step ms", "MB a step", "c (fewer bytes)", "speedup", "Amdahl bound",
             "of the bound"], table,
        )  # fmt: skip
    for line in verdicts:
        print("\n" + line)
    if len(speedups) == 2:
        FLOORS.headline(
            "gradients over 100 Mbit/s: PowerSGD rank 4, local SGD H=8, against plain DDP",
            f"{speedups['powersgd']:.1f}x, {speedups['local_sgd']:.1f}x the steps per second",
        )
    FLOORS.finish()


if __name__ == "__main__":
    main()
