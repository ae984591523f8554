"""One parameter-server process: holds a slice of the flattened parameters and its optimizer
state, applies the workers' gradients per the consistency mode, and serves the parameters.

Threads: an acceptor watches the store for workers that join (or rejoin); each worker then
gets a handler thread of its own that receives on that worker's link and replies (its link
fails the wait when the launcher says that worker's process died: transport.PeerDied). Receiving
happens outside any lock, so pushes from several workers arrive concurrently; the lock
(``self.cond``) is held only to apply a gradient or change membership, and the parameters a
reply carries are copied under it and sent after it is released.

- asp: a push is applied on arrival; the reply carries the latest parameters.
- ssp(s): as asp, but the reply waits until its worker is at most s steps ahead of the
  slowest live worker (consistency.may_proceed), by the clocks the workers carry in their
  messages, so every server holds a worker by the same clock (consistency.join_clock). At
  the start a worker that has not joined yet counts as the slowest, at 0 pushes, until every
  worker has joined or --timeout-s has passed.
- bsp: pushes of one global step are summed weighted by samples; when every live worker of
  that step has pushed (or was dropped: its link broke, or it stayed silent for
  --barrier-timeout-s after the step's first push) the weighted mean is applied once and
  every waiting reply goes out.

Server 0 also deals the data (coordinator.py): its replies carry each worker's next lease,
the lease of a push it applied is committed, and the lease of a worker that died or was
dropped is requeued. It deals the first step once every worker has said hello (or after
--timeout-s): otherwise whichever worker imported torch first would start alone.

With --checkpoint-every N a server saves its slice (and server 0 its coordinator) every N
updates, each after the update's lease is committed: under bsp each server at its own
global steps, under asp and ssp all servers at once, in a cut (cuts.py: every server holds
the pushes that arrive while they agree on which pushes the copies hold). A restarted server
loads its newest and announces a new incarnation in the store, and the workers reconnect;
updates since that checkpoint are lost on that slice (recorded). Preempted, every server
saves once the workers have left (ps/preempt). A later job run (after a preemption or a
whole-job kill) loads the newest moment every server checkpointed (cuts.consistent_checkpoint).
Events for summary.json's recoveries go to logs/ps_events.jsonl.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain import env
from scaletrain.config import RunConfig
from scaletrain.fault.checkpoint import load_latest, read_index, save_checkpoint
from scaletrain.fault.inject import parse_inject
from scaletrain.fault.watchdog import SelfWatchdog
from scaletrain.io import JsonlWriter, append_jsonl, atomic_torch_save, read_jsonl
from scaletrain.metrics.summary import peak_rss_bytes
from scaletrain.schedule import lr_factor, scale_lr
from scaletrain.strategies.param_server import consistency as rules
from scaletrain.strategies.param_server import cuts, keys, replica
from scaletrain.strategies.param_server import transport as wire
from scaletrain.strategies.param_server.admission import Admission
from scaletrain.strategies.param_server.coordinator import DataCoordinator, Lease
from scaletrain.strategies.param_server.exposure import AcknowledgedLoss

log = logging.getLogger("scaletrain.ps.server")


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    append_jsonl(run_dir / "logs" / "ps_events.jsonl", {**event, "unix_time": time.time()})


LEDGER = "ps_ledger.jsonl"


def server_beat_path(run_dir: Path, rank: int) -> Path:
    """The file a server's watchdog touches every second (its launcher reads its age)."""
    return run_dir / "logs" / "beats" / f"rank{rank}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


