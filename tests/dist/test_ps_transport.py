"""A parameter-server link whose peer process is SIGKILLed with a message half across.

Gloo fails a pending op at once when its peer's connection closes, except the one whose bytes
were on the wire: that one waits out the whole link timeout. A link told its peer's rank and
attempt fails it with PeerDied as soon as the launcher's death notice (transport.death_key)
is in the store. Here this process holds one end of a real gloo link on loopback, a child
process the other, and a thread plays the launcher: it sets the notice once the child is
dead. Without the notice the op raises gloo's timeout error after LINK_TIMEOUT_S instead.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from scaletrain.strategies.param_server import transport as wire
from tests.conftest import REPO

# 128 MB: far more than loopback's socket buffers (a few MB) hold.
NUMEL = 32 * 1024 * 1024
LINK_TIMEOUT_S = 8.0  # the abandoned wait ends then, before the test's thread check
PEER = (4, 0)  # the rank and attempt the child plays


def store_here() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=60))  # fmt: skip


RECEIVER = """
import datetime, sys
import torch
from torch.distributed import TCPStore
from scaletrain.strategies.param_server import transport as wire

store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                 timeout=datetime.timedelta(seconds=60))
link = wire.Link(store, "link", server_side=True, timeout_s=60)
big = link.irecv(torch.zeros(int(sys.argv[2])), first_tag=1)
link.send(torch.zeros(1))  # after the big recv's notice: once this is there, so is that
big[0].wait()  # never: the test stops this process, then kills it
"""


def test_a_send_whose_receiver_dies_mid_message_fails_with_peer_died():
    store = store_here()
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(store.port), str(NUMEL)],
                             cwd=REPO, stdin=subprocess.DEVNULL)  # fmt: skip
    link = wire.Link(store, "link", server_side=False, timeout_s=LINK_TIMEOUT_S, peer=PEER)
    link.recv(torch.zeros(1))  # the child's big recv is posted
    # Stopped, the child reads nothing more: the send fills the socket buffers and the
    # rest of its 128 MB stays here, so the child dies with the message half across.
    os.kill(child.pid, signal.SIGSTOP)
    works = link.isend(torch.ones(NUMEL), first_tag=1)

    def launcher() -> None:  # sees the death, then publishes it, as launch/ps.py does
        code = child.wait(timeout=120)
        store.set(wire.death_key(*PEER), f"exit code {code}")

    watcher = threading.Thread(target=launcher, name="launcher")
    watcher.start()
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(wire.PeerDied, match="died"):
        link.wait(works)
    watcher.join()
    link.close()
    assert child.returncode == -signal.SIGKILL
    with pytest.raises(wire.PeerDied):  # the link is dead for good
        link.isend(torch.zeros(1))


def test_a_link_whose_peer_died_before_making_its_end_fails_with_peer_died():
    """A server admitted a worker and died before its end of the link existed: the worker's
    link fails at the launcher's notice, not after the link timeout (it held that worker,
    and the lease it held, for 600 s in make scale's 32-process run with a server killed)."""
    store = store_here()
    link_store = TCPStore("127.0.0.1", store.port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip

    def launcher() -> None:  # the notice comes while the link is being made
        while not any(t.name == "scaletrain-link-connect" for t in threading.enumerate()):
            threading.Event().wait(0.01)
        store.set(wire.death_key(*PEER), "killed by SIGKILL")

    notice = threading.Thread(target=launcher, name="launcher")
    notice.start()
    started = time.monotonic()
    with pytest.raises(wire.PeerDied, match="before the link was made"):
        wire.Link(link_store, "link", server_side=False, timeout_s=LINK_TIMEOUT_S, peer=PEER)
    # At the notice, not at the link's timeout (a check over the link's own store client
    # queued behind gloo's set-up, which waits there for the peer until that timeout).
    assert time.monotonic() - started < LINK_TIMEOUT_S / 2
    notice.join()


def test_a_live_peer_that_answers_late_is_waited_for():
    # The notice is for another attempt of the same rank: this peer is alive and answers
    # after several checks of the store.
    store = store_here()
    store.set(wire.death_key(PEER[0], PEER[1] + 1), "killed by SIGKILL")
    late = """
import datetime, sys, time
import torch
from torch.distributed import TCPStore
from scaletrain.strategies.param_server import transport as wire
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                 timeout=datetime.timedelta(seconds=60))
link = wire.Link(store, "link", server_side=True, timeout_s=60)
link.recv(torch.zeros(1))
time.sleep(3 * wire.WATCH_S)  # only to make the other end check the store a few times
link.send(torch.full((4,), 7.0))
"""
    child = subprocess.Popen([sys.executable, "-c", late, str(store.port)], cwd=REPO,
                             stdin=subprocess.DEVNULL)  # fmt: skip
    link = wire.Link(store, "link", server_side=False, timeout_s=60, peer=PEER)
    out = torch.zeros(4)
    works = link.irecv(out)
    link.send(torch.zeros(1))
    link.wait(works)
    assert out.tolist() == [7.0] * 4
    link.close()
    assert child.wait(timeout=60) == 0


def test_the_launcher_publishes_each_death_under_the_key_the_links_watch(tmp_path):
    from scaletrain.config import from_dict
    from scaletrain.launch.ps import PSFleet

    (tmp_path / "logs").mkdir()
    cfg = from_dict({"train": {"strategy": "ps"}, "ps": {"num_servers": 1},
                     "launch": {"nproc_per_node": 3, "max_restarts": 0}})  # fmt: skip
    fleet = PSFleet(cfg, tmp_path)
    fleet._died(2, -signal.SIGKILL)  # the server, rank 2, in its first attempt
    assert fleet.store.get(wire.death_key(2, 0)) == b"killed by SIGKILL"
    assert not fleet.store.check([wire.death_key(2, 1)])
