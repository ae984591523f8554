"""Claim: a backup of every server's slice (--ps-replicas 1) costs little: the job keeps at
least 0.8 of its throughput without backups, in every consistency mode.

Each update reaches the backup (the other server process) before the push it came from is
acknowledged (strategies/param_server/replica.py), so the cost is one server-to-server round
trip of the slice's gradient inside each push's round trip, and the backup's own optimizer
step on a core the host shares. Setup: benchmarks/ps_stragglers.py's (3 workers and 2
servers, a sleeping "device" per worker, worker 2 slowed 3x), each mode run twice side by
side, without and with backups. Also the forwards' share of the run (summary.json's
``ps.replication``) and each server process's peak memory (a backup holds a second slice and
its optimizer state).

    python benchmarks/ps_replicas.py [--device-ms 0.1] [--steps 120]
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
FLOOR = 0.8


def main() -> None:
    args, slow = parse_setup(__doc__, steps=120)
    print(f"{WORKERS} workers, 2 servers; worker {WORKERS - 1} {args.factor:g}x slower; "
          f"{args.device_ms:g} ms of device time per sample forward, 2x backward\n")  # fmt: skip
    print(f"{'mode':8} {'alone/s':>9} {'backed/s':>9} {'ratio':>6} {'forwards':>9} "
          f"{'ms each':>8} {'peak RSS alone':>15} {'backed':>7}")  # fmt: skip
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for mode in ("asp", "ssp(2)", "bsp"):
            alone_out, backed_out = root / f"{mode}-0", root / f"{mode}-1"
            alone = run(alone_out, WORKERS, mode, slow, args.steps)
            backed = run(backed_out, WORKERS, mode, slow, args.steps, replicas=1)
            ps0 = json.loads((alone_out / "summary.json").read_text())["ps"]
            ps1 = json.loads((backed_out / "summary.json").read_text())["ps"]
            forwards = sum(r["forwards"] for r in ps1["replication"])
            seconds = sum(r["forward_s"] for r in ps1["replication"])
            ratios[mode] = backed / alone
            print(f"{mode:8} {alone:9.0f} {backed:9.0f} {backed / alone:6.2f} {forwards:9d} "
                  f"{seconds / max(forwards, 1) * 1e3:8.2f} "
                  f"{max(ps0['server_peak_rss_bytes']) / 1e6:12.0f} MB "
                  f"{max(ps1['server_peak_rss_bytes']) / 1e6:4.0f} MB")  # fmt: skip
    for mode, ratio in ratios.items():
        claim = f"{mode} with backups keeps {FLOOR} of throughput"
        print(f"floor: {mode} with backups / without >= {FLOOR}: "
              f"{FLOORS.check(claim, ratio >= FLOOR)}")  # fmt: skip
    FLOORS.finish()


if __name__ == "__main__":
    main()
