"""Replicated slices (--ps-replicas 1): every server's slice has a backup on the next server
process, which applies every update the primary applies before any worker hears of it.

Server k is the primary of slice k and the backup of slice k-1 (mod the servers). Each pair
has a link of its own (transport.Link, the primary at rank 0), set up through the store: the
primary publishes its process attempt at ``primary_key(k)``, the backup at ``backup_key(k)``,
and a link's prefix names both, so a restarted process on either side meets its partner on a
fresh link. On that link:

1. The primary says whether it needs the slice (SYNC). A restarted primary does: the backup
   sends its replica (STATE) and the primary goes on from it, nothing lost. A primary that
   has its state sends it whole instead (STATE): a backup that started late, or was
   restarted, copies the slice before it takes updates.
2. Then every reply a primary sends to a worker is preceded by a FORWARD of what changed
   since the last one (the gradients it applied, each with the factor of --lr it applied it
   with, and its bookkeeping: versions, each worker's last applied push, server 0's leases
   and data plan), and the backup's ACK. The backup applies the same gradients with the same
   optimizer, so the two copies are equal bit for bit.

What is guaranteed: a push a worker saw acknowledged is on both copies of every slice, under
every consistency rule. When a primary dies, the push it was applying when it died reached
neither the worker nor (if the forward did not end) the backup: the worker sends it again
to the restarted primary, which applies it once (a push carries the worker's process attempt
and clock, or under bsp its step, and a server records the last one it applied from each
worker: ``Applied``). A backup's death costs nothing: the primary goes on without a backup
until the restarted process has copied the slice again. Both processes of a pair dead
together fall back to the primary's checkpoint, as without replicas.

Two failovers. A dead server that its launcher restarts (within a fraction of a second, on
its own host) takes its slice from the backup instead of from its checkpoint. A server lost
for good (no restart left, its host gone) is taken over: the launcher sets ``promote_key``,
and the backup's process serves the slice itself from its copy (server.py's ``_promote``)
under a new incarnation, naming itself as the host (``ps/serverK.INC/host``) so that the
workers hear of its own death; they join it as after a restart. A taken-over slice has no
backup left: if its new host dies too, the job fails and says so.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.fault.internal import guarded
from scaletrain.schedule import scale_lr
from scaletrain.strategies.param_server import transport as wire
from scaletrain.strategies.param_server.keys import backup as backup_key
from scaletrain.strategies.param_server.keys import primary as primary_key
from scaletrain.strategies.param_server.keys import promote as promote_key
from scaletrain.strategies.param_server.keys import replica_link as link_prefix
from scaletrain.strategies.param_server.keys import stale as stale_key

log = logging.getLogger("scaletrain.ps.replica")

SYNC, STATE, FORWARD, ACK = 1, 2, 3, 4
# The incarnation of a slice served by its backup's process after its primary was lost for
# good: above any restart's attempt.
PROMOTED = 1000
# A replication thread whose connection to the job's store fails ends (the server's own
# calls fail the same way); any other error in it is a bug, which ends the process.
STORE_LOST = (wire.LinkError, dist.DistError)


def backup_of(k: int, num_servers: int) -> int:
    """The server holding the backup of slice ``k``."""
    return (k + 1) % num_servers


def backed_up_by(k: int, num_servers: int) -> int:
    """The slice whose backup server ``k`` holds (``backup_of``'s inverse)."""
    return (k - 1) % num_servers


def to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def _header(*values: int) -> torch.Tensor:
    t = torch.zeros(wire.HEADER, dtype=torch.int64)
    t[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return t


def _send_blob(link: wire.Link, data: torch.Tensor | None, tag: int) -> None:
    """A payload of a size the receiver does not know: its length, then its bytes."""
    link.send(_header(STATE, 0 if data is None else data.numel()), first_tag=tag)
    if data is not None and data.numel():
        link.send(data, first_tag=tag + 1)


def _recv_blob(link: wire.Link, tag: int) -> torch.Tensor | None:
    head = torch.zeros(wire.HEADER, dtype=torch.int64)
    link.recv(head, first_tag=tag)
    if int(head[0]) != STATE:
        raise RuntimeError(f"replica link: expected a state, got message kind {int(head[0])}")
    size = int(head[1])
    if not size:
        return None
    data = torch.empty(size, dtype=torch.uint8)
    link.recv(data, first_tag=tag + 1)
    return data


@dataclass
class Applied:
    """What a slice's copies agree on besides the numbers: how many updates, and each
    worker's last push applied (a worker sends a push again when its server died with it
    unanswered; the restarted server applies it only if this says it is new)."""

    version: int = 0
    released_step: int = 0
    applied: int = 0
    # asp, ssp: worker -> (process attempt, clock of its last push applied)
    clocks: dict[int, tuple[int, int]] = field(default_factory=dict)
    # bsp: worker -> (process attempt, the last step its push was applied in)
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    # server 0: its data plan (DataCoordinator.snapshot), each worker's lease as its reply
    # carried it ([epoch, step, positions], or None: the end) and the attempt holding it
    coordinator: dict[str, Any] | None = None
    leases: dict[int, list[Any] | None] = field(default_factory=dict)
    sessions: dict[int, int] = field(default_factory=dict)
    # server 0: the ledger lines of the updates this forward carries (written once the
    # backup holds them; a restored server 0 writes those its primary did not)
    ledger: list[dict[str, Any]] = field(default_factory=list)

    def encode(self) -> torch.Tensor:
        text = json.dumps({
            "version": self.version, "released_step": self.released_step,
            "applied": self.applied,
            "clocks": {str(w): list(v) for w, v in self.clocks.items()},
            "steps": {str(w): list(v) for w, v in self.steps.items()},
            "coordinator": self.coordinator,
            "leases": {str(w): v for w, v in self.leases.items()},
            "sessions": {str(w): v for w, v in self.sessions.items()},
            "ledger": self.ledger,
        })  # fmt: skip
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Applied:
        d = json.loads(data.numpy().tobytes().decode())
        return cls(
            version=d["version"], released_step=d["released_step"], applied=d["applied"],
            clocks={int(w): (a, c) for w, (a, c) in d["clocks"].items()},
            steps={int(w): (a, s) for w, (a, s) in d["steps"].items()},
            coordinator=d["coordinator"],
            leases={int(w): v for w, v in d["leases"].items()},
            sessions={int(w): v for w, v in d["sessions"].items()},
            ledger=d["ledger"],
        )  # fmt: skip


class Primary:
    """The primary's end of its slice's replication: ``forward`` (lock held, before every
    reply) sends the backup what changed and waits for its ACK. Without a backup (dead, or
    not connected yet) the primary goes on alone; a thread connects the next backup process
    and sends it the whole state (``full_state``, taken under the server's lock)."""

    def __init__(
        self, *, index: int, num_servers: int, num_workers: int, attempt: int, store: Any,
        new_store: Callable[[], Any], timeout_s: float, lock: threading.Condition,
        full_state: Callable[[], dict[str, Any]], stop: threading.Event,
        on_synced: Callable[[int], None], before_copy: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        """``on_synced(backup_attempt)``: a backup process holds the whole slice (again).
        ``before_copy``: called (lock held) as a copy of the whole slice begins."""
        self.index, self.attempt = index, attempt
        self.on_synced, self.before_copy = on_synced, before_copy
        self.backup = backup_of(index, num_servers)
        self.backup_rank = num_workers + self.backup
        self.store, self.new_store, self.timeout_s = store, new_store, timeout_s
        self.lock, self.full_state, self.stop = lock, full_state, stop
        self.link: wire.Link | None = None
        self.unsynced: wire.Link | None = None  # a link whose backup waits for the state
        self.linked: str | None = None  # the backup's process attempt at the link's end
        self.sent = torch.empty(0, dtype=torch.uint8)  # the bookkeeping last forwarded
        self.pending: list[tuple[torch.Tensor, float]] = []
        self.forwards = 0
        self.forward_s = 0.0  # time spent forwarding (in the workers' round trips)
        store.set(primary_key(index), str(attempt))

    def break_link(self) -> None:
        """Lock held: drop the link as a network fault would (--inject break-backup-link):
        its sockets close, the backup's wait fails, and a new link is made."""
        if self.link is not None:
            self.link.close()
            self.link.pg = None  # the group's destructor closes its connections
            self.link = None
            self.lock.notify_all()

    def take_state(self) -> dict[str, Any] | None:
        """A restarted primary, before it serves: its slice from the backup (None: the
        backup holds no copy, or did not answer within --timeout-s). The link stays up: it
        carries the forwards, or, when the backup had nothing, the state the primary
        restores from its checkpoint (``start``)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            link = self._connect(deadline)
            if link is None:
                return None
            try:
                link.send(_header(SYNC, 1))
                data = _recv_blob(link, 0)
            except wire.LinkError as e:
                log.warning("slice %d: backup lost while sending it: %s", self.index, e)
                link.close()
                continue
            if data is None:
                self.unsynced = link  # the backup waits for this primary's state
                return None
            self.link = link
            self.on_synced(int((self.linked or "-1").split(".")[0]))
            return cast(dict[str, Any], from_bytes(data))
        return None

    def start(self) -> None:
        """Keep a backup: connect one (now, or when the current one dies) in a thread."""
        body = guarded(
            self._keep_backup,
            f"the replication of slice {self.index} (primary)",
            stop=self.stop,
            expected=STORE_LOST,
        )
        threading.Thread(target=body, daemon=True,
                         name=f"replica-primary{self.index}").start()  # fmt: skip

    def applied(self, grad: torch.Tensor, factor: float) -> None:
        """Lock held: an update was applied; forwarded with the next reply."""
        if self.link is not None:
            self.pending.append((grad.detach().clone(), factor))

    def forward(self, bookkeeping: Applied) -> None:
        """Lock held, before a reply: the backup applies what changed and acknowledges."""
        link = self.link
        if link is None:
            self.pending = []
            return
        updates, self.pending = self.pending, []
        meta = bookkeeping.encode()
        if not updates and torch.equal(meta, self.sent):
            return  # nothing changed since the last forward (bsp: a step's other replies)
        began = time.perf_counter()
        try:
            link.send(_header(FORWARD, len(updates), meta.numel()))
            if updates:
                factors = torch.tensor([f for _, f in updates], dtype=torch.float64)
                link.send(factors, *(g for g, _ in updates), meta, first_tag=1)
            else:
                link.send(meta, first_tag=1)
            ack = torch.zeros(wire.HEADER, dtype=torch.int64)
            link.recv(ack)
        except RuntimeError as e:
            log.warning("slice %d: backup lost (%s); going on without one until its server "
                        "is back", self.index, str(e).splitlines()[0][:160])  # fmt: skip
            link.close()
            self.link = None
            self.lock.notify_all()  # _keep_backup connects the next one (not that process)
            return
        self.sent = meta
        self.forwards += 1
        self.forward_s += time.perf_counter() - began

    def _keep_backup(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                self.lock.wait_for(lambda: self.link is None or self.stop.is_set())
            if self.stop.is_set():
                return
            link, asked = (self.unsynced, True) if self.unsynced else (self._connect(None), False)
            self.unsynced = None
            if link is None:
                continue
            with self.lock:  # the whole state, then the forwards: nothing between
                self.before_copy()
                try:
                    if not asked:
                        link.send(_header(SYNC, 0))
                    _send_blob(link, to_bytes(self.full_state()), 0)
                    # Held once the backup has loaded it (a sent copy can die in a buffer).
                    link.recv(torch.zeros(wire.HEADER, dtype=torch.int64))
                except wire.LinkError as e:
                    log.warning("slice %d: backup lost during its copy: %s", self.index, e)
                    link.close()
                    continue
                self.link, self.pending = link, []
                self.sent = torch.empty(0, dtype=torch.uint8)
            log.info("slice %d: backup on server %d holds it", self.index, self.backup)
            self.on_synced(int((self.linked or "-1").split(".")[0]))

    def _connect(self, deadline: float | None) -> wire.Link | None:
        """A link to the backup that is up now: not the one whose link failed (its process
        is dead, or it names itself anew, ATTEMPT.GEN, to link again); None when
        ``deadline`` passes or the server stops."""
        tried = self.linked
        while not self.stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return None
            value = self.store.get(backup_key(self.index)).decode() \
                if self.store.check([backup_key(self.index)]) else None  # fmt: skip
            if value is None or value == tried:
                time.sleep(0.02)
                continue
            tried = value
            peer = (self.backup_rank, int(value.split(".")[0]))
            if self.store.check([wire.death_key(*peer)]):
                continue
            try:
                link = wire.Link(self.new_store(), link_prefix(self.index, self.attempt, value),
                               server_side=True, timeout_s=self.timeout_s, peer=peer)  # fmt: skip
                self.linked = value
                return link
            except wire.LinkError as e:
                log.warning("slice %d: no link to backup attempt %s: %s", self.index, value, e)
        return None


class Backup:
    """This server's copy of the previous server's slice (its primary), kept by a thread:
    it connects to each primary process in turn, copies or gives the slice at the start of
    each link, then applies the primary's forwards."""

    def __init__(
        self, *, index: int, num_servers: int, num_workers: int, attempt: int, store: Any,
        new_store: Callable[[], Any], timeout_s: float, param: torch.Tensor,
        build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        stop: threading.Event, on_promote: Callable[[dict[str, Any]], None],
    ) -> None:  # fmt: skip
        self.slice = backed_up_by(index, num_servers)  # whose backup this is
        self.on_promote = on_promote
        self.primary_rank = num_workers + self.slice
        self.attempt, self.store, self.new_store = attempt, store, new_store
        self.timeout_s, self.stop = timeout_s, stop
        self.param = nn.Parameter(param.detach().clone())
        self.optimizer = build_optimizer([self.param])
        self.book: Applied | None = None  # None until it holds a copy
        self.gave = 0  # copies handed to a restarted primary
        # Named ATTEMPT.GEN at backup_key: a link that breaks while both processes live is
        # made again under the next generation, and the primary sends its whole slice.
        self.generation = 0
        store.set(backup_key(self.slice), self.name)

    @property
    def name(self) -> str:
        return f"{self.attempt}.{self.generation}"

    def start(self) -> None:
        # A link error is a lost primary (the next one is waited for); anything else in
        # this thread is a bug, which ends the process (and the job) at once.
        body = guarded(
            self._run, f"the backup of slice {self.slice}", stop=self.stop, expected=STORE_LOST
        )
        threading.Thread(target=body, daemon=True,
                         name=f"replica-backup{self.slice}").start()  # fmt: skip

    def _run(self) -> None:
        tried: str | None = None
        while not self.stop.is_set():
            if self.store.check([promote_key(self.slice)]):
                if self.book is None:  # stale, or never copied: nothing to serve from
                    log.error("slice %d: its primary is gone for good and this backup holds "
                              "no current copy of it", self.slice)  # fmt: skip
                    self.store.set(stale_key(self.slice), "1")
                    return
                log.warning("slice %d: its primary is gone for good; serving it from this "
                            "process (its backup)", self.slice)  # fmt: skip
                self.on_promote(self.state())
                return
            key = primary_key(self.slice)
            value = self.store.get(key).decode() if self.store.check([key]) else None
            if value is None or value == tried:
                time.sleep(0.02)
                continue
            tried = value
            peer = (self.primary_rank, int(value))
            if self.store.check([wire.death_key(*peer)]):
                continue
            try:
                link = wire.Link(self.new_store(), link_prefix(self.slice, int(value), self.name),
                               server_side=False, timeout_s=self.timeout_s, peer=peer)  # fmt: skip
            except wire.LinkError as e:
                log.warning("slice %d: no link to primary %s: %s", self.slice, value, e)
                continue
            try:
                self._serve(link)
            except wire.LinkError as e:
                if not self.stop.is_set():
                    self._lost(peer, e)
                    tried = None  # a primary that lives links to the new name
            finally:
                link.close()

    def _lost(self, peer: tuple[int, int], error: wire.LinkError) -> None:
        """The link to the primary broke: it died, or the link did (both alive). The copy is
        kept either way, and the next link decides what it is worth: a restarted primary
        takes it (the updates it acknowledged after the last forward, if any, are counted as
        lost: exposure.py), a primary that lives links again and sends its whole slice."""
        why = str(error).splitlines()[0][:160]
        self.generation += 1
        self.store.set(backup_key(self.slice), self.name)
        log.warning("slice %d: the link to primary %s broke (%s); linking again as %s",
                    self.slice, peer, why, self.name)  # fmt: skip

    def _serve(self, link: wire.Link) -> None:
        head = torch.zeros(wire.HEADER, dtype=torch.int64)
        link.recv(head)
        if int(head[0]) != SYNC:
            raise RuntimeError(f"replica link: expected SYNC, got kind {int(head[0])}")
        if int(head[1]) and self.book is not None:  # a restarted primary: give it the slice
            _send_blob(link, to_bytes(self.state()), 0)
            self.gave += 1
        else:  # take the primary's (a restarted one restores its checkpoint first)
            if int(head[1]):
                _send_blob(link, None, 0)
            data = _recv_blob(link, 0)
            if data is None:
                raise RuntimeError("replica link: the primary sent no state")
            self.load(from_bytes(data))
            link.send(_header(ACK, self.book.version if self.book else 0))
        while not self.stop.is_set():
            link.recv(head)
            if int(head[0]) != FORWARD:
                raise RuntimeError(f"replica link: expected FORWARD, got kind {int(head[0])}")
            self._apply(link, int(head[1]), int(head[2]))
            link.send(_header(ACK, self.book.version if self.book else 0))

    def _apply(self, link: wire.Link, count: int, meta_len: int) -> None:
        factors = torch.zeros(count, dtype=torch.float64)
        grads = [torch.empty_like(self.param.data) for _ in range(count)]
        meta = torch.empty(meta_len, dtype=torch.uint8)
        link.recv(*([factors, *grads] if count else []), meta, first_tag=1)
        for factor, grad in zip(factors.tolist(), grads, strict=True):
            scale_lr(self.optimizer, factor)
            self.param.grad = grad
            self.optimizer.step()
            self.param.grad = None
        self.book = Applied.decode(meta)

    def state(self) -> dict[str, Any]:
        assert self.book is not None
        return {"param": self.param.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "book": self.book.encode()}  # fmt: skip

    def load(self, state: dict[str, Any]) -> None:
        if state["param"].shape != self.param.shape:
            raise RuntimeError(f"slice {self.slice}: the primary's copy has shape "
                               f"{tuple(state['param'].shape)}, this backup's "
                               f"{tuple(self.param.shape)}")  # fmt: skip
        self.param.data.copy_(state["param"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.book = Applied.decode(state["book"])
