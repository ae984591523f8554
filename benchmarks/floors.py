"""The floors a benchmark states, checked, and the record of its run.

Each ``check`` returns PASS or FAIL for the printed table; ``table`` keeps a table of the
run's figures; ``headline`` names the one figure README.md shows. ``finish`` writes the
record, runs/bench/<benchmark>.json (the command, the date, the machine, the commit, every
floor with its verdict, the tables), and ends the process with status 1 when any floor was
missed, so ``make bench`` is a check and not a printout.

    floors = Floors()
    print(f"... {floors.check('async checkpoint share <= 5%', share <= 0.05)}")
    floors.table("checkpoint cost", ["mode", "blocked ms"], [["sync", 9.5], ["async", 3.1]])
    floors.finish()

The docs show figures only from such records: ``python scripts/figures.py keep NAME`` copies
a run's record into docs/benchmarks/records/, and the pages include its tables from there
(scripts/figures.py), so no figure is typed by hand.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "runs" / "bench"


def machine() -> str:
    """The CPU model, cores, memory, OS, Python and torch: what the figures depend on."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{mem_kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = "unknown memory"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "no torch"
    system = f"{platform.system()} {platform.release()}"
    return (f"{cpu}, {os.cpu_count()} cores, {memory}, {system}, "
            f"Python {platform.python_version()}, torch {torch_version}")  # fmt: skip


def source_commit() -> str:
    """The commit the measuring code is at, marked ``+changes`` when src/ or benchmarks/
    differ from it (the code that measured is then not the commit's)."""
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    changed = subprocess.run([*git, "status", "--porcelain", "--", "src", "benchmarks"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    return commit + ("+changes" if changed else "")


class Floors:
    def __init__(self, name: str | None = None) -> None:
        self.name = name or Path(sys.argv[0]).stem
        self.missed: list[str] = []
        self.checked = 0
        self.began = time.time()
        self.floors: list[dict[str, Any]] = []
        self.tables: list[dict[str, Any]] = []
        self.headlines: list[dict[str, str]] = []
        self.commit = source_commit()

    def check(self, what: str, ok: bool) -> str:
        self.checked += 1
        self.floors.append({"what": what, "ok": bool(ok)})
        if not ok:
            self.missed.append(what)
        return "PASS" if ok else "FAIL"

    def table(self, title: str, header: list[str], rows: list[list[Any]], note: str = "") -> None:
        """A table of this run's figures, as the record (and the docs) will show it (none
        when it has no row: a part the run's arguments left out)."""
        if not rows:
            return
        cells = [[str(c) for c in row] for row in rows]
        self.tables.append({"title": title, "header": list(header), "rows": cells, "note": note})

    def headline(self, what: str, figure: str) -> None:
        """The row README.md's table of measured figures shows for this benchmark."""
        self.headlines.append({"what": what, "figure": figure})

    def record(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "command": " ".join(["python", f"benchmarks/{self.name}.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.began)),
            "wall_s": round(time.time() - self.began),
            "machine": machine(),
            "commit": self.commit,
            "floors": self.floors,
            "met": self.checked - len(self.missed),
            "checked": self.checked,
            "tables": self.tables,
            "headlines": self.headlines,
        }

    def finish(self) -> None:
        RECORDS.mkdir(parents=True, exist_ok=True)
        path = RECORDS / f"{self.name}.json"
        path.write_text(json.dumps(self.record(), indent=1) + "\n")
        print(f"\nrecord: {path.relative_to(REPO)}")
        if self.missed:
            print(f"\n{len(self.missed)} of {self.checked} floors missed:")
            for what in self.missed:
                print(f"  {what}")
            sys.exit(1)
        print(f"\nevery floor met ({self.checked})")
