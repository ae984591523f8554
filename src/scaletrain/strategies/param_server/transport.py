"""Worker <-> server links of the parameter server: one gloo process group of two ranks per
connection (rank 0 the server, rank 1 the worker), point-to-point send/recv.

Why gloo pairs and not torch.distributed.rpc. Measured with benchmarks/ps_transport.py (2
cores, loopback; push-and-pull round trip of a float32 slice, 50 repetitions):

    slice      gloo pair   rpc_sync
    0.004 MB     0.71 ms    0.77 ms
    1 MB         3.79 ms    1.81 ms
    16 MB       24.5 ms    13.5 ms

RPC is about twice as fast for large slices on one host (TensorPipe picks shared memory
there; across hosts both are TCP). We chose gloo pairs anyway, for what the parameter server
has to survive:
- Failure isolation. A dead worker or server breaks only its own pairs: the peer's pending
  recv fails at once with "Connection closed by peer", and every other pair keeps working,
  so the others continue without a restart, as asp/ssp promise.
- Rejoining. A restarted process builds new pairs under a new store prefix (its attempt
  number) and is served at once. A static RPC world cannot take a rank back: in the same
  benchmark a restarted rank 1 calling init_rpc again is refused ("Gloo connectFullMesh
  failed"); RPC's dynamic membership needs graceful leaves, which a SIGKILL never gives.
- Trust. A pair carries raw tensors of sizes both sides fixed in advance. RPC unpickles the
  Python calls any peer sends: whoever can connect can run code on a server.
At the digits CNN's slice size (0.3 MB) a round trip is about 1.5 ms either way, small
beside a step's compute.

Every message is a fixed-size int64 header, then payload tensors of sizes both sides know
(the server's parameter slice; server 0 adds the worker's next lease). Tags keep the tensors
of one message apart. A link is only ever used by one thread on each side.

A peer that dies with a message half sent or half received. Gloo fails a pending send or
recv at once when its peer's connection closes, except the one message whose bytes were on
the wire: that op waits out the whole link timeout (--timeout-s, 300 s by default), measured
with a 200 MB message on loopback whose sender (or receiver) was SIGKILLed mid-way, and
``ProcessGroupGloo.abort()`` from another thread does not release it. A stress round hit it
when a killed server was sending a reply: the worker sat in that recv while ssp held every
other worker behind it. So the launcher, which sees every death at once, publishes it in the
store (``death_key``), and a link given its peer's rank and attempt waits in a thread of its
own while the caller checks that key every WATCH_S: a peer known dead fails the op with
PeerDied within WATCH_S, whatever state gloo is in. The abandoned wait ends at the link
timeout; the link is never used again.
"""

from __future__ import annotations

import datetime
import os
import queue
import struct
import threading
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.strategies.param_server.keys import death as death_key

HEADER = 10
# How often a wait on a link checks whether its peer is known dead.
WATCH_S = 0.5


class LinkError(RuntimeError):
    """An op on a link failed: the peer is gone, the connection broke or timed out. What
    else fails near a link (decoding what came, applying it) is not one: a caller that
    survives a lost peer must not survive its own bugs the same way."""


class PeerDied(LinkError):
    """The link's peer process is dead (the launcher said so) while an op on it was pending."""


class Kind(IntEnum):
    """What a worker sends."""

    HELLO = 1  # join (or rejoin): reply with the parameters (server 0: and a lease)
    PUSH = 2  # a gradient: apply it (per the consistency mode), reply as HELLO
    DONE = 3  # leaving at the end of the run: no reply


class Status(IntEnum):
    """What a server replies."""

    OK = 0
    DROPPED = 1  # bsp: the barrier went on without you; join again
    END = 2  # server 0: no more data, the run is over


# Worker -> server header fields. CLOCK: the worker's ssp clock, its pushes in the job
# (including this one); in a HELLO the clock it has, or -1 when it has none yet (see
# consistency.join_clock).
KIND, STEP, VERSION_ON, NUM_SAMPLES, WORKER, ATTEMPT, CLOCK = range(7)
# Server -> worker header fields. LR_FACTOR: the factor of --lr the server applied this push
# with (the schedule's, the staleness rule's), the float64's bits as an int64 (float_bits:
# exact; millionths, as it was, made the recorded lr of a push 10 updates stale differ from
# the applied one by 5 parts in a million). REPLY_CLOCK: the clock the server holds the
# worker by (a new worker learns its own from server 0's reply to HELLO).
(STATUS, VERSION, STALENESS, HELD_US, LEASE_LEN, LEASE_EPOCH, LEASE_STEP, COMMITTED, LR_FACTOR,
 REPLY_CLOCK) = range(10)  # fmt: skip


def float_bits(value: float) -> int:
    """A float64 as the int64 of the same bits (a header field holds it exactly)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def header(**fields: int) -> torch.Tensor:
    names = {
        "kind": KIND, "step": STEP, "version_on": VERSION_ON, "num_samples": NUM_SAMPLES,
        "worker": WORKER, "attempt": ATTEMPT, "clock": CLOCK,
    }  # fmt: skip
    t = torch.zeros(HEADER, dtype=torch.int64)
    for name, value in fields.items():
        t[names[name]] = int(value)
    return t


def reply_header(**fields: int) -> torch.Tensor:
    names = {
        "status": STATUS, "version": VERSION, "staleness": STALENESS, "held_us": HELD_US,
        "lease_len": LEASE_LEN, "lease_epoch": LEASE_EPOCH, "lease_step": LEASE_STEP,
        "committed": COMMITTED, "lr_factor": LR_FACTOR, "clock": REPLY_CLOCK,
    }  # fmt: skip
    t = torch.zeros(HEADER, dtype=torch.int64)
    for name, value in fields.items():
        t[names[name]] = int(value)
    return t


def gloo_device() -> object:
    """The interface gloo binds to: GLOO_SOCKET_IFNAME as torch's own groups use it, else the
    address the hostname resolves to."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_default_device()


