"""Claim: with one slow worker, --balance speed keeps synchronous training near the sum of
what the workers manage alone, where plain ddp runs at W x the slowest. Side by side in one
run, the same model (cnn, width 32), data (synthetic 32x32 RGB), per-worker batch (64) and
threads (1), W workers with rank 1 slowed 3x (--inject slow: it sleeps twice its compute
after each step, as slower hardware):

- each worker alone (1 process; the slowed one with the same injection): its solo rate;
- plain ddp, balanced ddp (--balance speed), and the parameter server, asp (W workers, 1
  server: nobody waits for anybody).

Rates are samples per second once settled: over the second half of each run's wall time,
from its metrics.jsonl (the first re-plans happen after --balance-every steps, and every run
is measured the same way); the whole run's train_samples_per_s is printed beside them. The
median of --repeats. Floor: balanced ddp >= 0.9 x the sum of the solo rates.

W defaults to 3, but never more than the machine's cores: with fewer cores than workers the
workers share the CPU, and no split of the batch can make up the lost cores (on 2 cores, 3
workers whose solo rates were each measured on a whole core cannot add up). Measured on 2
cores, W = 2, settled (whole run): solo 1577 and slowed 491 samples/s (sum 2068); plain ddp
974 (962), 0.47 x the sum, which is 2 x the slowest; balanced ddp 1944 (1819), 0.94 x; ps
asp 2094 (1942), 1.01 x. (On the digits CNN at batch 32 a step's cost hardly depends on its
samples: fixed per-step work dominates, and shifting samples gains little: 4122 -> 4373.)

    python benchmarks/balance_speed.py [--workers 3] [--repeats 2] [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from floors import Floors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLOORS = Floors()
SLOW = "slow:rank=1:factor=3"


def run(out: Path, args: list[str], common: list[str]) -> tuple[float, float]:
    """(settled rate, the whole run's train_samples_per_s) of one run."""
    cmd = [sys.executable, "-m", "scaletrain", "run", *common, *args, "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    whole = float(json.loads((out / "summary.json").read_text())["train_samples_per_s"])
    return settled_rate(out / "metrics.jsonl"), whole


def settled_rate(metrics: Path) -> float:
    """Samples trained per second over the second half of the run's wall time. Every record
    (one per rank and step; under ps one per push) carries the samples it trained, so their
    sum over all ranks is the run's, whatever the strategy."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = sorted(r["unix_time"] for r in records)
    middle, last = (times[0] + times[-1]) / 2, times[-1]
    samples = sum(r["samples"] for r in records if r["unix_time"] > middle)
    return samples / (last - middle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    w = min(args.workers, cores)
    if w < args.workers:
        print(f"{args.workers} workers on {cores} cores would share the CPU: running {w}")
    data = ["--dataset", "synthetic", "--num-samples", "4608", "--batch-size", "64",
            "--num-threads", "1"]  # fmt: skip
    solo = [*data, "--epochs", "2"]  # a rate needs fewer steps alone
    group = [*data, "--epochs", str(args.epochs)]
    runs = {
        "solo": (["--nproc-per-node", "1"], solo),
        "solo, slowed": (["--nproc-per-node", "1", "--inject", "slow:rank=0:factor=3"], solo),
        "ddp": (["--nproc-per-node", str(w), "--inject", SLOW], group),
        "ddp --balance speed": (["--nproc-per-node", str(w), "--inject", SLOW, "--balance",
                                 "speed"], group),
        "ps asp": (["--strategy", "ps", "--nproc-per-node", str(w + 1), "--num-servers", "1",
                    "--consistency", "asp", "--inject", SLOW], group),
    }  # fmt: skip
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, (flags, common) in runs.items():
                out = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}-{repeat}"
                rates[name].append(run(out, flags, common))
    settled = {name: statistics.median(v[0] for v in values) for name, values in rates.items()}
    whole = {name: statistics.median(v[1] for v in values) for name, values in rates.items()}
    solo_sum = (w - 1) * settled["solo"] + settled["solo, slowed"]
    print(f"{w} workers, rank 1 slowed 3x, {cores} cores, cnn on synthetic 32x32, batch 64 "
          f"per worker, median of {args.repeats}; samples/s")  # fmt: skip
    print(f"  {'':22} {'settled':>8} {'whole run':>10}")
    for name in runs:
        print(f"  {name:22} {settled[name]:8.0f} {whole[name]:10.0f}")
    print(f"  {'sum of solo rates':22} {solo_sum:8.0f}")
    balanced = settled["ddp --balance speed"] / solo_sum
    plain = settled["ddp"] / solo_sum
    print(f"balanced ddp: {balanced:.2f} x the solo sum "
          f"[{FLOORS.check('balanced >= 0.9 x solo sum', balanced >= 0.9)}]; plain ddp "
          f"{plain:.2f} x (W x the slowest would be {w * settled['solo, slowed'] / solo_sum:.2f}"
          f" x); ps asp {settled['ps asp'] / solo_sum:.2f} x")  # fmt: skip
    FLOORS.finish()


if __name__ == "__main__":
    main()
