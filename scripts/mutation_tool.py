"""``make mutants``, second half: mutmut over the pure modules, a kill-rate floor per module.

The catalog (scripts/mutants.py) holds the promises whose breaking edit a person chose; this
half asks a tool for every edit it can think of in the modules that are functions of plain
values (the data plan's arithmetic, the parameter server's consistency and cut rules, the
checkpoint interval, the learning-rate schedule, the cost model), and requires the unit
tests to notice at least ``FLOOR`` of them in each module.

Why mutmut (3.x) and not cosmic-ray: mutmut compiles every mutant into the module at once
behind a switch, records which tests reach which function, and runs only those tests in a
process forked from one that has already imported torch and the package. cosmic-ray writes
each mutant to disk and starts a new test process for it: with torch's import (about 2 s
here) for each of 2,400 mutants, over an hour on this 2-core machine, where mutmut takes
13 minutes.

The modules and the tests are ``[tool.mutmut]`` in pyproject.toml (so ``mutmut run`` and
``mutmut show NAME`` work by hand too). This script runs mutmut in a scratch copy of the
working tree, counts each module's mutants by verdict, writes runs/mutmut/result.json (with
the command, the date, the machine and the surviving mutants' names) and exits 1 when a
module is below its floor. A mutant that no test reaches counts as surviving; one whose tests
time out counts as caught.

    python scripts/mutation_tool.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from mutants import copy_tree, provenance  # noqa: E402

RESULTS = REPO / "runs" / "mutmut"
FLOOR = 0.90
TIMEOUT_S = 25 * 60
KILLED = {1, 3, 37}  # mutmut's exit codes for a mutant a test (or the type check) caught
# A mutant whose tests ran past mutmut's time limit (a loop that never ends): make test's own
# timeout would fail them too, so it counts as caught, and is listed as such.
TIMED_OUT = {24, -24, 36, 152, 255}


def modules() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def tally(scratch: Path) -> dict[str, dict]:
    """Per module: mutants, killed, the rate, and the names of those not killed."""
    out = {}
    for module in modules():
        meta = scratch / "mutants" / (module + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        verdicts = collections.Counter(
            "killed" if c in KILLED else "timeout" if c in TIMED_OUT else
            "no tests" if c in (5, 33) else "survived" if c == 0 else f"exit {c}"
            for c in codes.values()
        )  # fmt: skip
        killed = verdicts["killed"] + verdicts["timeout"]
        out[module] = {
            "mutants": len(codes),
            "killed": killed,
            "rate": round(killed / len(codes), 4) if codes else 0.0,
            "verdicts": dict(verdicts),
            "not_killed": sorted(k for k, c in codes.items() if c not in KILLED | TIMED_OUT),
        }
    return out


def run(scratch: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("SCALETRAIN_STRESS_SEED", None)
    mutmut = Path(sys.executable).with_name("mutmut")
    try:
        result = subprocess.run(
            [str(mutmut), "run"], cwd=scratch, env=env, capture_output=True, text=True,
            timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, f"mutmut gave no verdict within {TIMEOUT_S} s"
    # Its progress line is redrawn in place; the last 2,000 characters hold the outcome.
    return result.returncode, (result.stdout + result.stderr).replace("\r", "\n")[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it")
    args = parser.parse_args()
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="scaletrain-mutmut-") as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        copy_tree(scratch)
        code, tail = run(scratch)
        per_module = tally(scratch)
    below = {m: r for m, r in per_module.items() if r["rate"] < FLOOR}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "result.json").write_text(json.dumps({
        **provenance("scripts/mutation_tool.py", began), "floor": FLOOR,
        "modules": per_module,
    }, indent=1))  # fmt: skip
    for module, r in per_module.items():
        verdict = "PASS" if r["rate"] >= FLOOR else "FAIL"
        print(
            f"{module:52} {r['killed']:5} of {r['mutants']:5} killed  {r['rate']:6.1%}  {verdict}"
        )
    print(f"\nmutmut in {time.time() - began:.0f} s; survivors: runs/mutmut/result.json "
          "(see one: --keep DIR, then `mutmut show NAME` in DIR)")  # fmt: skip
    if code != 0 or not all(r["mutants"] for r in per_module.values()):
        print(f"error: mutmut did not finish (exit {code}):\n{tail}", file=sys.stderr)
        return 1
    if below:
        print(f"{len(below)} module(s) below the {FLOOR:.0%} floor: {', '.join(below)}")
        return 1
    print(f"every module at or above the {FLOOR:.0%} floor ({len(per_module)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