class ShardServer:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: nn.Module,
        build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        num_train: int,
        shard_sizes: list[int] | None,
        index: int,
        num_workers: int,
        attempt: int,
        store: Any,
        new_store: Callable[[], Any],
        run_dir: Path,
        token: str,
        host: tuple[int, int] | None = None,
        taken: dict[str, Any] | None = None,
    ) -> None:
        """``host`` and ``taken``: a slice whose primary is gone for good, served from its
        backup's copy (``taken``) by the backup's process, rank and attempt ``host``
        (``_promote``)."""
        self.cfg, self.index, self.num_workers = cfg, index, num_workers
        self.model, self.build_optimizer = model, build_optimizer
        self.num_train, self.shard_sizes = num_train, shard_sizes
        self.promoted = taken is not None
        self.siblings: list[threading.Thread] = []  # slices this process took over
        # The schedule's horizon, in this server's updates (--lr-schedule).
        self.total_updates = rules.total_updates(cfg, num_train, num_workers)
        self.rank = num_workers + index
        # The process serving this slice: its own, or the backup's that took it over.
        self.host = host or (self.rank, attempt)
        # A taken-over slice runs in another rank's process: that rank's faults are its own.
        self.faults = [] if self.promoted else parse_inject(cfg.fault.inject)
        # An update that does not end within --hang-timeout-s (a stuck apply, --inject hang of
        # this rank) ends this server (exit 75): its launcher restarts it from its checkpoint,
        # as after a death. Waiting for pushes is idle: nothing is owed then. Its heartbeat
        # file tells the launcher it is not frozen whole (launch/ps.py).
        self.watchdog = SelfWatchdog(
            rank=self.host[0],
            timeout_s=cfg.hang_timeout_s,
            beat_path=None if self.promoted else server_beat_path(run_dir, self.rank),
        )
        self.attempt, self.store, self.run_dir = attempt, store, run_dir
        # Each link sets itself up through a store connection of its own: a client is one
        # socket, and a peer that dies while its link forms must not block the others.
        self.new_store = new_store
        self.token = token  # workers prove they hold it to join (admission.py)
        flat = flat_params(model)
        ranges = rules.shard_ranges(flat.numel(), cfg.ps.num_servers)
        lo, hi = ranges[index]
        self.param = nn.Parameter(flat[lo:hi].clone())
        self.optimizer = build_optimizer([self.param])
        self.mode = cfg.ps.consistency
        self.bound = cfg.ps.staleness if self.mode == "ssp" else None
        self.version = 0
        self.cond = threading.Condition()
        self.live: set[int] = set()
        self.sessions: dict[int, int] = {}  # each live worker's process attempt
        self.clocks: dict[int, int] = {}
        self.clock_moved: dict[int, float] = {}  # ssp: when each worker's clock last moved
        self.join_step: dict[int, int] = {}
        self.applied = 0
        # bsp: the open barrier.
        self.barrier_step = 0
        self.barrier_sum = torch.zeros_like(self.param)
        self.barrier_samples = 0
        self.arrived: set[int] = set()
        self.barrier_opened = 0.0
        self.released_step = 0  # the last global step applied
        self.checkpointed = -1  # the version of the last periodic checkpoint
        self.job_run = int(os.environ.get(env.JOB_RUN, 0))
        self.restarted_idle = attempt > 0  # until its first update (the "updated" event)
        # asp/ssp: a cut is due (server 0 takes it: cuts.py); this server is frozen for one
        # (pushes held), and the pushes it holds, once known.
        self.cut_due = self.frozen = False
        self.cut_pushes: dict[int, tuple[int, int]] | None = None
        self.coordinator = None
        # Server 0's account of the leases it applied (_commit), open for the server's life.
        self.ledger = JsonlWriter(run_dir / "logs" / LEDGER) if index == 0 else None
        if index == 0:
            self.coordinator = DataCoordinator(
                num_train,
                batch_size=cfg.samples_per_step,
                epochs=cfg.train.epochs,
                seed=cfg.train.seed,
                drop_last=cfg.train.drop_last,
                num_workers=num_workers,
                lockstep=self.mode == "bsp",
                max_steps=cfg.train.max_steps,
                shard_sizes=shard_sizes,
            )
        self.leases: dict[int, Lease | None] = {}  # server 0: each worker's next lease (None: end)
        self.started = False  # server 0, bsp: the first step is dealt
        self.start_forced = False  # bsp: stop waiting for the first hellos (_start_timer)
        self.hellos: set[int] = set()
        self.released_lr_factor = 1.0  # bsp: the factor of --lr of the last step applied
        self.stop = threading.Event()
        self.save_lock = threading.Lock()
        self.checkpoint_dir = run_dir / "checkpoints" / f"server{index}"
        # bsp under --deterministic: the step's pushes, summed in worker order at its release
        # (in arrival order, two runs of one command differed in the last bits).
        self.barrier_grads: dict[int, tuple[torch.Tensor, int]] = {}
        # Each worker's last push applied (replica.Applied): a push sent again to a restarted
        # server is applied once. Server 0 restored from a backup: each worker's lease, as its
        # last reply carried it, kept for the process that holds it (``_kept_lease``).
        self.applied_clock: dict[int, tuple[int, int]] = {}
        self.applied_step: dict[int, tuple[int, int]] = {}
        self.kept: dict[int, tuple[int, Lease | None]] = {}
        self.unlogged: list[dict[str, Any]] = []  # server 0: ledger lines not forwarded yet
        self.resent_applied = 0  # pushes sent again that this slice held already
        self.members: dict[int, int] = {}  # restored from a backup: worker -> its process attempt
        self.primary: replica.Primary | None = None
        self.backup: replica.Backup | None = None
        if cfg.ps.ps_replicas and not self.promoted:  # a taken-over slice has no backup left
            common = {"index": index, "num_servers": cfg.ps.num_servers,
                      "num_workers": num_workers, "attempt": attempt, "store": store,
                      "new_store": new_store, "timeout_s": cfg.launch.timeout_s,
                      "stop": self.stop}  # fmt: skip
            # The backup holds the previous server's slice, which may be one element
            # shorter or longer than this one (the count need not divide).
            blo, bhi = ranges[replica.backed_up_by(index, cfg.ps.num_servers)]
            self.backup = replica.Backup(**common, param=flat[blo:bhi],
                                         build_optimizer=build_optimizer,
                                         on_promote=self._promote)  # fmt: skip
            self.backup.start()
            self.primary = replica.Primary(**common, lock=self.cond,
                                           full_state=self._replica_state,
                                           on_synced=self._backup_synced,
                                           before_copy=self._before_copy)  # fmt: skip
        if taken is not None:
            self._restore_replica(taken)
        else:
            self._restore()
        self.loss = AcknowledgedLoss(
            server=index, attempt=self.attempt, restored=self.version,
            backed_up=bool(cfg.ps.ps_replicas), record=lambda e: append_event(run_dir, e),
        )  # fmt: skip
        if self.primary is not None:
            self.primary.start()

    # -- checkpoints ---------------------------------------------------------------------
    def _restore(self) -> None:
        """The newest intact checkpoint of this server's slice (the shared format: a
        checksummed index, loaded with weights_only=True; fault/checkpoint.py). At the
        first start of a later job run, the one of the newest moment every server
        checkpointed (cuts.consistent_checkpoint): after a whole-job kill a server's newest
        may be of updates the others never saved."""
        if self.primary is not None and self.attempt > 0:
            taken = self.primary.take_state()
            if taken is not None:
                self._restore_replica(taken)
                return
        below = None
        if self.attempt == 0 and self.job_run:
            num_servers = self.cfg.ps.num_servers
            common = cuts.consistent_checkpoint(self.run_dir, num_servers, self.mode)
            if common is not None:
                below = common[self.index] + 1
            elif any(read_index(self.run_dir / "checkpoints" / f"server{k}")
                     for k in range(num_servers)):  # fmt: skip
                raise RuntimeError(
                    "internal failure: no checkpoint of one moment on every server "
                    "(launch/jobs.py should have refused this job run)"
                )
        state, skipped = load_latest(self.checkpoint_dir, below)
        for note in skipped:
            log.warning("skipping damaged checkpoint: %s", note)
        if state is None:
            return
        self.param.data.copy_(state["param"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.released_step = state["released_step"]
        if self.coordinator is not None:
            self.coordinator.load_state_dict(state["coordinator"])
        log.info("server %d restored version %d", self.index, self.version)
        append_event(
            self.run_dir,
            {"event": "restored", "server": self.index, "version": self.version,
             "attempt": self.attempt},
        )  # fmt: skip

    # -- replicas (replica.py) -------------------------------------------------------------
    def _book(self) -> replica.Applied:
        """Lock held: what this slice's copies agree on besides the numbers."""
        book = replica.Applied(
            version=self.version, released_step=self.released_step, applied=self.applied,
            clocks=dict(self.applied_clock), steps=dict(self.applied_step),
        )  # fmt: skip
        if self.coordinator is not None:
            book.coordinator = self.coordinator.snapshot()
            # Each worker's lease: dealt here, or (restored from a backup) kept for a worker
            # that has not joined again yet, whose holder is still the one it was kept for.
            held = {w: lease for w, (_, lease) in self.kept.items()} | self.leases
            book.leases = {w: None if lease is None else
                           [lease.epoch, lease.step, list(lease.positions)]
                           for w, lease in held.items()}  # fmt: skip
            book.sessions = {w: holder for w, (holder, _) in self.kept.items()}
            book.sessions |= {w: self.sessions[w] for w in self.leases if w in self.sessions}
            book.ledger = list(self.unlogged)
        return book

    def _replica_state(self) -> dict[str, Any]:
        """Lock held: the whole slice, for a backup to copy."""
        return {"param": self.param.detach().clone(),
                "optimizer": _clone(self.optimizer.state_dict()),
                "book": self._book().encode()}  # fmt: skip

    def _before_copy(self) -> None:
        for fault in self.faults:  # kill-during-copy
            fault.before_copy(self.version, self.rank, self.attempt)

    def _backup_synced(self, backup_attempt: int) -> None:
        """The backup's process (that attempt) holds this slice whole: from here on a death
        of this server loses nothing (the "backup_synced" event)."""
        append_event(self.run_dir, {"event": "backup_synced", "server": self.index,
                                    "attempt": self.attempt,
                                    "backup_attempt": backup_attempt})  # fmt: skip

    def _replicate(self) -> None:
        """Lock held, before any reply: the backup holds every update the reply tells of."""
        if self.primary is not None:
            book = self._book()
            self.primary.forward(book)
            if self.ledger is not None:
                for line in book.ledger:
                    self.ledger.write(line)
            self.unlogged = []
            if self.primary.link is not None:  # the backup holds every update so far
                for fault in self.faults:
                    if fault.breaks_link(self.version, self.rank, self.attempt):
                        self.primary.break_link()
                    fault.before_reply(self.version, self.rank, self.attempt)

    def _restore_replica(self, state: dict[str, Any]) -> None:
        """A restarted server: go on from its backup's copy, every acknowledged push in it."""
        book = replica.Applied.decode(state["book"])
        self.param.data.copy_(state["param"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.released_step = book.version, book.released_step
        self.applied = book.applied
        self.applied_clock, self.applied_step = book.clocks, book.steps
        # The worker processes this slice had applied pushes of: _start_timer waits for them.
        self.members = {w: a for w, (a, _) in (book.clocks | book.steps).items()}
        self.members |= {w: a for w, a in book.sessions.items()}
        self.checkpointed = self.version
        if self.coordinator is not None and book.coordinator is not None:
            self.coordinator.load_snapshot(book.coordinator)
            for worker, held in book.leases.items():
                lease = None if held is None else self.coordinator.lease_of(*held)
                self.kept[worker] = (book.sessions.get(worker, -1), lease)
            self.started = bool(self.kept)
            self._log_forwarded(book.ledger)
            threading.Thread(target=self._watch_kept, daemon=True).start()
        log.info("server %d took version %d from its backup%s", self.index, self.version,
                 f", served by rank {self.host[0]}" if self.promoted else "")  # fmt: skip
        event = {"event": "restored", "server": self.index, "version": self.version,
                 "attempt": self.attempt, "from": "backup"}  # fmt: skip
        if self.promoted:
            event["host"] = self.host[0]
        append_event(self.run_dir, event)

    def _promote(self, state: dict[str, Any]) -> None:
        """The backup's thread: the primary of the slice this process backs up is gone for
        good (its launcher will not restart it: ps/promote/K). Serve that slice from here, from
        the backup's copy, under a new incarnation the workers join as after a restart."""
        assert self.backup is not None
        sibling = ShardServer(
            self.cfg, model=self.model, build_optimizer=self.build_optimizer,
            num_train=self.num_train, shard_sizes=self.shard_sizes, index=self.backup.slice,
            num_workers=self.num_workers, attempt=replica.PROMOTED + self.attempt,
            store=self.new_store(), new_store=self.new_store, run_dir=self.run_dir,
            token=self.token, host=(self.rank, self.attempt), taken=state,
        )  # fmt: skip
        thread = threading.Thread(target=sibling.serve, daemon=True,
                                  name=f"server{self.backup.slice}")  # fmt: skip
        thread.start()
        self.siblings.append(thread)

    def _log_forwarded(self, lines: list[dict[str, Any]]) -> None:
        """Server 0 restored from a backup: the ledger lines of the last forward, which its
        primary died before writing (or not: written once)."""
        path = self.run_dir / "logs" / LEDGER
        written = read_jsonl(path)[-len(lines) :] if lines and path.exists() else []
        keys = {(r["worker"], r["epoch"], r["step"], r["version"]) for r in written}
        for line in lines:
            if (line["worker"], line["epoch"], line["step"], line["version"]) not in keys:
                assert self.ledger is not None
                self.ledger.write(line)

    def _kept_lease(self, worker: int, attempt: int) -> tuple[bool, Lease | None]:
        """Lock held, server 0 restored from a backup, at a worker's hello: the lease its
        process holds (True, the lease), which it goes on with; a lease held by an earlier
        process of the worker is dealt again (False)."""
        if worker not in self.kept:
            return False, None
        holder, lease = self.kept.pop(worker)
        if holder == attempt:
            return True, lease
        self.coordinator.requeue(worker)  # type: ignore[union-attr]
        return False, None

    def _foreign_lease(self, worker: int, step: int) -> bool:
        """Server 0, --ps-replicas, lock held: a push sent again for a lease the worker no
        longer holds here (this server restarted from its checkpoint, its backup's copy lost
        too): not applied, its samples are dealt again; the reply drops the worker, which
        joins again."""
        if self.primary is None or self.coordinator is None:
            return False
        lease = self.leases.get(worker)
        return lease is not None and lease.step != step

    def _watch_kept(self) -> None:
        """Server 0 restored from a backup: a kept lease whose process died before it joined
        again is dealt again (its successor joins as a new process)."""
        while not self.stop.wait(wire.WATCH_S):
            with self.cond:
                if not self.kept:
                    return
                for worker, (holder, _) in list(self.kept.items()):
                    if self.store.check([wire.death_key(worker, holder)]):
                        del self.kept[worker]
                        if self.coordinator is not None and self.coordinator.requeue(worker):
                            if self.mode == "bsp":
                                self._maybe_release()
                                self._maybe_start()
                            else:
                                self._deal(-1)
                self.cond.notify_all()

    def _maybe_checkpoint(self) -> None:
        """Called with the lock held, after an update and its commit. bsp: every server
        writes its own (a global step is the same updates on each); asp and ssp: server 0
        makes a cut due (_lead_cuts), the others copy theirs when it publishes it."""
        every = self.cfg.fault.checkpoint_interval
        if not every or self.version % every or self.version == self.checkpointed:
            return
        self.checkpointed = self.version
        if self.mode != "bsp":
            if self.coordinator is not None:
                self.cut_due = True
                self.cond.notify_all()
            return
        threading.Thread(target=self._write, args=(self._state(),), daemon=True).start()

    def _state(self, cut: list[int] | None = None) -> dict[str, Any]:
        """What a checkpoint of this server holds (lock held): its slice, its optimizer state,
        and server 0 the data plan (leases out saved as requeued); under asp and ssp the
        cut it is of (cuts.py)."""
        return {
            "param": self.param.detach().clone(),
            "optimizer": _clone(self.optimizer.state_dict()),
            "version": self.version,
            "released_step": self.released_step,
            "cut": cut,
            # asp, ssp: the clock of each live worker's last push this server applied (a
            # cut's copies on every server hold the same).
            "clocks": dict(self.clocks),
            "coordinator": self.coordinator.state_dict() if self.coordinator else None,
        }

    # -- cuts (asp, ssp: cuts.py) --------------------------------------------------------
    def _lead_cuts(self) -> None:
        """Server 0: take each cut that falls due: publish it, freeze, collect every
        server's applied pushes, publish the cut's pushes (the newest of each worker any
        server applied), copy this server's state at them; write the copy once every
        server has made one (otherwise no file of that cut could be continued from)."""
        while not self.stop.is_set():
            with self.cond:
                if not self.cond.wait_for(lambda: self.stop.is_set() or self.cut_due, 0.5):
                    continue
                self.cut_due = False  # one that falls due during this cut is the next
            if self.stop.is_set():
                return
            began = time.monotonic()
            n = self.store.add(keys.CUT_COUNT, 1)
            incarnations = self._server_incarnations()
            self.store.set(keys.CUT_LATEST, str(n))
            own = self._freeze(n)
            reports, missing = self._await_all(keys.cut_applied, n, incarnations)
            pushes = cuts.newest([own, *(cuts.decode(r) for r in reports)]) \
                if not missing else None  # fmt: skip
            self.store.set(keys.cut_pushes(n), cuts.encode(pushes) if pushes is not None else "")
            state = self._copy_at(n, pushes)
            held = time.monotonic() - began
            if not missing:
                missing = self._await_all(keys.cut_copied, n, incarnations)[1]
            event = {"event": "cut", "server": 0, "cut": n,
                     "version": state["version"] if state else self.version,
                     "paused_s": round(held, 4)}  # fmt: skip
            if missing or state is None:
                log.warning("cut %d abandoned: server(s) %s did not take part", n, missing)
                append_event(self.run_dir, {**event, "event": "cut_abandoned",
                                            "missing": missing})  # fmt: skip
                continue
            append_event(self.run_dir, event)
            threading.Thread(target=self._write, args=(state,), daemon=True).start()

    def _follow_cuts(self) -> None:
        """Every server but 0: take part in each cut server 0 publishes after this
        incarnation began (one published before may be of pushes it lost)."""

        def latest() -> int:
            store, key = self.store, keys.CUT_LATEST
            return int(store.get(key)) if store.check([key]) else 0

        seen = latest()
        while not self.stop.wait(0.01):
            if latest() <= seen:
                continue
            n = seen = latest()
            leader = self.store.get(keys.incarnation(0))
            self.store.set(keys.cut_applied(n, self.index), cuts.encode(self._freeze(n)))
            text = self._await_key(keys.cut_pushes(n), leader)
            state = self._copy_at(n, cuts.decode(text) if text else None)
            if state is not None:
                self.store.set(keys.cut_copied(n, self.index), "1")
                threading.Thread(target=self._write, args=(state,), daemon=True).start()

    def _freeze(self, n: int) -> dict[int, tuple[int, int]]:
        """Hold every push not yet applied (``_may_apply``) and return the pushes this
        server applied: each live worker's process attempt and clock."""
        with self.cond:
            self.frozen, self.cut_pushes = True, None
            return {w: (self.sessions[w], self.clocks[w]) for w in self.live}

    def _copy_at(self, n: int, pushes: dict[int, tuple[int, int]] | None) -> dict | None:
        """Apply the held pushes the cut holds, copy this server's state, thaw. None: the
        cut was abandoned, or its pushes did not all arrive within --timeout-s."""
        with self.cond:
            state = None
            if pushes is not None:
                self.cut_pushes = pushes
                self.cond.notify_all()
                if self._await_pushes(pushes) and not self.stop.is_set():
                    state = self._state([self.job_run, n])
                else:
                    log.warning("cut %d: the pushes it holds did not all arrive", n)
            self.frozen, self.cut_pushes = False, None
            self.cond.notify_all()
            return state

    def _may_apply(self, worker: int, clock: int) -> bool:
        """Lock held: whether a push may be applied now: always, but during a cut only
        those the cut holds (once it is known which)."""
        if not self.frozen or self.stop.is_set() or worker not in self.live:
            return True
        held = self.cut_pushes.get(worker) if self.cut_pushes is not None else None
        return held is not None and held[0] == self.sessions.get(worker) and clock <= held[1]

    def _await_pushes(self, pushes: dict[int, tuple[int, int]]) -> bool:
        """Lock held: until this server has applied a cut's pushes (False: not within
        --timeout-s)."""
        return self.cond.wait_for(
            lambda: (
                self.stop.is_set() or cuts.reached(pushes, self.live, self.sessions, self.clocks)
            ),
            timeout=self.cfg.launch.timeout_s,
        )

    def _server_incarnations(self) -> list[bytes]:
        return [self.store.get(keys.incarnation(k))
                for k in range(self.cfg.ps.num_servers)]  # fmt: skip

    def _await_all(
        self, key: Callable[[int, int], str], n: int, incarnations: list[bytes]
    ) -> tuple[list[bytes], list[int]]:
        """Server 0: every other server's value of ``key(n, k)``, and the servers that gave
        none: one restarted since the cut began (its state is not of those pushes), or
        silent for --timeout-s (one that froze is restarted by its launcher before that)."""
        values: dict[int, bytes] = {}
        waiting = set(range(1, self.cfg.ps.num_servers))
        deadline = time.monotonic() + self.cfg.launch.timeout_s
        while waiting and not self.stop.is_set() and time.monotonic() < deadline:
            for k in sorted(waiting):
                if self.store.check([key(n, k)]):
                    values[k] = self.store.get(key(n, k))
                    waiting.discard(k)
                elif self.store.get(keys.incarnation(k)) != incarnations[k]:
                    return [], sorted(waiting)
            if waiting:
                time.sleep(0.002)
        return [values[k] for k in sorted(values)], sorted(waiting)

    def _await_key(self, key: str, leader: bytes) -> bytes:
        """A follower: the value server 0 publishes at ``key`` (empty: none, the cut was
        abandoned, or server 0 restarted or fell silent for --timeout-s meanwhile)."""
        deadline = time.monotonic() + self.cfg.launch.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.store.check([key]):
                return self.store.get(key)
            if self.store.get(keys.incarnation(0)) != leader:
                break
            time.sleep(0.002)
        return b""

    def _write(self, state: dict[str, Any]) -> None:
        """In the background: updates go on while it writes, so a server that dies before
        the write is done restores the checkpoint before it (the "saved" event says which
        were complete)."""
        with self.save_lock:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            save_checkpoint(self.checkpoint_dir, state["version"], state,
                            self.cfg.fault.keep_checkpoints)  # fmt: skip
            append_event(
                self.run_dir,
                {
                    "event": "saved",
                    "server": self.index,
                    "version": state["version"],
                    "attempt": self.attempt,
                },
            )

    # -- serving -------------------------------------------------------------------------
    def serve(self) -> None:
        # Its first heartbeat before any worker can reach it (the launcher ends a server
        # whose heartbeat stopped, once it has beaten).
        self.watchdog.start().enter(self.version, SelfWatchdog.IDLE)
        acceptor = threading.Thread(target=self._accept, name="acceptor", daemon=True)
        acceptor.start()
        # Which process serves this incarnation (a taken-over slice: its backup's), for the
        # workers to hear of its death; then the incarnation the workers join.
        self.store.set(keys.server_host(self.index, self.attempt),
                       f"{self.host[0]}.{self.host[1]}")  # fmt: skip
        self.store.set(keys.incarnation(self.index), str(self.attempt))
        log.info("server %d serving %d parameters (attempt %d)",
                 self.index, self.param.numel(), self.attempt)  # fmt: skip
        if self.mode in ("bsp", "ssp"):
            threading.Thread(target=self._start_timer, daemon=True).start()
        if self.mode == "bsp":
            threading.Thread(target=self._barrier_watch, daemon=True).start()
        if self.mode == "ssp":
            threading.Thread(target=self._bound_watch, daemon=True).start()
        if self.mode != "bsp" and self.cfg.fault.checkpoint_interval:
            lead = self._lead_cuts if self.coordinator is not None else self._follow_cuts
            threading.Thread(target=lead, name="cuts", daemon=True).start()
        try:
            while not self.store.check([keys.FINISH]):
                if self.store.check([keys.PREEMPT]):
                    self._checkpoint_preempted()
                    return
                time.sleep(0.1)
        finally:
            self.stop.set()
            self.watchdog.stop()
            for sibling in self.siblings:  # the slices it took over write theirs too
                sibling.join(60.0)
        with self.cond:
            final = {
                "param": self.param.detach().clone(),
                "version": self.version,
                "applied": self.applied,
                "samples_trained": self.coordinator.samples_trained if self.coordinator else 0,
                "peak_rss_bytes": peak_rss_bytes(),
                "replication": None
                if self.primary is None or self.backup is None
                else {
                    "forwards": self.primary.forwards,
                    "forward_s": round(self.primary.forward_s, 4),
                    "copies_given": self.backup.gave,
                    "resent_already_applied": self.resent_applied,
                },
            }
        atomic_torch_save(self.run_dir / "checkpoints" / f"final-server{self.index}.pt", final)
        if self.ledger is not None:
            for line in self.unlogged:  # committed with no reply after (none is expected)
                self.ledger.write(line)
            self.ledger.close()

    def _checkpoint_preempted(self) -> None:
        try:
            self._checkpoint_now()
        finally:
            for sibling in self.siblings:
                sibling.join(60.0)

    def _checkpoint_now(self) -> None:
        """The job was preempted and every worker has left (launch/ps.py): nothing is in
        flight, so the slices of all servers are of the same updates. Each writes its
        checkpoint (after any background write of its own: save_lock), and the same command
        continues from them. Under asp and ssp it is a cut, named by server 0."""
        with self.cond:
            state = self._state()
        if self.mode != "bsp":
            if self.coordinator is not None:
                self.store.set(keys.CUT_PREEMPT, str(self.store.add(keys.CUT_COUNT, 1)))
            try:
                self.store.wait([keys.CUT_PREEMPT])  # the store's timeout: --timeout-s
                state["cut"] = [self.job_run, int(self.store.get(keys.CUT_PREEMPT))]
            except RuntimeError as e:  # server 0 is gone: a checkpoint of no cut
                log.warning("server 0 named no cut for the preemption: %s", first_line(e))
        self._write(state)
        log.info("server %d checkpointed version %d: preempted", self.index, self.version)
        if self.ledger is not None:
            self.ledger.close()

    def _accept(self) -> None:
        scope = keys.server_scope(self.index, self.attempt)
        key = f"{scope}/joins"  # the workers' count is key/count
        admission = Admission(self.token, scope)
        seen = 0
        while not self.stop.is_set():
            if not self.store.check([f"{key}/{seen + 1}"]):
                time.sleep(0.01)
                continue
            seen += 1
            worker, worker_attempt, refused = admission.check(
                self.store.get(f"{key}/{seen}").decode()
            )
            if refused:
                log.warning("refused a join as worker %d (attempt %d): %s", worker,
                            worker_attempt, refused)  # fmt: skip
                append_event(self.run_dir, {"event": "join_refused", "server": self.index,
                                            "worker": worker, "why": refused})  # fmt: skip
                self.store.set(f"{key}/{seen}/answer", f"refused: {refused}")
                continue
            self.store.set(f"{key}/{seen}/answer", "ok")
            prefix = keys.worker_link(self.index, self.attempt, worker, worker_attempt)
            name = f"worker{worker}.{worker_attempt}"
            threading.Thread(target=self._handle, args=(worker, worker_attempt, prefix),
                             daemon=True, name=name).start()  # fmt: skip

    def _handle(self, worker: int, attempt: int, prefix: str) -> None:
        """Serve one worker process (``worker``'s ``attempt``) over its own link."""
        try:
            link = wire.Link(self.new_store(), prefix, server_side=True,
                           timeout_s=self.cfg.launch.timeout_s,
                           peer=(worker, attempt))  # fmt: skip
        except Exception as e:
            log.warning("worker %d could not connect: %s", worker, e)
            return
        head = torch.zeros(wire.HEADER, dtype=torch.int64)
        grad = torch.zeros_like(self.param.data)
        try:
            while True:
                link.recv(head)
                kind = wire.Kind(int(head[wire.KIND]))
                if kind == wire.Kind.DONE:
                    self._leave(worker, attempt, died=False)
                    return
                if kind == wire.Kind.PUSH:
                    link.recv(grad, first_tag=1)
                reply = self._hello(worker, head) if kind == wire.Kind.HELLO \
                    else self._push(worker, head, grad)  # fmt: skip
                link.send(*reply)
        except Exception as e:
            if not self.stop.is_set():
                log.warning("lost worker %d: %s", worker, first_line(e))
                how = "died" if isinstance(e, wire.PeerDied) else "connection"
                self._leave(worker, attempt, died=True, how=how)
        finally:
            link.close()
            log.info("handler of worker %d ends", worker)

    # -- membership ----------------------------------------------------------------------
    def _hello(self, worker: int, head: torch.Tensor) -> list[torch.Tensor]:
        started = time.perf_counter()
        with self.cond:
            if worker in self.live:  # a rejoin after being dropped: its old lease is void
                self._drop(worker)
            others = [self.clocks[w] for w in self.live]
            if self.bound is not None and worker not in self.hellos and self._awaiting_joins():
                others.append(0)  # ssp's start: a worker's first join, at no push yet
            self.clocks[worker] = rules.join_clock(int(head[wire.CLOCK]), others)
            self.clock_moved[worker] = time.monotonic()
            self.live.add(worker)
            self.sessions[worker] = int(head[wire.ATTEMPT])
            self.hellos.add(worker)
            self.loss.joined(worker, int(head[wire.VERSION_ON]))
            keep, kept = self._kept_lease(worker, int(head[wire.ATTEMPT]))
            if self.coordinator is None:
                self.join_step[worker] = int(head[wire.STEP])
            elif keep:  # restored from a backup: the worker goes on with the lease it holds
                self.leases[worker] = kept
                self.join_step[worker] = kept.step if kept else 0
            else:
                if self.mode == "bsp":
                    self.join_step[worker] = 1 << 62  # until dealt into a step
                    self.leases.pop(worker, None)
                    self._maybe_start()
                    self.cond.wait_for(lambda: worker in self.leases or self.stop.is_set())
                else:
                    self._deal(worker)
                    self._wait_lease(worker)
            append_event(
                self.run_dir,
                {
                    "event": "joined",
                    "server": self.index,
                    "worker": worker,
                    "attempt": int(head[wire.ATTEMPT]),
                },
            )
            return self._reply(worker, started, staleness=0, committed=False)

    def _leave(self, worker: int, attempt: int, *, died: bool, how: str = "") -> None:
        """``worker``'s process ``attempt`` is gone: done, or dead. A handler that learns of
        its process's death late leaves a restarted one that has joined since alone."""
        with self.cond:
            if worker not in self.live or self.sessions.get(worker) != attempt:
                return
            requeued = self._drop(worker)
            if not died:  # it sends nothing more: a restored copy is not to wait for it
                self.applied_clock.pop(worker, None)
                self.applied_step.pop(worker, None)
            self._replicate()  # the backup's plan must not keep the lease out
            if died:
                append_event(self.run_dir, {"event": "worker_lost", "server": self.index,
                                            "worker": worker, "how": how,
                                            "requeued": requeued})  # fmt: skip
            self.cond.notify_all()
            if self.mode == "bsp":
                self._maybe_release()
                if self.coordinator is not None:
                    self._maybe_start()
            elif self.coordinator is not None:
                self._deal(-1)  # parked workers may now get the requeued samples, or the end

    def _commit(self, workers: list[int]) -> int:
        """Server 0, lock held: the leases of ``workers`` were applied; their samples are
        trained. Each goes into logs/ps_ledger.jsonl, the run's account of which samples
        were trained: a worker can die after its push was applied and before it wrote the
        step's record (a host powered off between the two), and its samples are trained
        all the same. Returns the samples committed."""
        if self.coordinator is None or self.ledger is None:
            return 0
        total = 0
        for worker in workers:
            lease = self.coordinator.leases.get(worker)
            if lease is None or not self.coordinator.commit(worker):
                continue
            total += len(lease.indices)
            line = {"worker": worker, "epoch": lease.epoch, "step": lease.step,
                    "sample_ids": list(lease.indices), "version": self.version,
                    "server_attempt": self.attempt,
                    "job_run": int(os.environ.get(env.JOB_RUN, 0))}  # fmt: skip
            if self.primary is None:
                self.ledger.write(line)
            else:  # once the backup holds the update (_replicate): else it may be lost
                self.unlogged.append(line)
        return total

    def _drop(self, worker: int) -> int:
        """Lock held: ``worker`` is no longer served; returns the samples requeued. A bsp
        worker that already pushed this step stays in it (its gradient is in the sum, and
        its lease is committed with the step)."""
        self.live.discard(worker)
        self.clocks.pop(worker, None)
        self.leases.pop(worker, None)
        if self.coordinator is None or worker in self.arrived:
            return 0
        return self.coordinator.requeue(worker)

    # -- data (server 0) -----------------------------------------------------------------
    def _start_timer(self) -> None:
        """bsp and ssp: go on without the workers that did not say hello in time: under bsp
        server 0 deals the first step and every server releases its barrier, under ssp the
        workers are no longer held for them (a restarted server waits briefly: the workers
        that are alive reconnect at once). One restored from its backup waits for every
        worker its slice had applied pushes of, unless that process is dead (or --timeout-s
        passes): going on without one that was late to reconnect (a store connection once took
        5 s in a storm of restarts) changed a bsp step, and with it the weights."""
        if self.members:
            deadline = time.monotonic() + self.cfg.launch.timeout_s
            while not self.stop.wait(0.02) and time.monotonic() < deadline:
                with self.cond:
                    missing = [w for w, a in self.members.items() if w not in self.hellos
                               and not self.store.check([wire.death_key(w, a)])]  # fmt: skip
                if not missing:
                    break
            grace = 0.0
        else:
            grace = self.cfg.launch.timeout_s if self.attempt == 0 else 2.0
        if not self.stop.wait(grace):
            with self.cond:
                self.start_forced = True
                if self.coordinator is not None:
                    self._maybe_start()
                self._maybe_release()
                self.cond.notify_all()

    def _maybe_start(self) -> None:
        """bsp, server 0, lock held: deal a step when none is in progress: the first step once
        every worker said hello, or a step for joiners when no live worker holds a lease."""
        if not self.live or self.arrived:
            return
        if not self.started:
            if len(self.hellos) < self.num_workers and not self.start_forced:
                return
            self.started = True
        if not any(w in self.leases for w in self.live):
            self._deal_step()

    def _deal_step(self) -> None:
        assert self.coordinator is not None
        dealt = self.coordinator.deal_step(sorted(self.live))
        for worker in self.live:
            lease = dealt[worker] if dealt else None
            self.leases[worker] = lease
            self.join_step[worker] = lease.step if lease else 0
        self.cond.notify_all()

    def _deal(self, worker: int) -> None:
        """asp/ssp, server 0, lock held: the worker's next lease, if there is one now."""
        assert self.coordinator is not None
        # This worker first, then any others waiting for data (a requeue) or for the end.
        waiting = [w for w in self.live if w != worker and w not in self.leases]
        for w in ([worker] if worker in self.live else []) + waiting:
            if self.leases.get(w) is not None:
                continue
            lease = self.coordinator.deal(w)
            if lease is not None or self.coordinator.finished():
                self.leases[w] = lease
        self.cond.notify_all()

    def _wait_lease(self, worker: int) -> None:
        while worker not in self.leases and not self.stop.is_set():
            self.cond.wait(0.5)
            if worker not in self.leases:
                self._deal(worker)

    # -- updates -------------------------------------------------------------------------
    def _push(self, worker: int, head: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        started = time.perf_counter()
        step, samples = int(head[wire.STEP]), int(head[wire.NUM_SAMPLES])
        with self.cond:
            if self.frozen:  # a cut (asp, ssp): held unless the cut holds this push
                self.cond.wait_for(lambda: self._may_apply(worker, int(head[wire.CLOCK])))
            if worker not in self.live:
                return self._dropped_reply()
            stale = rules.staleness(self.version, int(head[wire.VERSION_ON]))
            if self.mode == "bsp":
                return self._bsp_push(worker, step, samples, grad, started)
            push = (int(head[wire.ATTEMPT]), int(head[wire.CLOCK]))
            seen = self.applied_clock.get(worker)
            self.clocks[worker] = push[1]  # the worker's count, as every server's
            self.clock_moved[worker] = time.monotonic()
            if seen is not None and seen[0] == push[0] and seen[1] >= push[1]:
                # Sent again after a server died with it unanswered, and already applied
                # (before the death, on both copies of the slice): not applied twice.
                applied_factor, committed, stale = 1.0, True, 0
                self.resent_applied += 1
            elif self._foreign_lease(worker, step):
                return self._dropped_reply()
            else:
                applied_factor = self._apply(grad, staleness=stale)
                self.applied_clock[worker] = push
                committed = self._commit([worker]) > 0
                # After the commit: a checkpoint of this update holds its lease as trained
                # (before it, the lease was saved as out, and a restore trained it again).
                self._maybe_checkpoint()
                if self.coordinator is not None:
                    self.leases.pop(worker, None)
            self.cond.notify_all()
            if self.bound is not None:  # ssp: hold the reply while too far ahead
                self.cond.wait_for(
                    lambda: worker not in self.live or self.stop.is_set() or rules.may_proceed(
                        self.clocks[worker], self._ssp_clocks(), self.bound)
                )  # fmt: skip
            if self.coordinator is not None:
                self._deal(worker)
                self._wait_lease(worker)
            return self._reply(worker, started, staleness=stale, committed=committed,
                               lr_factor=applied_factor)  # fmt: skip

    def _apply(self, grad: torch.Tensor, staleness: int | None = None) -> float:
        """One update; the factor of --lr it was applied with. ``staleness``: None under bsp
        (a whole global step, fresh); under asp and ssp the push's, for the staleness rule's
        learning rate (consistency.py)."""
        self.watchdog.enter(self.version + 1, "apply")
        try:
            factor = self._apply_now(grad, staleness)
        finally:
            self.watchdog.enter(self.version, SelfWatchdog.IDLE)
        if self.restarted_idle:  # a restarted server's first update: its slice trains again
            self.restarted_idle = False
            event = {"event": "updated", "server": self.index, "version": self.version}
            append_event(self.run_dir, {**event, "attempt": self.attempt})
        return factor

    def _apply_now(self, grad: torch.Tensor, staleness: int | None) -> float:
        # kill:rank=R:step=S (and hang) fire at server rank R's S-th update.
        for fault in self.faults:
            fault.before_step(self.version + 1, self.rank, self.attempt)
        factor = 1.0
        if self.cfg.optim.lr_schedule != "constant" or self.cfg.optim.warmup_steps:
            factor = lr_factor(self.cfg.optim.lr_schedule, self.version, self.total_updates,
                               self.cfg.optim.warmup_steps)  # fmt: skip
        if staleness is not None:
            factor *= rules.staleness_lr_factor(self.cfg.ps.staleness_rule, staleness,
                                                self.num_workers)  # fmt: skip
        scale_lr(self.optimizer, factor)
        self.param.grad = grad
        if staleness is None and self.cfg.optim.clip_grad_norm > 0:
            # bsp: the step's aggregated gradient, as ddp clips its all-reduced one (one
            # server holds all of it: the checks refuse clipping over several).
            torch.nn.utils.clip_grad_norm_([self.param], self.cfg.optim.clip_grad_norm)
        self.optimizer.step()
        self.param.grad = None
        self.version += 1
        self.applied += 1
        if self.primary is not None:
            self.primary.applied(grad, factor)
        return factor

    def _bsp_push(self, worker: int, step: int, samples: int, grad: torch.Tensor,
                  started: float) -> list[torch.Tensor]:  # fmt: skip
        # A joiner's first step may come while this server still waits for the step before.
        self.cond.wait_for(lambda: not self.arrived or self.barrier_step >= step
                           or worker not in self.live)  # fmt: skip
        if self.applied_step.get(worker) == (self.sessions.get(worker), step):
            # Sent again after a server died with it unanswered, and already applied
            # (released before the death, on both copies of the slice): not applied twice.
            self.resent_applied += 1
            return self._reply(worker, started, staleness=0, committed=True,
                               lr_factor=self.released_lr_factor)  # fmt: skip
        if self._foreign_lease(worker, step):
            return self._dropped_reply()
        if worker in self.live and not self.arrived:
            self.barrier_step, self.barrier_opened = step, time.monotonic()
        if worker not in self.live or step != self.barrier_step:  # released without it
            self._drop(worker)
            return self._dropped_reply()
        if self.cfg.train.deterministic:
            self.barrier_grads[worker] = (grad.clone(), samples)
        else:
            self.barrier_sum.add_(grad, alpha=samples)
        self.barrier_samples += samples
        self.arrived.add(worker)
        self._maybe_release()
        self.cond.wait_for(lambda: self.released_step >= step or worker not in self.live)
        if self.released_step < step:
            return self._dropped_reply()
        return self._reply(worker, started, staleness=0, committed=True,
                           lr_factor=self.released_lr_factor)  # fmt: skip

    def _expected(self) -> set[int]:
        return {w for w in self.live if self.join_step.get(w, 0) <= self.barrier_step}

    def _ssp_clocks(self) -> list[int]:
        """Lock held: the clocks ssp bounds a worker by: the live workers', and at the start
        (until every worker of the job has joined, or the start's grace ran out) 0 for each
        that has not joined yet. Without those zeros the workers that imported torch first
        ran ahead of the bound before the last one had joined (a lead of 3 under
        --staleness 1, once the joins were spread by 50 ms)."""
        clocks = [self.clocks[w] for w in self.live]
        if self._awaiting_joins():
            clocks += [0] * (self.num_workers - len(self.hellos))
        return clocks

    def _awaiting_joins(self) -> bool:
        """bsp and ssp: whether some worker of the job has not joined this server yet, while it may
        still (the grace of ``_start_timer``). Every server, not only server 0, must wait
        for them: a worker that joined every server early and pushed its first step before
        the others had joined server k had that step released on server k alone, and the
        others' pushes of the same step then waited for it there until the barrier timeout
        (seen at 28 workers and 4 servers, where joins take seconds)."""
        return not self.start_forced and len(self.hellos) < self.num_workers

    def _maybe_release(self, timed_out: bool = False) -> None:
        """bsp, lock held: apply the open step once every expected worker has pushed (or,
        after the barrier timeout, without those that have not)."""
        if self.mode != "bsp" or not self.arrived:
            return
        missing = self._expected() - self.arrived
        if (missing or self._awaiting_joins()) and not timed_out:
            return
        for worker in missing:
            log.warning("dropping worker %d from step %d: silent for %.1f s", worker,
                        self.barrier_step, self.cfg.ps.barrier_timeout_s)  # fmt: skip
            self._drop(worker)
            append_event(self.run_dir, {"event": "worker_lost", "server": self.index,
                                        "worker": worker, "how": "barrier timeout"})  # fmt: skip
        for worker in sorted(self.barrier_grads):  # --deterministic: in worker order
            grad, samples = self.barrier_grads[worker]
            self.barrier_sum.add_(grad, alpha=samples)
        self.barrier_grads = {}
        if self.barrier_samples:
            self.released_lr_factor = self._apply(self.barrier_sum / self.barrier_samples)
        for worker in self.arrived:
            self.applied_step[worker] = (self.sessions.get(worker, -1), self.barrier_step)
        self._commit(sorted(self.arrived))
        self.released_step = self.barrier_step
        self._maybe_checkpoint()  # of the step as applied: its leases committed (as asp's)
        self.barrier_sum.zero_()
        self.barrier_samples = 0
        self.arrived = set()
        if self.coordinator is not None:
            self.leases = {}
            self._deal_step()
        self.cond.notify_all()

    def _barrier_watch(self) -> None:
        timeout = self.cfg.ps.barrier_timeout_s
        while not self.stop.wait(min(timeout / 4, 1.0)):
            with self.cond:
                if self.arrived and time.monotonic() - self.barrier_opened > timeout:
                    self._maybe_release(timed_out=True)

    def _bound_watch(self) -> None:
        """ssp: a worker that holds the others at the staleness bound and has not pushed for
        --hang-timeout-s (frozen, cut off, stuck where its own watchdog cannot see) is dropped
        from the bound, named in the log and events.jsonl, and its lease dealt to the others
        (it joins again if it comes back). Only while someone waits on it: a worker slower
        than the others moves its clock at every push."""
        timeout = self.cfg.hang_timeout_s
        while not self.stop.wait(min(timeout / 4, 1.0)):
            with self.cond:
                self._drop_silent(timeout)

    def _drop_silent(self, timeout: float) -> None:
        """Lock held: drop the slowest workers if they are silent and someone waits on them."""
        if self._awaiting_joins() or not self.live or self.bound is None:
            return
        slowest = min(self.clocks[w] for w in self.live)
        if max(self.clocks[w] for w in self.live) - slowest <= self.bound:
            return  # nobody waits
        now = time.monotonic()
        for worker in sorted(self.live):
            silent = now - self.clock_moved.get(worker, now)
            if self.clocks[worker] == slowest and silent > timeout:
                log.warning("dropping worker %d from the staleness bound: no push for %.1f s "
                            "(--hang-timeout-s %g) while others wait on it", worker, silent,
                            timeout)  # fmt: skip
                self._drop(worker)
                event = {"event": "worker_lost", "server": self.index, "worker": worker,
                         "how": "silent at the bound"}  # fmt: skip
                append_event(self.run_dir, event)
        self.cond.notify_all()

    def _dropped_reply(self) -> list[torch.Tensor]:
        """Every reply has the same shape; this one's payload is only there to be ignored."""
        out = [wire.reply_header(status=wire.Status.DROPPED, version=self.version),
               self.param.detach().clone()]  # fmt: skip
        if self.coordinator is not None:
            out.append(torch.full((self.cfg.samples_per_step,), -1, dtype=torch.int64))
        return out

    def _reply(self, worker: int, started: float, *, staleness: int, committed: bool,
               lr_factor: float = 1.0) -> list[torch.Tensor]:  # fmt: skip
        """Lock held: the reply to ``worker``; server 0's carries its next lease. The backup
        holds what it tells of first (--ps-replicas)."""
        self._replicate()
        self.loss.replied(worker)
        lease = self.leases.get(worker) if self.coordinator is not None else None
        end = self.coordinator is not None and lease is None
        head = wire.reply_header(
            status=wire.Status.END if end else wire.Status.OK,
            version=self.version,
            staleness=staleness,
            held_us=int((time.perf_counter() - started) * 1e6),
            lease_len=len(lease.indices) if lease else 0,
            lease_epoch=lease.epoch if lease else 0,
            lease_step=lease.step if lease else 0,
            committed=int(committed),
            lr_factor=wire.float_bits(lr_factor),
            clock=self.clocks.get(worker, 0),
        )
        out = [head, self.param.detach().clone()]
        if self.coordinator is not None:
            indices = torch.full((self.cfg.samples_per_step,), -1, dtype=torch.int64)
            if lease:
                indices[: len(lease.indices)] = torch.tensor(lease.indices)
            out.append(indices)
        return out


def _clone(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
