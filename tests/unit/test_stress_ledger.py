"""`make stress`'s ledger: rounds add up over commits whose files under test are identical
(a README fix keeps its parent's rounds) and never over commits whose code differs. A real
git repository in a temporary directory; no round is run."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stress():
    spec = importlib.util.spec_from_file_location("stress", REPO / "scripts" / "stress.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                   cwd=repo, check=True)  # fmt: skip
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def test_rounds_add_up_over_documentation_only_commits_and_never_over_code(stress, tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    base = commit(tmp_path, {"src/a.py": "x = 1\n", "tests/t.py": "t\n", "README.md": "r\n",
                             "docs/d.md": "d\n", "scripts/stress.py": "s\n"}, "base")  # fmt: skip
    docs = commit(tmp_path, {"README.md": "r2\n", "docs/d.md": "d2\n", "docs/new.md": "n\n",
                             "scripts/stress.py": "s2\n"}, "docs and the runner")  # fmt: skip
    # Names that look like documentation but sit where code does are code.
    nested = commit(tmp_path, {"src/README.md": "code's own\n"}, "a file under src/")
    code = commit(tmp_path, {"src/a.py": "x = 2\n"}, "code")
    test = commit(tmp_path, {"tests/t.py": "t2\n"}, "a test")

    assert stress.clean_commit(tmp_path) == test
    assert stress.code_of(base, tmp_path) == stress.code_of(docs, tmp_path)
    digests = [stress.code_of(c, tmp_path) for c in (docs, nested, code, test)]
    assert len(set(digests)) == 4

    def round_(c, **extra):
        return {"commit": c, "exit": 0, "results": [], "pytest_args": [], **extra}

    unknown = "f" * 40  # a commit this clone has never seen
    ledger = [round_(base), round_(docs), round_(nested), round_(code), round_(base),
              round_(docs, pytest_args=["-k", "x"]), round_(unknown)]  # fmt: skip
    assert stress.rounds_of_the_same_code(ledger, docs, tmp_path) == [ledger[0], ledger[1],
                                                                       ledger[4]]  # fmt: skip
    assert stress.rounds_of_the_same_code(ledger, code, tmp_path) == [ledger[3]]
    assert stress.rounds_of_the_same_code(ledger, test, tmp_path) == []
    assert stress.rounds_of_the_same_code(ledger, unknown, tmp_path) == [ledger[6]]
