"""The beat of a parameter-server node other than node 0 (launch/ps.py): it stops when the
node's part is over, whether node 0's store is still there, gone, or silent behind a cut
link; and a launcher whose beat cannot stop leaves without interpreter finalization.

A stress round once saw a non-head launcher abort at exit ("terminate called without an
active exception", exit -6) after the run had finished well: its beat thread, never stopped,
was still inside a store call to node 0, which was closing its store, when the interpreter
finalized."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch import leaving
from scaletrain.launch.ps import BEAT_CALL_S, PSFleet
from tests.conftest import REPO


class LinkProxy:
    """A TCP link on loopback to ``target``, which can be cut: bytes stop flowing both ways
    while every connection stays open, as when a cable is pulled (no reset, no FIN)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, name="test-proxy")]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            pump = threading.Thread(target=self._pump, args=(client, upstream),
                                    name="test-proxy-pump")  # fmt: skip
            self._threads.append(pump)
            pump.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with a, b:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                if self.cut.is_set():
                    continue  # the bytes stay in the buffers: nothing comes back
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)

    def close(self) -> None:
        """Close every connection (the peer sees them end) and stop forwarding."""
        self._stop.set()
        for t in list(self._threads):
            t.join()
        self._server.close()


def node1_fleet(tmp_path, port: int) -> PSFleet:
    cfg = with_overrides(RunConfig(), {
        "strategy": "ps", "num_servers": 1, "nnodes": "2", "nproc_per_node": 2,
        "node_rank": 1, "rdzv_endpoint": f"127.0.0.1:{port}", "timeout_s": 30.0,
    })  # fmt: skip
    return PSFleet(cfg, tmp_path)


def beats(store: TCPStore, at_least: int) -> None:
    deadline = time.monotonic() + 30
    while not (store.check(["ps/alive/1"]) and int(store.get("ps/alive/1")) >= at_least):
        assert time.monotonic() < deadline, "node 1 never beat"
        time.sleep(0.05)


def node0_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))


@pytest.fixture(autouse=True)
def no_stuck_threads(monkeypatch):
    monkeypatch.setattr(leaving, "_STUCK", [])


def test_the_beat_stops_when_the_node_is_done_with_node_0_still_there(tmp_path):
    store = node0_store()
    fleet = node1_fleet(tmp_path, store.port)
    fleet.ended(2, "finished")
    beats(store, 2)  # the first may have come before ended()
    assert store.get("ps/end/2") == b"finished"
    began = time.monotonic()
    fleet.close()
    assert time.monotonic() - began < BEAT_CALL_S  # it was between beats
    assert not fleet._beat_thread.is_alive() and not leaving.any_stuck()


def test_the_beat_stops_when_node_0_has_closed_its_store(tmp_path):
    """The stress round's case: node 0 ends the job and its store goes while node 1's beat
    is reconnecting; the reconnect is bounded, so close() sees the thread end."""
    store = node0_store()
    fleet = node1_fleet(tmp_path, store.port)
    beats(store, 1)
    del store  # node 0 is gone; its port refuses
    fleet.close()
    assert not fleet._beat_thread.is_alive() and not leaving.any_stuck()


def test_a_beat_stuck_on_a_cut_link_is_marked_and_ends_once_the_link_does(tmp_path):
    store = node0_store()
    proxy = LinkProxy(store.port)
    try:
        fleet = node1_fleet(tmp_path, proxy.port)
        beats(store, 1)
        proxy.cut.set()  # the beat's next add() waits for an answer that never comes
        deadline = time.monotonic() + 30
        while time.monotonic() - fleet._beat_ok < 3:  # it beats once a second until then
            assert time.monotonic() < deadline, "the beat went on across a cut link"
            time.sleep(0.1)
        began = time.monotonic()
        fleet.close()
        assert 2 * BEAT_CALL_S - 0.5 < time.monotonic() - began < 2 * BEAT_CALL_S + 5
        assert fleet._beat_thread.is_alive() and leaving.any_stuck()
    finally:
        proxy.close()  # the connection ends: the call returns, the thread sees stop
    fleet._beat_thread.join(3 * BEAT_CALL_S)
    assert not fleet._beat_thread.is_alive() and not leaving.any_stuck()


LEAVER = """
import atexit, socket, sys, threading
from datetime import timedelta
from torch.distributed import TCPStore
from scaletrain.cli import main
from scaletrain.launch.leaving import mark_stuck

silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
def call():
    TCPStore("127.0.0.1", silent.getsockname()[1], is_master=False,
             timeout=timedelta(seconds=5))
stuck = threading.Thread(target=call, daemon=True)
stuck.start()
connection = silent.accept()  # the call waits for a reply; its timeout does not cover that
if sys.argv[1] == "mark":
    mark_stuck(stuck)
atexit.register(lambda: print("finalized", flush=True))
sys.exit(main(["run", "--dry-run"]))
"""


@pytest.mark.parametrize("marked", [True, False])
def test_the_command_line_leaves_past_a_marked_stuck_thread(tmp_path, marked):
    """With a marked thread stuck in a store call, the CLI exits with its code and without
    finalization (no atexit handler runs); unmarked, it exits through finalization."""
    proc = subprocess.run([sys.executable, "-c", LEAVER, "mark" if marked else "no"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "strategy" in proc.stdout, proc.stdout  # the plan --dry-run prints
    assert ("finalized" in proc.stdout) is not marked, proc.stdout[-500:]
