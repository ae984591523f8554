"""``scaletrain bench``: run one job over a grid of worker counts, strategies, compressors and
(optionally) link bandwidths, and gather every run's summary.json into one table and a CSV.

Each point is a full ``scaletrain run`` into OUT/<point>/: on loopback through the launcher
in this process, or, with ``--bandwidth``, one node per worker in the network-namespace lab
(scaletrain/netns.py), its links shaped to that rate. A point that cannot run here (an
unknown strategy, a compressor the strategy does not take, a bandwidth without root) is
reported with the reason and skipped; a point that fails is reported with its error; the
rest of the sweep goes on, and the table shows whatever finished.

Speedup is a point's samples/s over the 1-worker point with the same strategy, compressor and
network (or, without one, the 1-worker ddp point on that network); efficiency is speedup
divided by workers.
"""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig, dumps_toml, with_overrides

COLUMNS = (
    "nproc", "strategy", "compression", "bandwidth", "status", "samples_per_s",
    "speedup", "efficiency", "comm_share", "mb_per_step", "test_accuracy", "run_dir",
)  # fmt: skip


@dataclass
class Point:
    nproc: int
    strategy: str
    compression: str
    bandwidth: str  # "" for plain loopback
    status: str = "pending"
    summary: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None

    @property
    def name(self) -> str:
        net = self.bandwidth or "loopback"
        return f"{self.strategy}-{self.compression.replace(':', '_')}-{net}-w{self.nproc}"

    def config(self, base: RunConfig, out: Path) -> RunConfig:
        return with_overrides(base, {
            "nproc_per_node": self.nproc, "strategy": self.strategy,
            "compression": self.compression, "out": str(out / self.name),
        })  # fmt: skip


def parse_list(value: str, what: str, kind: type = str) -> list[Any]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"bench: --{what} needs at least one value")
    try:
        return [kind(v) for v in items]
    except ValueError:
        raise ValueError(f"bench: --{what} must be {kind.__name__}s, got {value!r}") from None


def plan(nprocs: list[int], strategies: list[str], compressions: list[str],
         bandwidths: list[str]) -> list[Point]:  # fmt: skip
    if any(n < 1 for n in nprocs):
        raise ValueError(f"bench: --nproc values must be >= 1, got {nprocs}")
    grid = itertools.product(bandwidths, strategies, compressions, nprocs)
    return [Point(n, s, c, b) for b, s, c, n in grid]


def why_not(point: Point, base: RunConfig, out: Path) -> str | None:
    """The reason this point cannot run here, or None."""
    from scaletrain.launch import check_names, check_strategy
    from scaletrain.netns import parse_rate, unavailable_reason

    try:
        cfg = point.config(base, out)
        check_names(cfg)
        check_strategy(cfg)
        if point.bandwidth:
            parse_rate(point.bandwidth)
    except ValueError as e:
        return str(e)
    if point.bandwidth and (reason := unavailable_reason()):
        return f"--bandwidth needs the network-namespace lab: {reason}"
    return None


def run_point(point: Point, base: RunConfig, out: Path) -> None:
    from scaletrain.launch import LaunchFailed, WorkerFailed, run

    cfg = point.config(base, out)
    try:
        if point.bandwidth:
            point.run_dir = run_shaped(point, cfg, out)
            point.summary = json.loads((point.run_dir / "summary.json").read_text())
        else:
            point.summary = run(cfg, show_progress=False)
            point.run_dir = Path(point.summary["run_dir"])
        point.status = "ok"
    except (ValueError, WorkerFailed, LaunchFailed, RuntimeError) as e:
        point.status = f"failed: {str(e).splitlines()[0]}"


def run_shaped(point: Point, cfg: RunConfig, out: Path) -> Path:
    """One node per worker, each in its own network namespace behind a shaped link."""
    from scaletrain.netns import NetworkLab

    root = out / point.name
    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.toml"
    data = cfg.to_dict()
    data["out"] = ""
    data["launch"]["nproc_per_node"] = 1
    config.write_text(dumps_toml(data))
    with NetworkLab(point.nproc, rate=point.bandwidth) as lab:
        lab.wait_ready()
        procs = lab.launch_scaletrain(["--config", str(config)], root)
        outputs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(next(err for p, (_, err) in zip(procs, outputs, strict=True)
                                if p.returncode).strip().splitlines()[-1])  # fmt: skip
    return root / "node0"  # node 0 holds rank 0, which writes the summary


def rows(points: list[Point]) -> list[dict[str, Any]]:
    def rate(p: Point) -> float | None:
        return p.summary.get("samples_per_s") if p.status == "ok" else None

    singles = {(p.strategy, p.compression, p.bandwidth): rate(p) for p in points if p.nproc == 1}
    ddp_singles = {p.bandwidth: rate(p) for p in points
                   if p.nproc == 1 and p.strategy == "ddp" and p.compression == "none"}  # fmt: skip
    out = []
    for p in points:
        r = rate(p)
        base = singles.get((p.strategy, p.compression, p.bandwidth)) or ddp_singles.get(p.bandwidth)
        speedup = r / base if r and base else None
        out.append({
            "nproc": p.nproc, "strategy": p.strategy, "compression": p.compression,
            "bandwidth": p.bandwidth or "loopback", "status": p.status,
            "samples_per_s": r, "speedup": speedup,
            "efficiency": speedup / p.nproc if speedup else None,
            "comm_share": p.summary.get("comm_share"),
            "mb_per_step": (p.summary["comm_bytes_per_step"] / 1e6
                            if "comm_bytes_per_step" in p.summary else None),
            "test_accuracy": p.summary.get("test_accuracy"),
            "run_dir": str(p.run_dir or ""),
        })  # fmt: skip
    return out


def write_csv(table: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)


def render(table: list[dict[str, Any]]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    networks = sorted({r["bandwidth"] for r in table})
    many = len(networks) > 1  # one network: named in the title instead of a column
    title = "scaletrain bench" + ("" if many else f" ({networks[0]})")
    view = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    columns = ["W", "method", *(["network"] if many else []), "samples/s", "speedup",
               "effic.", "comm", "MB/step", "status"]  # fmt: skip
    for column in columns:
        view.add_column(column, no_wrap=True, min_width=8 if column == "status" else None)
    notes: list[str] = []
    for r in table:
        status = r["status"]
        if status != "ok":  # the reason goes below the table, numbered once per reason
            if status not in notes:
                notes.append(status)
            word = "skip" if status.startswith("cannot") else "fail"
            status = f"{word} [{notes.index(status) + 1}]"
        method = r["strategy"] + ("" if r["compression"] == "none" else f"+{r['compression']}")
        view.add_row(
            str(r["nproc"]), method, *([r["bandwidth"]] if many else []),
            fmt(r["samples_per_s"], ",.0f"), fmt(r["speedup"], ".2f"),
            fmt(r["efficiency"], ".0%"), fmt(r["comm_share"], ".0%"),
            fmt(r["mb_per_step"], ".2f"), status,
        )  # fmt: skip
    console = Console()
    console.print(view)
    for i, note in enumerate(notes, 1):
        console.print(f"[{i}] {note}", highlight=False, soft_wrap=True)


def sweep(base: RunConfig, out: Path, points: list[Point]) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    for point in points:
        reason = why_not(point, base, out)
        if reason:
            point.status = f"cannot run: {reason}"
            print(f"{point.name}: {point.status}", flush=True)
            continue
        print(f"{point.name}: running", flush=True)
        run_point(point, base, out)
        print(f"{point.name}: {point.status}", flush=True)
    table = rows(points)
    write_csv(table, out / "bench.csv")
    return table
