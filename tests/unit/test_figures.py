"""Measured figures come from the records their benchmarks wrote (scripts/figures.py): README's
table is the records' headlines, every record the docs name exists and says where it comes
from, and no new table of figures is typed by hand into docs/benchmarks."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import figures  # noqa: E402

# Tables of figures in docs/benchmarks still typed by hand, waiting for their benchmark's next
# run to write a record (then `python scripts/figures.py keep NAME` and a marker replace
# them). The count may only fall: a new hand-typed table fails here.
HAND_TYPED_TABLES = 4


def records():
    return sorted(figures.KEPT.glob("*.json"))


def test_readme_shows_exactly_the_records_headlines():
    text = (REPO / "README.md").read_text()
    block = figures.README_BLOCK.search(text)
    assert block, "README.md lost its <!-- figures:readme --> block"
    assert block.group(2) == figures.readme_table(), (
        "README.md's measured figures differ from docs/benchmarks/records: "
        "python scripts/figures.py readme --write"
    )
    headlines = sum(len(json.loads(p.read_text())["headlines"]) for p in records())
    assert block.group(2).count("\n") == 2 + headlines


@pytest.mark.parametrize("path", records(), ids=lambda p: p.stem)
def test_a_record_says_where_its_figures_come_from(path):
    record = json.loads(path.read_text())
    assert record["benchmark"] == path.stem
    assert record["command"].startswith(f"python benchmarks/{path.stem}.py")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", record["date"])
    assert "cores" in record["machine"] and "torch" in record["machine"]
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", record["commit"])
    assert record["checked"] == len(record["floors"])
    assert record["met"] == sum(f["ok"] for f in record["floors"])
    for table in record["tables"]:
        assert all(len(row) == len(table["header"]) for row in table["rows"]), table["title"]
    shown = [p.read_text() for p in (REPO / "docs").rglob("*.md")]
    assert any(f"<!-- figures: {path.stem} -->" in page for page in shown), (
        f"no page shows the record {path.name}"
    )


def test_every_figures_marker_names_a_kept_record():
    for page in (REPO / "docs").rglob("*.md"):
        for name in figures.MARKER.findall(page.read_text()):
            assert (figures.KEPT / f"{name}.json").exists(), f"{page}: no record {name}"
            rendered = figures.render(figures.load(name))
            assert rendered.startswith("Measured ") and "floors met" in rendered


def test_no_new_table_of_figures_is_typed_by_hand():
    tables = 0
    for page in sorted((REPO / "docs" / "benchmarks").glob("*.md")):
        tables += sum(1 for line in page.read_text().splitlines() if line.startswith("| ---"))
    assert tables <= HAND_TYPED_TABLES, (
        f"{tables} tables typed by hand in docs/benchmarks (at most {HAND_TYPED_TABLES}): a "
        "benchmark's figures go into its record (benchmarks/floors.py) and onto the page as "
        "<!-- figures: NAME -->"
    )
    if tables < HAND_TYPED_TABLES:
        pytest.fail(f"only {tables} hand-typed tables are left: lower HAND_TYPED_TABLES to it")


def test_a_missing_record_is_an_error_that_says_how_to_make_it():
    with pytest.raises(FileNotFoundError, match="run its benchmark, then python scripts/figures"):
        figures.expand("<!-- figures: no_such_benchmark -->\n")
