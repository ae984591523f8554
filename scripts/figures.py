"""Measured figures in the docs, from the records the benchmarks wrote (benchmarks/floors.py).

A benchmark's run writes runs/bench/NAME.json. ``keep NAME`` copies it into
docs/benchmarks/records/, the records the docs show; a page includes one with a line

    <!-- figures: NAME -->

which the docs build (an MkDocs hook: ``on_page_markdown`` below) replaces with the record's
tables, the command that made them, its date, machine and commit, and how many of its floors
were met. README.md's table of measured figures is the records' headlines, between
``<!-- figures:readme -->`` and ``<!-- /figures:readme -->``; ``readme --write`` rewrites
it and ``readme --check`` (a unit test runs it) fails when it differs from the records, so
no figure on either is typed by hand.

    python scripts/figures.py keep NAME [NAME ...]
    python scripts/figures.py show NAME
    python scripts/figures.py readme --check | --write
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "docs" / "benchmarks" / "records"
RUNS = REPO / "runs" / "bench"
MARKER = re.compile(r"^<!-- figures: ([\w-]+) -->$", re.M)
README_BLOCK = re.compile(r"(<!-- figures:readme -->\n)(.*?)(<!-- /figures:readme -->)", re.S)


def load(name: str) -> dict[str, Any]:
    path = KEPT / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no record {path.relative_to(REPO)}: run its benchmark, then "
                                f"python scripts/figures.py keep {name}")  # fmt: skip
    return json.loads(path.read_text())


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(record: dict[str, Any]) -> str:
    """The record as markdown: where it comes from, its tables, its floors."""
    missed = [f["what"] for f in record["floors"] if not f["ok"]]
    lines = [
        f"Measured {record['date']} by `{record['command']}` (commit {record['commit']}, "
        f"{record['wall_s']} s) on {record['machine']}: "
        f"{record['met']} of {record['checked']} floors met"
        + (": missed " + "; ".join(missed) if missed else "") + ".",
        "",
    ]  # fmt: skip
    for table in record["tables"]:
        lines += [f"**{table['title']}**", ""] if table["title"] else []
        lines.append("| " + " | ".join(cell(h) for h in table["header"]) + " |")
        lines.append("| " + " | ".join("---" for _ in table["header"]) + " |")
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table["rows"]]
        lines += ["", table["note"], ""] if table["note"] else [""]
    return "\n".join(lines)


def expand(markdown: str) -> str:
    """Every ``<!-- figures: NAME -->`` line replaced by its record."""
    return MARKER.sub(lambda m: render(load(m.group(1))), markdown)


def readme_table() -> str:
    rows = ["| what | figure | measured |", "| --- | --- | --- |"]
    for path in sorted(KEPT.glob("*.json")):
        record = json.loads(path.read_text())
        when = f"{record['date'][:10]}, `{record['command']}`"
        page = shown_on(record["benchmark"])
        rows += [f"| {cell(h['what'])} | {cell(h['figure'])} | {when}; {page} |"
                 for h in record["headlines"]]  # fmt: skip
    return "\n".join(rows) + "\n"


def shown_on(name: str) -> str:
    """A link to the docs page that shows record ``name`` (README's links are from the root)."""
    for page in sorted((REPO / "docs").rglob("*.md")):
        if f"<!-- figures: {name} -->" in page.read_text():
            path = page.relative_to(REPO)
            return f"[{page.stem if page.stem != 'index' else page.parent.name}]({path})"
    return "not shown in the docs"


def readme(write: bool) -> int:
    path = REPO / "README.md"
    text = path.read_text()
    match = README_BLOCK.search(text)
    if not match:
        print("error: README.md has no <!-- figures:readme --> block", file=sys.stderr)
        return 1
    fresh = text[: match.start(2)] + readme_table() + text[match.end(2) :]
    if write:
        path.write_text(fresh)
        return 0
    if fresh != text:
        print("README.md's measured figures differ from docs/benchmarks/records: run "
              "python scripts/figures.py readme --write", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs hook: a page's figures markers become their records."""
    return expand(markdown)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    keep = sub.add_parser("keep", help="copy runs/bench/NAME.json into the docs' records")
    keep.add_argument("names", nargs="+")
    show = sub.add_parser("show", help="print a kept record as the docs show it")
    show.add_argument("name")
    rd = sub.add_parser("readme", help="README.md's measured figures from the records")
    rd.add_argument("--write", action="store_true")
    rd.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.command == "keep":
        KEPT.mkdir(parents=True, exist_ok=True)
        for name in args.names:
            source = RUNS / f"{name}.json"
            if not source.exists():
                print(f"error: {source} does not exist: run benchmarks/{name}.py first",
                      file=sys.stderr)  # fmt: skip
                return 2
            shutil.copy(source, KEPT / source.name)
        return readme(write=True)
    if args.command == "show":
        print(render(load(args.name)))
        return 0
    return readme(write=args.write)


if __name__ == "__main__":
    sys.exit(main())
