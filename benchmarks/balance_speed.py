"""Claim: with one slow worker, --balance speed keeps synchronous training near the sum of
what the workers manage alone, where plain ddp runs at W x the slowest. Side by side in one
run, the same model, data, per-worker batch and threads, W workers (default 3) with rank 1
slowed 3x (--inject slow: it sleeps twice its compute after each step, as slower hardware):

- each worker alone (1 process; the slowed one with the same injection): its solo rate;
- plain ddp, balanced ddp (--balance speed), and the parameter server, asp (W workers, 1
  server: nobody waits for anybody);

rates while training (summary.json's train_samples_per_s), the median of --repeats.
Floor: balanced ddp >= 0.9 x the sum of the solo rates. On a machine with fewer cores than
workers the workers also share the CPU, which no split can undo: the table shows the cores.

    python benchmarks/balance_speed.py [--workers 3] [--repeats 2] [--epochs 3]
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


def rate(out: Path, args: list[str], common: list[str]) -> float:
    cmd = [sys.executable, "-m", "scaletrain", "run", *common, *args, "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return float(json.loads((out / "summary.json").read_text())["train_samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    w = args.workers
    common = ["--dataset", "digits", "--batch-size", "32", "--epochs", str(args.epochs),
              "--num-threads", "1"]  # fmt: skip
    runs = {
        "solo": ["--nproc-per-node", "1"],
        "solo, slowed": ["--nproc-per-node", "1", "--inject", "slow:rank=0:factor=3"],
        "ddp": ["--nproc-per-node", str(w), "--inject", SLOW],
        "ddp --balance speed": ["--nproc-per-node", str(w), "--inject", SLOW, "--balance",
                                "speed"],
        "ps asp": ["--strategy", "ps", "--nproc-per-node", str(w + 1), "--num-servers", "1",
                   "--consistency", "asp", "--staleness-rule", "inverse", "--inject", SLOW],
    }  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, flags in runs.items():
                out = Path(tmp) / f"{name.replace(' ', '_')}-{repeat}"
                rates[name].append(rate(out, flags, common))
    med = {name: statistics.median(values) for name, values in rates.items()}
    solo_sum = (w - 1) * med["solo"] + med["solo, slowed"]
    print(f"{w} workers, rank 1 slowed 3x, {os.cpu_count()} cores, digits, batch 32 per "
          f"worker, median of {args.repeats}; samples/s while training")  # fmt: skip
    for name, value in med.items():
        print(f"  {name:22} {value:8.0f}")
    print(f"  {'sum of solo rates':22} {solo_sum:8.0f}")
    balanced = med["ddp --balance speed"] / solo_sum
    plain = med["ddp"] / solo_sum
    print(f"balanced ddp: {balanced:.2f} x the solo sum "
          f"[{FLOORS.check('balanced >= 0.9 x solo sum', balanced >= 0.9)}]; plain ddp "
          f"{plain:.2f} x (W x the slowest would be {w * med['solo, slowed'] / solo_sum:.2f} x);"
          f" ps asp {med['ps asp'] / solo_sum:.2f} x")  # fmt: skip
    FLOORS.finish()


if __name__ == "__main__":
    main()
