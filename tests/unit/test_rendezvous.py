"""rendezvous.py: endpoints bound to one address, and a store call that never returns ends
the node with a reason instead of a wait of many minutes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scaletrain.launch.rendezvous import UNREACHABLE_EXIT_CODE
from scaletrain.net import bound_store, interface_of, listen_socket


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interface ioctl")
def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here
    assert interface_of("not an address") is None


def test_a_store_listens_on_the_address_it_is_given_alone():
    store, listener = bound_store("127.0.0.1", 0, 10)
    assert listener.getsockname()[0] == "127.0.0.1"
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_an_address_of_another_machine_is_refused_naming_bind():
    with pytest.raises(ValueError, match="pass --bind with one of its addresses"):
        listen_socket("192.0.2.77", 0)


def test_a_store_call_that_never_returns_ends_the_node_with_a_reason():
    code = """
import time
from scaletrain.launch.rendezvous import _CallTimer, _guarded

class Stuck:  # a backend whose store never answers, like torch's client on a cut link
    name = "c10d"
    def get_state(self):
        time.sleep(60)

_guarded(Stuck(), _CallTimer("10.0.0.1:29500", limit_s=1.0)).get_state()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30)  # fmt: skip
    # The call sleeps 60 s and the run may take 30: this exit code means the timer ended it.
    assert result.returncode == UNREACHABLE_EXIT_CODE
    assert "node 0's rendezvous store at 10.0.0.1:29500 has not answered" in result.stderr


def test_the_workers_store_port_is_held_until_rank_0_listens_on_it():
    """torch's agent picks MASTER_PORT with the function register() puts in its place: the
    port stays bound (no other bind, and no outgoing connection, gets it) until the next
    pick, and rank 0's store listens on it beside that socket; a plain bind is refused."""
    import datetime
    import errno
    import socket

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

    from scaletrain.launch import rendezvous
    from scaletrain.net import bound_store

    rendezvous.register()
    port = api.get_free_port()
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with other, pytest.raises(OSError) as refused:
        other.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    store, _listener = bound_store("127.0.0.1", port, 10.0, reuse_port=True)  # the store owns it
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    client.set("k", "v")
    assert store.get("k") == b"v"
