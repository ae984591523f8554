"""Shared fixtures: environment isolation, process-group cleanup, CLI runner, orphan check.

The reference runs that several tests of a module compare against are session-scoped
fixtures: pytest-xdist interleaves modules on a worker, and a module-scoped fixture is torn
down whenever its worker moves to another module, then trained again when it comes back.
``built_once`` goes further: one build per session, shared by the workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_env():
    """Restore os.environ and destroy any process group a test left behind. Every thread a
    test started must be gone by its end: a daemon thread still inside a torch call when
    the interpreter exits is forced out by pthread_exit as the call returns, which aborts
    the whole pytest process ("terminate called without an active exception")."""
    import threading

    saved = dict(os.environ)
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = sorted(t.name for t in set(threading.enumerate()) - before)
    assert not left, f"threads outlived the test: {left}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def listeners(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (needs ss)."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in lines if any(f"pid={p}," in line for p in pids)]


def listeners_while_running(proc: subprocess.Popen[str], out: Path) -> set[str]:
    """Every address the launcher ``proc`` and the processes of run ``out`` listened on,
    polled until it exits."""
    import time

    seen: set[str] = set()
    deadline = time.monotonic() + 200
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= set(listeners([proc.pid, *processes_mentioning(str(out))]))
        time.sleep(0.3)
    return seen


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (e.g. a run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def assert_no_orphans(run_dir: Path, grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == [], f"processes of {run_dir} still alive"


def kill_job(proc: subprocess.Popen, run_dir: Path) -> None:
    """The whole job SIGKILLed at once (its machine went away): the launcher's process group,
    then whatever still names the run directory; nothing of it may be left."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in processes_mentioning(str(run_dir)):  # the workers die with their launcher
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert_no_orphans(run_dir)


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run `python -m scaletrain ARGS` as a user would; a hang fails the test via timeout."""
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


def start_local_nodes(
    num_nodes: int,
    args: list[str],
    rdzv_id: str,
    node_args: list[list[str]] | None = None,
    *,
    port: int | None = None,
    first: int = 0,
) -> list[subprocess.Popen[str]]:
    """``scaletrain run ARGS`` once per "node" on this machine, as torchrun users start one per
    host: --node-rank i and a shared c10d rendezvous on a free loopback port (node 0 hosts it).
    Nodes ``first`` .. ``num_nodes - 1`` are started; a node that joins later is started by
    another call with the same ``port`` (the returned processes' ``rdzv_port``).
    Communicate with a timeout: a hang fails the test."""
    import socket

    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scaletrain",
                "run",
                *args,
                "--node-rank",
                str(node),
                *(node_args[node] if node_args else []),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                rdzv_id,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        for node in range(first, num_nodes)
    ]
    for proc in procs:
        proc.rdzv_port = port  # type: ignore[attr-defined]
    return procs


def built_once(tmp_path_factory: Any, name: str, build: Callable[[Path], None]) -> Path:
    """A directory ``build`` fills once per test session, whichever pytest-xdist worker asks
    first (the others wait for it and reuse it): a module-scoped fixture is built again by
    every worker that runs one of its tests, and again whenever a worker comes back to the
    module after another one (xdist interleaves them), which cost the report's runs 3 builds
    of 17 s in one `make test`."""
    from filelock import FileLock  # torch's own dependency

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    path = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (shared / f"{name}.done").exists():
            shutil.rmtree(path, ignore_errors=True)  # a build that failed half-way
            path.mkdir()
            build(path)
            (shared / f"{name}.done").touch()
    return path


# A test too long for make test's budget (a 2-core machine's CPU is its limit: every
# process a test starts imports torch, about 1.3 s of a core) runs in every `make stress`
# round instead, where SCALETRAIN_STRESS_SEED is set (scripts/stress.py lists each one).
stress_only = pytest.mark.skipif(
    not os.environ.get("SCALETRAIN_STRESS_SEED"), reason="runs in make stress (make test's budget)"
)


BROWSER_MISSING = next(
    (f"{tool} is not installed (scripts/install-chromium.sh)" for tool in
     ("chromium", "chromedriver") if shutil.which(tool) is None), None)  # fmt: skip
needs_browser = pytest.mark.skipif(BROWSER_MISSING is not None, reason=str(BROWSER_MISSING))


@contextlib.contextmanager
def headless_chromium() -> Any:
    """A selenium driver of headless Chromium that keeps the browser console's log (the
    tests assert it holds no error), quit on leaving."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
