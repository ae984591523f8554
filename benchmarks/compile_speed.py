"""Claim: --compile runs torch.compile under ddp and fsdp, and what it buys is measured, not
assumed. Side by side, interleaved (eager, compiled, eager, ...): the built-in transformer on
synthetic images, 2 workers, the same steps, for ddp and fsdp. Prints the steady-state
samples/s of each (the median step after the first WARMUP, which include compiling), the
speedup, and how long the compiling first steps took.

Floors (honest ones: on CPU inductor may well not speed this model up): compile captured
graphs on every rank (summary.json's compiled_graphs > 0: it did not fall back to eager),
and the compiled steady state is not slower than 0.5x eager (a compile that runs is usable).

    python benchmarks/compile_speed.py [--repeats 2] [--steps 30] [--batch-size 64]

Measured here (2 cores, 1 repeat): ddp 3529 samples/s eager, 3213 compiled (0.91x), fsdp
1085 and 998 (0.92x); the compiling first steps took 13 s and 9 s. No speedup on this CPU
for this small model (printed as measured; the floor is only that compiling works).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from floors import Floors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLOORS = Floors()
WARMUP = 5


def measure(out: Path, strategy: str, compiled: bool, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "run", "--strategy", strategy,
           "--nproc-per-node", "2", "--dataset", "synthetic", "--image-size", "32",
           "--num-samples", str(2 * args.batch_size * args.steps), "--model", "transformer",
           "--width", str(args.width), "--batch-size", str(args.batch_size), "--max-steps",
           str(args.steps), "--num-threads", "1", "--out", str(out)]  # fmt: skip
    if compiled:
        cmd.append("--compile")
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    mine = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mine = [r for r in mine if r["rank"] == 0]
    steady = statistics.median(r["step_s"] for r in mine[WARMUP:])
    return {
        "rate": 2 * args.batch_size / steady,
        "warmup_s": sum(r["step_s"] for r in mine[:WARMUP]),
        "graphs": summary["compiled_graphs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    print(f"transformer width {args.width}, 2 workers x batch {args.batch_size}, "
          f"{args.steps} steps, {args.repeats} repeats (medians); steady state after "
          f"{WARMUP} steps")  # fmt: skip
    print(f"{'strategy':9} {'eager/s':>9} {'compiled/s':>11} {'speedup':>8} "
          f"{'first steps eager':>18} {'compiled':>9} {'graphs':>7}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for repeat in range(args.repeats):
                for compiled in (False, True):
                    out = Path(tmp) / f"{strategy}-{repeat}-{compiled}"
                    runs[compiled].append(measure(out, strategy, compiled, args))
            eager = statistics.median(r["rate"] for r in runs[False])
            comp = statistics.median(r["rate"] for r in runs[True])
            graphs = min(r["graphs"] for r in runs[True])
            warm_e = statistics.median(r["warmup_s"] for r in runs[False])
            warm_c = statistics.median(r["warmup_s"] for r in runs[True])
            print(f"{strategy:9} {eager:9.0f} {comp:11.0f} {comp / eager:7.2f}x "
                  f"{warm_e:17.1f}s {warm_c:8.1f}s {graphs:7d}")  # fmt: skip
            captured = FLOORS.check(f"{strategy}: compiled", graphs > 0)
            usable = FLOORS.check(f"{strategy}: >= 0.5x eager", comp >= 0.5 * eager)
            print(f"  graphs captured [{captured}], steady state >= 0.5x eager [{usable}]")
    FLOORS.finish()


if __name__ == "__main__":
    main()
