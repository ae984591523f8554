"""Claim: the cost model (scaletrain/analysis/costmodel.py), calibrated from one 1-worker run
and a few all-reduce probes, predicts the step time of configurations it was not shown within
20% on this machine.

Job: a 4.2M-parameter MLP (16.8 MB of fp32 gradients) on synthetic 32x32 images, batch 64 per
worker, one thread per worker. Calibration: a 1-worker run (compute per step, model size), 2
co-located workers that never synchronize (local_sgd with H beyond the run: what sharing the
host costs compute), gloo all-reduce probes between 2 processes on loopback and across
the network-namespace lab at 100 Mbit/s (latency and bandwidth, fitted), and the CPU that
an all-reduce of the gradients costs each of 4 processes on the 2 cores. Then each
configuration runs for real, and its measured step (rank 0's mean over the steps after a
warm-up, whole local_sgd periods) is set beside the prediction. The 4-worker row runs 4
workers on this machine's 2 cores: the model is told (cores=2) and predicts the slowdown.

    python benchmarks/costmodel.py [--repeats 3] [--record tests/data/costmodel_recorded.json]

Every calibration (1-worker run, co-located pair, link probes) is repeated --repeats times
and the model takes the medians; each configuration is measured --repeats times (median),
each repeat running everything once, so that calibrations and measurements see the same host.
The table also shows the interval of predictions that the single calibrations give, which
says how far one noisy calibration (what this benchmark used to take) could be off.

--record writes the calibration and the measurements, which tests/unit/test_costmodel.py
checks the model against. Rows at 100 Mbit/s need root and iproute2; without, they are
skipped, saying why.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from floors import Floors  # noqa: E402

from scaletrain.analysis import costmodel  # noqa: E402
from scaletrain.analysis.probe import probe_bytes_cpu, probe_lab, probe_local  # noqa: E402
from scaletrain.cli import predict_argv  # noqa: E402
from scaletrain.netns import NetworkLab, unavailable_reason  # noqa: E402

FLOORS = Floors()

WARMUP = 4
JOB = ["--dataset", "synthetic", "--image-size", "32", "--model", "mlp", "--width", "256",
       "--num-threads", "1", "--batch-size", "64", "--seed", "0"]  # fmt: skip
CONFIGS: list[dict[str, Any]] = [
    {"network": "loopback", "workers": 2, "method": "ddp", "flags": []},
    {"network": "loopback", "workers": 2, "method": "local_sgd:8",
     "flags": ["--strategy", "local_sgd", "--sync-every", "8"]},
    {"network": "loopback", "workers": 4, "method": "ddp", "flags": []},
    {"network": "100mbit", "workers": 2, "method": "ddp", "flags": []},
    {"network": "100mbit", "workers": 2, "method": "local_sgd:8",
     "flags": ["--strategy", "local_sgd", "--sync-every", "8"]},
]  # fmt: skip


def run_local(workers: int, flags: list[str], steps: int, out: Path) -> Path:
    cmd = [sys.executable, "-m", "scaletrain", "run", *JOB, *flags, "--nproc-per-node",
           str(workers), "--max-steps", str(steps), "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        sys.exit(f"run failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return out


def run_shaped(rate: str, workers: int, flags: list[str], steps: int, out: Path) -> Path:
    with NetworkLab(workers, rate=rate) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain([*JOB, *flags, "--max-steps", str(steps)], out)
        outputs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"run failed at {rate}: {outputs[0][1][-2000:]}")
    return out / "node0"


def measured_step(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(r["step_s"] for r in records if r["rank"] == 0 and r["step"] > WARMUP)


def link(network: str, workers: int = 2) -> tuple[float, float]:
    if network == "loopback":
        times = probe_local(workers)
    else:
        with NetworkLab(workers, rate=network) as lab:
            lab.wait_ready()
            times = probe_lab(lab)
    return costmodel.fit_link(list(times), list(times.values()), workers)


def calibrate(tmp: Path, rep: int) -> dict[str, float]:
    """One calibration: a 1-worker run (compute per step, model size), and what sharing the
    host costs compute: 2 co-located workers that never synchronize over 1 worker of the
    same kind alone. Like with like: the 1-worker ddp run's step holds DDP's own work on the
    gradients (1-2 ms here), which local SGD's steps do not, and dividing local SGD's by it
    read a co-located worker as 0.81-0.95x, faster than one alone."""
    cal = costmodel.calibrate_run(run_local(1, [], 24, tmp / f"single{rep}"))
    never = ["--strategy", "local_sgd", "--sync-every", "1000"]
    alone = costmodel.calibrate_run(run_local(1, never, 32, tmp / f"alone{rep}"))
    apart = costmodel.calibrate_run(run_local(2, never, 32, tmp / f"apart{rep}"))
    cal["colocated_slowdown"] = apart["compute_s"] / alone["compute_s"]
    # More processes than cores, as the 4-worker row has: what its ring costs the cores.
    cores = os.cpu_count() or 1
    cal["collective_cpu_per_byte"] = probe_bytes_cpu(2 * cores, int(cal["grad_bytes"]))
    print(f"  calibration {rep}: {cal['compute_s'] * 1e3:.1f} ms per step, co-located "
          f"{cal['colocated_slowdown']:.2f}x, all-reduce CPU "
          f"{cal['collective_cpu_per_byte'] * 1e12:.0f} us per MB sent", flush=True)  # fmt: skip
    return cal


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def predict(
    calibration: dict[str, float], link_: tuple[float, float], row: dict[str, Any]
) -> float:
    cal = calibration_of(calibration, link_)
    return costmodel.predict_method(cal, row["method"], row["workers"]).step_s


def calibration_of(
    calibration: dict[str, float], link_: tuple[float, float], cores: int = 0
) -> costmodel.Calibration:
    """The model's calibration from the measured figures (on ``cores`` cores, by default
    this machine's)."""
    return costmodel.Calibration(
        compute_s=calibration["compute_s"], batch_size=int(calibration["batch_size"]),
        grad_bytes=int(calibration["grad_bytes"]), latency_s=link_[0], bandwidth_Bps=link_[1],
        cores=cores or os.cpu_count() or 1, colocated_slowdown=calibration["colocated_slowdown"],
        collective_cpu_per_byte=calibration.get("collective_cpu_per_byte", 0.0),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", default="", help="write calibration and measurements here")
    parser.add_argument(
        "--repeats", type=int, default=3, help="calibrations, probes and runs of each config"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    networks = ["loopback"] + ([] if unavailable_reason() else ["100mbit"])
    if unavailable_reason():
        print(f"100mbit rows skipped: {unavailable_reason()}")
    configs = [c for c in CONFIGS if c["network"] in networks]
    calibrations: list[dict[str, float]] = []
    probes: dict[str, list[tuple[float, float]]] = {net: [] for net in networks}
    measured: list[list[float]] = [[] for _ in configs]
    with tempfile.TemporaryDirectory() as tmp:
        # Repeat by repeat, everything once: a calibration, the links' probes, each
        # configuration. This host drifts by tens of percent over minutes; calibrating
        # first and measuring after compared two different hosts.
        for rep in range(args.repeats):
            calibrations.append(calibrate(Path(tmp), rep))
            for net in networks:
                probes[net].append(link(net))
            for i, config in enumerate(configs):
                steps = WARMUP + (16 if config["network"] == "loopback" else 8)
                out = Path(tmp) / f"run{i}-{rep}"
                if config["network"] == "loopback":
                    run_dir = run_local(config["workers"], config["flags"], steps, out)
                else:
                    run_dir = run_shaped(config["network"], config["workers"], config["flags"],
                                         steps, out)  # fmt: skip
                measured[i].append(measured_step(run_dir))
    calibration = median_of(calibrations)
    links = {net: (statistics.median(lat for lat, _ in fits),
                   statistics.median(bw for _, bw in fits))
             for net, fits in probes.items()}  # fmt: skip
    print(f"calibration (median of {args.repeats}): {calibration['compute_s'] * 1e3:.1f} ms "
          f"per step without communication, {calibration['grad_bytes'] / 1e6:.1f} MB of "
          f"gradients, co-located {calibration['colocated_slowdown']:.2f}x slower")  # fmt: skip
    for net, (lat, bw) in links.items():
        print(f"link {net}: latency {lat * 1e6:.0f} us, bandwidth {bw * 8 / 1e6:,.0f} Mbit/s")
    rows = [{**config, "measured_step_s": statistics.median(times), "measured_all": times}
            for config, times in zip(configs, measured, strict=True)]  # fmt: skip
    # The point prediction uses the median calibration; the interval, every single one (and
    # every probe of the link): how far one noisy calibration alone could have been off.
    print(f"\n{'network':<9} {'W':>2} {'method':<12} {'predicted ms':>12} {'interval ms':>13} "
          f"{'measured ms':>11} {'pred/meas':>9}  floor")  # fmt: skip
    for row in rows:
        predicted = predict(calibration, links[row["network"]], row)
        each = [predict(c, fit, row) for c in calibrations for fit in probes[row["network"]]]
        ratio = predicted / row["measured_step_s"]
        verdict = FLOORS.check(
            f"{row['network']} W={row['workers']} {row['method']}: pred/meas within 20%",
            abs(ratio - 1) <= 0.2,
        )
        print(f"{row['network']:<9} {row['workers']:>2} {row['method']:<12} "
              f"{predicted * 1e3:12.1f} {min(each) * 1e3:6.1f}-{max(each) * 1e3:<6.1f} "
              f"{row['measured_step_s'] * 1e3:11.1f} {ratio:9.2f}  {verdict}")  # fmt: skip
    print("\nthe same predictions from the command line (scaletrain predict, given these figures):")
    for net, fit in links.items():
        rows_here = [r for r in rows if r["network"] == net]
        print("  " + " ".join(predict_argv(
            calibration_of(calibration, fit),
            sorted({r["workers"] for r in rows_here}),
            list(dict.fromkeys(r["method"] for r in rows_here)),
        )))  # fmt: skip
    if args.record:
        record = {"calibration": calibration, "cores": os.cpu_count(),
                  "links": {k: list(v) for k, v in links.items()},
                  "measured": [{k: r[k] for k in ("network", "workers", "method",
                                                  "measured_step_s")} for r in rows]}  # fmt: skip
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded: {args.record}")
    FLOORS.finish()


if __name__ == "__main__":
    main()
