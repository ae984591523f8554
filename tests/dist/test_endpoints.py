"""Where a local data-parallel run listens: the launcher's rendezvous store, rank 0's worker
store and gloo's connections, all on 127.0.0.1 (torch's TCPStore alone would listen on
every interface). Across hosts, tests/e2e/test_netns.py checks each host's address."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, listeners_while_running


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_local_ddp_run_listens_on_loopback_only(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "scaletrain", "run", "--nproc-per-node", "2",
            "--max-steps", "8", "--inject", "slow:rank=0:factor=10", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen = listeners_while_running(proc, out)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert len(seen) >= 2, seen  # the rendezvous store and rank 0's store at least
    assert all(address.startswith("127.0.0.1:") for address in seen), seen
