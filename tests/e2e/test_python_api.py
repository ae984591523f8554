"""``scaletrain.run(cfg)`` from every way of starting Python: a script without a main guard,
standard input, ``-c``, IPython, a Jupyter notebook's kernel. The workers are forked from the
launcher's fork server; multiprocessing sends each child the caller's ``__main__`` to run
again, which launched a second job from inside every worker of a guard-less script and
failed to open ``<stdin>`` from ``python -`` (launch/forkserver.py keeps it out). Real
launchers, real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import assert_no_orphans

# What the Python API page shows, at module level: no `if __name__ == "__main__":`.
SCRIPT = """
import json
import scaletrain
from scaletrain.config import RunConfig, with_overrides

cfg = with_overrides(RunConfig(), {OVERRIDES})
summary = scaletrain.run(cfg, show_progress=False)
print("SUMMARY " + json.dumps({"steps": summary["steps"], "world": summary["world_size"]}))
"""
RESTART = {"nproc_per_node": 2, "max_steps": 4, "batch_size": 32, "num_threads": 1}
PS = {**RESTART, "nproc_per_node": 3, "strategy": "ps", "num_servers": 1}


def script(tmp_path: Path, overrides: dict) -> str:
    out = str(tmp_path / "run")
    return SCRIPT.replace("{OVERRIDES}", repr({**overrides, "out": out}))


def summary_of(stdout: str) -> dict:
    [line] = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    return json.loads(line.removeprefix("SUMMARY "))


def started(way: str, tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    bin_dir = Path(sys.executable).parent
    path = tmp_path / "train.py"
    path.write_text(code)
    commands = {
        "script": ([sys.executable, str(path)], None),
        "stdin": ([sys.executable, "-"], code),
        "-c": ([sys.executable, "-c", code], None),
        "ipython": ([str(bin_dir / "ipython"), "--no-banner", "--quick", str(path)], None),
    }
    argv, stdin = commands[way]
    closed = subprocess.DEVNULL if stdin is None else None  # `input` opens a pipe itself
    return subprocess.run(argv, input=stdin, stdin=closed, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)  # fmt: skip


@pytest.mark.parametrize(
    ("way", "overrides"),
    [
        ("script", RESTART),
        ("stdin", RESTART),
        ("-c", RESTART),
        ("ipython", RESTART),
        ("script", PS),
    ],  # fmt: skip
)
def test_run_from_a_script_without_a_main_guard(tmp_path, way, overrides):
    result = started(way, tmp_path, script(tmp_path, overrides))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert summary_of(result.stdout) == {"steps": 4, "world": overrides["nproc_per_node"]}
    # The script ran once: one launch, one run directory, no job launched from a worker.
    assert result.stdout.count("SUMMARY ") == 1
    assert_no_orphans(tmp_path / "run")


def test_run_from_a_notebook_kernel(tmp_path):
    """A kernel's ``__main__`` is a module without a file; the cell runs in it."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(script(tmp_path, RESTART))]
    NotebookClient(notebook, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    outputs = notebook.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert summary_of(text) == {"steps": 4, "world": 2}, outputs
    assert_no_orphans(tmp_path / "run")
