"""Claim: with the staleness-aware rule (--staleness-rule inverse) the parameter server's
asynchronous modes train with ddp's optimizer flags; with the plain rule (none) SGD at
ddp's defaults does not. Side by side in one run: asp and ssp(2), 3 workers and 2 servers
on digits, SGD lr 0.05 momentum 0.9 (the defaults) and Adam lr 0.002, each under both rules;
the test accuracy at the end and the time to 95% (worker 0 scores its parameters every 10 of
its pushes: --eval-every; "-" when it never got there).

Floor: under inverse every run reaches 95%.

Measured (2 cores, 15 epochs, seed 0): SGD asp 97.8% (95% at 2.2 s) under inverse, 10.0%
(diverged) under none; ssp(2) 97.8% (2.1 s) and 10.0%; Adam asp 97.8% (1.7 s) and 98.1%
(1.8 s), ssp(2) 98.6% (2.3 s) and 98.1% (1.5 s). Over seeds 0-4 see consistency.py.

    python benchmarks/staleness_rule.py [--epochs 15] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from floors import Floors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLOORS = Floors()


def run(out: Path, flags: list[str], args: argparse.Namespace) -> tuple[float, float | None]:
    cmd = [sys.executable, "-m", "scaletrain", "run", "--strategy", "ps", "--nproc-per-node",
           "5", "--num-servers", "2", "--epochs", str(args.epochs), "--seed", str(args.seed),
           "--num-threads", "1", "--eval-every", "10", *flags, "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reached = [r["time_s"] for r in records if (r.get("test_accuracy") or 0) >= 0.95]
    return summary["test_accuracy"], min(reached) if reached else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    optimizers = {"sgd 0.05 m0.9": ["--optimizer", "sgd", "--lr", "0.05"],
                  "adam 0.002": ["--optimizer", "adam", "--lr", "0.002"]}  # fmt: skip
    modes = {"asp": ["--consistency", "asp"],
             "ssp(2)": ["--consistency", "ssp", "--staleness", "2"]}  # fmt: skip
    print(f"digits, 3 workers, 2 servers, {args.epochs} epochs, seed {args.seed}")
    print(f"{'optimizer':14} {'mode':7} {'rule':8} {'accuracy':>9} {'to 95%':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for opt, opt_flags in optimizers.items():
            for mode, mode_flags in modes.items():
                for rule in ("inverse", "none"):
                    out = Path(tmp) / f"{opt.split()[0]}-{mode}-{rule}"
                    acc, t95 = run(out, [*opt_flags, *mode_flags, "--staleness-rule", rule], args)
                    reached = f"{t95:7.1f}s" if t95 is not None else "      -"
                    verdict = ""
                    if rule == "inverse":
                        verdict = f" [{FLOORS.check(f'{opt} {mode} inverse >= 95%', acc >= 0.95)}]"
                    print(f"{opt:14} {mode:7} {rule:8} {acc:9.1%} {reached}{verdict}", flush=True)
    FLOORS.finish()


if __name__ == "__main__":
    main()
