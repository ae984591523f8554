"""Claim: the parameter server's checkpoints of one moment cost little: under asp and ssp,
with a cut every 50 updates (--checkpoint-every 50: the workers wait while the servers copy
the same pushes, strategies/param_server/cuts.py), the job keeps at least 0.9 of its
throughput without checkpoints, slow worker included.

Setup: benchmarks/ps_stragglers.py's (3 workers and 2 servers, a sleeping "device" per
worker, worker 2 slowed 3x), each mode run twice side by side, without checkpoints and with
--checkpoint-every 50 (bsp checkpoints each server at its own global steps, in the
background: no cut, for comparison). Also each cut's pause (from the moment one is due to
the workers' next lease: at least the slowest lease then out, since its samples must be in
the copy) and each server process's peak memory (summary.json's ``ps``).

    python benchmarks/ps_checkpoint.py [--device-ms 0.1] [--steps 120] [--every 50]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from floors import Floors  # noqa: E402
from ps_stragglers import WORKERS, parse_setup, run  # noqa: E402

FLOORS = Floors()


def main() -> None:
    args, slow = parse_setup(__doc__, steps=120, every=(int, 50, "--checkpoint-every"))
    print(f"{WORKERS} workers, 2 servers; worker {WORKERS - 1} {args.factor:g}x slower; "
          f"{args.device_ms:g} ms of device time per sample forward, 2x backward; "
          f"checkpoints every {args.every} updates\n")  # fmt: skip
    print(f"{'mode':8} {'no ckpt/s':>10} {'ckpt/s':>10} {'ratio':>7} {'cuts':>5} "
          f"{'median pause':>13} {'server peak RSS':>16}")  # fmt: skip
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for mode in ("asp", "ssp(2)", "bsp"):
            plain = run(root / f"{mode}-0", WORKERS, mode, slow, args.steps)
            out = root / f"{mode}-{args.every}"
            rate = run(out, WORKERS, mode, slow, args.steps, checkpoint_every=args.every)
            ps = json.loads((out / "summary.json").read_text())["ps"]
            cuts = ps["cuts"] or {}
            pause = cuts.get("median_pause_s")
            rss = max(ps["server_peak_rss_bytes"]) / 1e6
            ratios[mode] = rate / plain
            print(f"{mode:8} {plain:10.0f} {rate:10.0f} {rate / plain:7.2f} "
                  f"{cuts.get('taken', '-'):>5} "
                  f"{'-' if pause is None else f'{pause * 1e3:.0f} ms':>13} "
                  f"{rss:13.0f} MB")  # fmt: skip
    for mode in ("asp", "ssp(2)"):
        ok = ratios[mode] >= 0.9
        print(f"floor: {mode} with checkpoints / without >= 0.9: "
              f"{FLOORS.check(f'{mode} checkpoints keep 0.9 of throughput', ok)}")  # fmt: skip
    FLOORS.finish()


if __name__ == "__main__":
    main()
