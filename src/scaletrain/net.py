"""Sockets and stores bound to one address.

torch's TCPStore listens on every interface whatever host it is given; scaletrain's endpoints
listen on one address (--bind; by default the one the other nodes use), so a job never opens
a port on a network it was not asked to use. Also: which interface holds an address (for
GLOO_SOCKET_IFNAME) and which address of this machine routes to another.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any


def interface_of(addr: str) -> str | None:
    """The network interface holding the IPv4 address ``addr`` (Linux), or None."""
    import fcntl
    import struct

    try:
        packed = socket.inet_aton(addr)
    except OSError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
            except OSError:  # no IPv4 address on it
                continue
            if reply[20:24] == packed:
                return name
    return None


# The port reserved_port handed out last, held bound until the next call.
_RESERVED: list[socket.socket] = []


def reserved_port() -> int:
    """A free port that no other process can take until the next call: a socket bound to it
    on every IPv4 address, never listening, kept open. torch's agent picks the port of the
    workers' store (MASTER_PORT) by binding port 0 and closing the socket, and rank 0 binds
    it moments later: in between another process can take it (a make test run lost a job
    to that: rank 0 "Address already in use", rank 1 connected to whatever listened
    there). The kernel hands out neither for bind(0) nor for an outgoing connection a port
    that a socket is bound to; rank 0 binds it beside this one with SO_REUSEPORT
    (worker_store), which only processes of this user may do."""
    held = holding_socket()
    while _RESERVED:  # the last one's store is gone: its workers were stopped
        _RESERVED.pop().close()
    _RESERVED.append(held)
    return int(held.getsockname()[1])


def holding_socket() -> socket.socket:
    """A socket bound to a free port on every IPv4 address, never listening: while it is
    open, no other process gets that port (reserved_port says why); a store binds it beside
    this one with SO_REUSEPORT. The caller keeps it, and closes it when the port's user is
    gone."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("0.0.0.0", 0))
    return held


def listen_socket(addr: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``addr``:``port`` (IPv4 or IPv6 by the address), or a
    ValueError that names --bind. ``reuse_port``: the port is one reserved_port holds."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"bind: cannot resolve {addr!r}: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port and hasattr(socket, "SO_REUSEPORT"):
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        listener.bind(sockaddr)
    except OSError as e:
        listener.close()
        raise ValueError(
            f"bind: cannot listen on {addr}:{port}: {e.strerror} (is {addr} an address of this "
            "machine? pass --bind with one of its addresses, or --bind 0.0.0.0 for all)"
        ) from None
    listener.listen(1024)
    return listener


def bound_store(
    addr: str, port: int, timeout_s: float, *, multi_tenant: bool = False, reuse_port: bool = False
) -> tuple[Any, socket.socket]:
    """A TCPStore server listening on ``addr`` alone. torch's TCPStore listens on every
    interface whatever host it is given; handed a bound socket it listens there. Keep the
    socket referenced as long as the store."""
    import torch.distributed as dist

    listener = listen_socket(addr, port, reuse_port=reuse_port)
    store = dist.TCPStore(
        addr, listener.getsockname()[1], is_master=True, wait_for_workers=False,
        multi_tenant=multi_tenant, timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.fileno(),
    )  # fmt: skip
    return store, listener


def loopback_store(timeout_s: float = 300.0) -> tuple[Any, socket.socket]:
    """A TCPStore server that only this machine can reach (bound_store on
    127.0.0.1, a free port). Keep the socket referenced as long as the store."""
    return bound_store("127.0.0.1", 0, timeout_s)


def url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
