"""``make mutants``: every promise's test, seen failing on the edit that breaks the promise.

The catalog (scripts/mutant_catalog.py) lists mutations: each the smallest source edit that
breaks one promise the docs make, with the tests of ``make test`` that must then fail. This
runner copies the working tree to a scratch directory (tracked and untracked files, not the
ignored ones), and for each mutation:

1. checks that its text occurs exactly once in its file: code that moved makes the entry
   stale, which is a failure of the catalog (fix the entry), never a pass;
2. applies it, runs its tests there (pytest, the scratch copy's ``src`` first on the path,
   so every worker process imports the mutated package), and restores the file;
3. calls it caught when at least one of its tests failed (not merely errored at
   collection: a mutation that breaks an import proves nothing about the promise).

Exit status 0 only when every mutation was caught. The outcome of each goes to
runs/mutants/result.json (with the commit, the date and the machine) and to stdout.

    python scripts/mutants.py [--only NAME ...] [--jobs N] [--list]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from mutant_catalog import CATALOG, Mutation  # noqa: E402

RESULTS = REPO / "runs" / "mutants"
TIMEOUT_S = 900  # one mutation's tests; each test has pytest's own timeout too


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked, and untracked but not ignored)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def provenance(script: str, began: float) -> dict:
    """Where a result comes from: the command, the date, the machine, the commit, the time."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    return {
        "command": f"python {script} " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(began)),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}",
        "commit": commit,
        "wall_s": round(time.time() - began),
    }


def failed_tests(report: Path) -> tuple[list[str], list[str], int]:
    """(tests that failed, collection errors, tests that ran) in a junit report."""
    if not report.exists():
        return [], ["no report written"], 0
    failed, errors, ran = [], [], 0
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        ran += case.find("skipped") is None
        if case.find("failure") is not None:
            failed.append(name)
        elif case.find("error") is not None:
            # An error in a fixture or set-up of the test itself counts as its failure (a
            # session fixture's reference run that fails); a collection error has no case.
            failed.append(name)
    for suite in ET.parse(report).iter("testsuite"):
        if int(suite.get("errors", 0)) and not failed:
            errors.append(f"{suite.get('errors')} error(s) outside any test")
    return failed, errors, ran


def run_one(mutation: Mutation, scratch: Path) -> dict:
    path = scratch / mutation.path
    original = path.read_text()
    count = original.count(mutation.old)
    outcome: dict = {"name": mutation.name, "promise": mutation.promise, "tests": mutation.tests}
    if count != 1:
        outcome |= {"verdict": "stale", "why": f"its text occurs {count} times in {mutation.path}"}
        return outcome
    report = scratch / "runs" / f"mutant-{mutation.name}.xml"
    report.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("SCALETRAIN_STRESS_SEED", None)  # the tests as make test runs them
    began = time.monotonic()
    path.write_text(original.replace(mutation.old, mutation.new))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0",
             f"--junitxml={report}", *mutation.tests],
            cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        code, tail = result.returncode, (result.stdout + result.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        code, tail = -1, f"no verdict within {TIMEOUT_S} s"
    finally:
        path.write_text(original)
    failed, errors, ran = failed_tests(report)
    outcome["seconds"] = round(time.monotonic() - began, 1)
    if code == 1 and failed:
        outcome |= {"verdict": "caught", "by": failed[0]}
    elif not ran:  # skipped (make stress only) or not found: no test of make test names it
        outcome |= {"verdict": "error", "why": "none of its tests ran in make test"}
    elif code == 0:
        outcome |= {"verdict": "survived", "why": "every test passed with the mutation"}
    else:
        outcome |= {"verdict": "error", "why": f"pytest exit {code}; {errors}", "tail": tail}
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="run these mutations only")
    parser.add_argument(
        "--jobs", type=int, default=2, help="mutations run at once (scratch copies)"
    )
    parser.add_argument("--list", action="store_true", help="print the catalog and exit")
    args = parser.parse_args()
    chosen = [m for m in CATALOG if args.only is None or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        known = sorted(m.name for m in CATALOG)
        print(f"error: unknown mutation in {args.only}; known: {known}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.area:18} {m.promise}")
        print(f"{len(chosen)} mutations")
        return 0
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="scaletrain-mutants-") as tmp:
        scratches = [Path(tmp) / f"copy{i}" for i in range(max(1, args.jobs))]
        for scratch in scratches:
            copy_tree(scratch)
        free = list(scratches)
        outcomes: list[dict] = []
        with concurrent.futures.ThreadPoolExecutor(len(scratches)) as pool:
            pending: dict[concurrent.futures.Future[dict], Path] = {}
            queue = list(chosen)
            while queue or pending:
                while queue and free:
                    scratch = free.pop()
                    pending[pool.submit(run_one, queue.pop(0), scratch)] = scratch
                done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                for future in done:
                    free.append(pending.pop(future))
                    outcome = future.result()
                    outcomes.append(outcome)
                    extra = outcome.get("by") or outcome.get("why", "")
                    print(f"{outcome['verdict']:8} {outcome['name']:32} "
                          f"{outcome.get('seconds', 0):6.1f} s  {extra}", flush=True)  # fmt: skip
    caught = sum(o["verdict"] == "caught" for o in outcomes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "result.json").write_text(json.dumps({
        **provenance("scripts/mutants.py", began),
        "caught": caught, "total": len(outcomes),
        "mutations": sorted(outcomes, key=lambda o: o["name"]),
    }, indent=1))  # fmt: skip
    print(f"\n{caught} of {len(outcomes)} mutations caught in {time.time() - began:.0f} s")
    for o in outcomes:
        if o["verdict"] != "caught":
            print(f"NOT CAUGHT {o['name']} ({o['verdict']}): {o['promise']}\n  {o.get('why')}")
            if o.get("tail"):
                print("  " + o["tail"].replace("\n", "\n  "))
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
