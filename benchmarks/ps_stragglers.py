"""Claim: under the parameter server, a slow worker holds the others back under bsp, less under
ssp, and not at all under asp: asp's throughput is at least 0.9 of the sum of the workers'
solo rates when one of three workers is 3x slower.

Setup: 3 workers and 2 servers (--strategy ps --nproc-per-node 5 --num-servers 2), worker 2
slowed with ``--inject slow:rank=2:factor=3`` (every step takes 3x its measured compute time).
Each worker's compute stands for an accelerator: the model's forward sleeps --device-ms per
sample and its backward twice that (as benchmarks/pipeline_bubble.py does), on top of a small
real MLP. Sleeping workers do not compete for this machine's two cores, so three workers
behave as three devices would, and the figure tests the parameter server, not the host.

Rates are measured from metrics.jsonl: applied samples over the time from the first step's
start to the last step's end, over all workers (start-up and the final evaluation left out).
A solo rate is one worker alone with the same servers: one run at normal speed, one slowed.

    python benchmarks/ps_stragglers.py [--device-ms 0.1] [--steps 60] [--factor 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from floors import Floors  # noqa: E402

import scaletrain  # noqa: E402
from scaletrain.config import RunConfig, with_overrides  # noqa: E402
from scaletrain.data.datasets import build_dataset  # noqa: E402
from scaletrain.task import Task  # noqa: E402

FLOORS = Floors()

BATCH = 32
WORKERS = 3
SERVERS = 2


def build_task(cfg: RunConfig) -> Task:
    from pipeline_bubble import build_model  # the sleeping "device" blocks

    train = build_dataset("synthetic", "train", num_samples=cfg.data.num_samples, image_size=8)
    model = build_model("device", 3 * 8 * 8, train.num_classes)
    return Task(model=model, train_data=train, test_data=None)


def run(out: Path, workers: int, consistency: str, inject: str, steps: int,
        checkpoint_every: int = 0, replicas: int = 0) -> float:  # fmt: skip
    """Applied samples per second over the training window of one run."""
    overrides: dict[str, Any] = {
        "out": str(out),
        "strategy": "ps",
        "nproc_per_node": workers + SERVERS,
        "num_servers": SERVERS,
        "consistency": consistency.split("(")[0],
        "task": f"{Path(__file__).resolve()}:build_task",
        "num_samples": BATCH * WORKERS * steps,
        "batch_size": BATCH,
        "num_threads": 1,
        "inject": inject,
        "lr": 0.01,
        "checkpoint_every": checkpoint_every,
        "ps_replicas": replicas,
    }
    if consistency.startswith("ssp"):
        overrides["staleness"] = int(consistency[4:-1])
    scaletrain.run(with_overrides(RunConfig(), overrides), show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    applied = [r for r in records if r["committed"]]
    start = min(r["unix_time"] - r["step_s"] for r in applied)
    end = max(r["unix_time"] for r in applied)
    return sum(r["samples"] for r in applied) / (end - start)


def parse_setup(doc: str, steps: int, **more: Any) -> tuple[argparse.Namespace, str]:
    """This setup's flags (and ``more``: name -> (type, default, help)); sets the device's
    sleep and returns the parsed flags and the slow worker's --inject."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--device-ms", type=float, default=0.1, help="forward ms per sample")
    parser.add_argument("--steps", type=int, default=steps, help="data-parallel steps of data")
    parser.add_argument("--factor", type=float, default=3.0, help="how much slower worker 2 is")
    for name, (kind, default, text) in more.items():
        parser.add_argument(f"--{name}", type=kind, default=default, help=text)
    args = parser.parse_args()
    os.environ["BENCH_DEVICE_MS"] = str(args.device_ms)
    return args, f"slow:rank={WORKERS - 1}:factor={args.factor:g}"


def main() -> None:
    args, slow = parse_setup(__doc__, steps=60)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        normal = run(root / "solo-normal", 1, "asp", "", args.steps // WORKERS)
        slowed = run(root / "solo-slow", 1, "asp", slow.replace(f"rank={WORKERS - 1}", "rank=0"),
                     args.steps // WORKERS)  # fmt: skip
        solo = [normal] * (WORKERS - 1) + [slowed]
        print(
            f"{WORKERS} workers, {SERVERS} servers; worker {WORKERS - 1} {args.factor:g}x "
            f"slower; {args.device_ms:g} ms of device time per sample forward, 2x backward"
        )
        for w, rate in enumerate(solo):
            print(f"  worker {w} alone: {rate:7.0f} samples/s")
        total = sum(solo)
        print(f"  sum of solo rates: {total:.0f} samples/s; {WORKERS} x slowest: "
              f"{WORKERS * slowed:.0f} samples/s\n")  # fmt: skip
        print(f"{'mode':8} {'samples/s':>10} {'/ sum of solo':>14} {'/ W x slowest':>14}")
        for mode in ("bsp", "ssp(2)", "asp"):
            rate = run(root / mode, WORKERS, mode, slow, args.steps)
            print(f"{mode:8} {rate:10.0f} {rate / total:14.2f} {rate / (WORKERS * slowed):14.2f}")
            if mode == "asp":
                asp = rate / total
        print(f"\nfloor: asp / sum of solo >= 0.9: "
              f"{FLOORS.check('asp / sum of solo rates >= 0.9', asp >= 0.9)}")  # fmt: skip
    FLOORS.finish()


if __name__ == "__main__":
    main()
