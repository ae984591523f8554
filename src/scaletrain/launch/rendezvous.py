"""torch's c10d rendezvous, with two changes, registered as the ``scaletrain`` backend of the
elastic agent (launch.py uses it for every node).

1. **Node 0's store listens on one address.** torch's rendezvous store binds every interface
   whatever host it is given (measured with ``ss``); here it is handed a socket bound to the
   node's bind address (``--bind``; by default the address of ``--rdzv-endpoint``, the one
   every node connects to). ``--bind 0.0.0.0`` asks for every interface.
2. **A store that stops answering ends this node, with a reason.** After a ``wait`` times
   out, torch's TCPStore client blocks in ``recv()`` with no timeout (measured: a node whose
   cable was cut sat in the rendezvous for over 200 s; the kernel gives up only after about
   15 minutes of retransmissions). Each call to the rendezvous state is timed by a thread
   here; one still running ``read_timeout`` + ``GRACE_S`` seconds later stops this node with
   exit code ``UNREACHABLE_EXIT_CODE`` and a message saying node 0 cannot be reached. Its
   workers die with it (runtime.die_with_parent).

3. **Workers learn the round.** Every world the agents form is a new round of the rendezvous,
   the same number on every node. The agent's own restart count is not: it counts this node's
   failures only, so a world that grew (a node joined late) or a node that joined after
   others had failed would reuse or mix numbers. The round is put in the agent's environment
   as ``$SCALETRAIN_ATTEMPT`` before it starts the workers, which inherit it: it is the
   ``attempt`` of metrics.jsonl, incidents and recoveries.

Everything else (keep-alives, last call, elastic membership) is torch's own
``DynamicRendezvousHandler`` over torch's ``C10dRendezvousBackend``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

from scaletrain import env
from scaletrain.net import bound_store

BACKEND_NAME = "scaletrain"
GRACE_S = 5.0
UNREACHABLE_EXIT_CODE = 69  # EX_UNAVAILABLE
_LISTENERS: list[socket.socket] = []
_TIMERS: list[_CallTimer] = []


class _CallTimer:
    """Watches the calls in flight; one that outlives ``limit_s`` ends the process."""

    def __init__(self, endpoint: str, limit_s: float) -> None:
        self.endpoint, self.limit_s = endpoint, limit_s
        self._since: dict[int, float] = {}  # thread id -> start of its call
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, daemon=True, name="scaletrain-rdzv-timer"
        )
        self._thread.start()
        _TIMERS.append(self)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def begin(self) -> None:
        with self._lock:
            self._since[threading.get_ident()] = time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._since.pop(threading.get_ident(), None)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                oldest = min(self._since.values(), default=None)
            if oldest is not None and time.monotonic() - oldest > self.limit_s:
                sys.stderr.write(
                    f"scaletrain: error: node 0's rendezvous store at {self.endpoint} has not "
                    f"answered for {self.limit_s:.0f} s: this node lost its network to node 0, "
                    "or node 0 is gone. Stopping this node and its workers.\n"
                )
                sys.stderr.flush()
                os._exit(UNREACHABLE_EXIT_CODE)


def _guarded(backend: Any, timer: _CallTimer) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class GuardedBackend(RendezvousBackend):
        @property
        def name(self) -> str:  # the agent checks it against the name it asked for
            return BACKEND_NAME

        def get_state(self) -> Any:
            timer.begin()
            try:
                return backend.get_state()
            finally:
                timer.end()

        def set_state(self, state: bytes, token: Any = None) -> Any:
            timer.begin()
            try:
                return backend.set_state(state, token)
            finally:
                timer.end()

    return GuardedBackend()


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
        create_backend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    read_timeout = int(params.get_as_int("read_timeout", 60) or 60)
    if params.get_as_bool("is_host"):
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
        bind = params.get("bind") or host
        store, listener = bound_store(bind, port, read_timeout, multi_tenant=True)
        _LISTENERS.append(listener)  # the store listens on it as long as this agent runs
        backend: Any = C10dRendezvousBackend(store, params.run_id)
    else:
        backend, store = create_backend(params)
    timer = _CallTimer(params.endpoint, read_timeout + GRACE_S)
    return _announcing_rounds(create_handler(store, _guarded(backend, timer), params))


def _announcing_rounds(handler: Any) -> Any:
    """``handler``, whose ``next_rendezvous`` also sets $SCALETRAIN_ATTEMPT to the round it
    joined (see the module's docstring). Where a torch version keeps the round elsewhere,
    the variable is left unset and workers fall back to the agent's restart count."""
    join = handler.next_rendezvous

    def next_rendezvous() -> Any:
        info = join()
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        joined = getattr(state, "round", None)
        if isinstance(joined, int):
            # The round of this job run; workers add the job run's first attempt (jobs.py).
            os.environ[env.ATTEMPT] = str(joined)
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def release() -> None:
    """After the agent is done (the job ended, well or not): stop the call timers, so that an
    in-process launch (the Python API, the tests) leaves no thread behind. The listening
    sockets stay: the store serving on one may outlive the handler (torch caches
    multi-tenant stores), and closing a descriptor under it broke the next launch in the
    same process ("Bad file descriptor")."""
    while _TIMERS:
        _TIMERS.pop().close()
    # Not inherited by the processes of a later launch in this process (an in-place run's).
    os.environ.pop(env.ATTEMPT, None)


def register() -> None:
    """Make ``rdzv_backend="scaletrain"`` known to the agent (in this process), and the
    port it picks for the workers' store one that nobody else can take meanwhile."""
    from torch.distributed.elastic.rendezvous import api, rendezvous_handler_registry

    from scaletrain.net import reserved_port

    rendezvous_handler_registry.register(BACKEND_NAME, _create_handler)  # idempotent
    # The workers' store port (MASTER_PORT), held until rank 0 listens on it.
    api.get_free_port = reserved_port