class Link:
    """One worker-server connection. Constructing it blocks until both ends have joined
    (or ``timeout`` passes); each op raises RuntimeError when the peer is gone. ``peer``:
    the (rank, attempt) of the process at the other end, to fail fast when it dies
    mid-message (see the module's notes); without it waits are gloo's own."""

    def __init__(
        self, store: dist.Store, prefix: str, *, server_side: bool, timeout_s: float,
        peer: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [gloo_device()]
        self.rank = 0 if server_side else 1
        self.peer = 1 - self.rank
        self.store = store
        self.peer_key = death_key(*peer) if peer is not None else None
        self.broken: str | None = None  # why the link is dead for good (PeerDied)
        self._jobs: queue.SimpleQueue[_Wait | None] | None = None
        self.pg = self._connect(dist.PrefixStore(prefix, store), opts)

    def _connect(self, store: dist.Store, opts: Any) -> Any:
        """The two-rank gloo group; with ``peer`` known, PeerDied as soon as the launcher
        says the peer is dead. A server that died after admitting a worker, before its end
        of the link existed, held that worker here for the whole link timeout, and with it
        the lease it held (32 workers, a server killed at its 10th update: 600 s)."""
        if self.peer_key is None:
            try:
                return dist.ProcessGroupGloo(store, self.rank, 2, opts)
            except RuntimeError as e:
                raise LinkError(str(e)) from e
        made: dict[str, Any] = {}

        def connect() -> None:
            try:
                made["pg"] = dist.ProcessGroupGloo(store, self.rank, 2, opts)
            except BaseException as e:  # handed to the caller, which raises it
                made["error"] = e

        # The notice is read over a connection of its own: a store client runs one call at a
        # time, and gloo's set-up blocks in a wait on the link's until the peer is there.
        link_store: Any = self.store  # a TCPStore client (the launcher's store)
        watch = dist.TCPStore(link_store.host, link_store.port, is_master=False,
                              timeout=opts._timeout)  # fmt: skip
        thread = threading.Thread(target=connect, daemon=True, name="scaletrain-link-connect")
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_S)
            if thread.is_alive() and watch.check([self.peer_key]):
                cause = watch.get(self.peer_key).decode()
                self.broken = f"the peer process died ({cause}) before the link was made"
                raise PeerDied(self.broken)
        if "error" in made:
            error = made["error"]
            if isinstance(error, RuntimeError):
                raise LinkError(str(error)) from error
            raise error
        return made["pg"]

    # A message's tensors go with tags 0 (the header), 1 (the payload), 2 (server 0's lease),
    # so a receiver may take the header first and decide whether a payload follows.
    def isend(self, *tensors: torch.Tensor, first_tag: int = 0) -> list[dist.Work]:
        self._check()
        send = self.pg.send  # type: ignore[attr-defined]  # the C++ group's own send
        try:
            return [send([t], self.peer, first_tag + i) for i, t in enumerate(tensors)]
        except RuntimeError as e:
            raise LinkError(str(e)) from e

    def irecv(self, *tensors: torch.Tensor, first_tag: int = 0) -> list[dist.Work]:
        self._check()
        recv = self.pg.recv  # type: ignore[attr-defined]
        try:
            return [recv([t], self.peer, first_tag + i) for i, t in enumerate(tensors)]
        except RuntimeError as e:
            raise LinkError(str(e)) from e

    def send(self, *tensors: torch.Tensor, first_tag: int = 0) -> None:
        self.wait(self.isend(*tensors, first_tag=first_tag))

    def recv(self, *tensors: torch.Tensor, first_tag: int = 0) -> None:
        self.wait(self.irecv(*tensors, first_tag=first_tag))

    def wait(self, works: Sequence[dist.Work]) -> None:
        """Until every op in ``works`` is done; raises as the op does, or PeerDied once the
        launcher has said the peer is dead."""
        if self.peer_key is None:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as e:
                raise LinkError(str(e)) from e
            return
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_waiter, args=(self._jobs,), daemon=True,
                             name="scaletrain-link-wait").start()  # fmt: skip
        job = _Wait(works)
        self._jobs.put(job)
        while not job.done.wait(WATCH_S):
            if self.store.check([self.peer_key]):
                cause = self.store.get(self.peer_key).decode()
                self.broken = f"the peer process died ({cause}) with an operation pending"
                raise PeerDied(self.broken)
        if isinstance(job.error, RuntimeError):
            raise LinkError(str(job.error)) from job.error
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """Let the waiting thread go (at once when idle; an abandoned wait ends at the
        link timeout)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    def _check(self) -> None:
        if self.broken:
            raise PeerDied(self.broken)


class _Wait:
    def __init__(self, works: Sequence[dist.Work]) -> None:
        self.works, self.done = works, threading.Event()
        self.error: BaseException | None = None


def _waiter(jobs: queue.SimpleQueue[_Wait | None]) -> None:
    """A link's waiting thread: one job at a time, until told to stop (None)."""
    while (job := jobs.get()) is not None:
        try:
            for work in job.works:
                work.wait()
        except BaseException as e:  # handed to the caller, which raises it
            job.error = e
        job.done.set()
