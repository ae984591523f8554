"""A parameter-server worker as a strategy of the one loop: pull the parameters, compute a
gradient on the leased batch, push it to every server, repeat until server 0 says the data is
done (its ``LeasePlan`` then deals no more steps).

Each step is one round trip per server, all servers at once: the worker sends every server
its slice of the gradient (non-blocking sends on separate links) and waits for all replies,
which carry the updated slices and, from server 0, the next lease. How long a reply is held
(a bsp barrier, an ssp bound) is ``wait_s``; the rest of the round trip is ``comm_s``.

A server that fails (its link raises, or the launcher says it died: transport.PeerDied) is
waited for: the worker polls the store until the server announces a new incarnation, then
joins it again. Under bsp a reply that says the
worker was dropped (it stayed silent past the barrier timeout) makes it join again.
Its metrics.jsonl record (one per push) carries ``committed`` (whether server 0 applied it:
only then did its samples train), ``staleness``: how many updates the servers applied
between the pull its gradient was computed on and its push (the largest over the servers),
and the worker's own ``clock``, ``started_at`` and ``pushed_at``.

The class-level checks are the parameter server's as a whole (world layout, join token).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from scaletrain import env
from scaletrain.config import RunConfig, parse_nnodes
from scaletrain.data.plans import BatchPlan, StepPlan, load_indices
from scaletrain.strategies.base import (
    Batch,
    LossFn,
    OptimizerFactory,
    StepResult,
    Strategy,
    model_bytes,
)
from scaletrain.strategies.param_server import keys
from scaletrain.strategies.param_server import transport as wire
from scaletrain.strategies.param_server.admission import JoinRefused, join_record
from scaletrain.strategies.param_server.consistency import shard_ranges, total_updates

log = logging.getLogger("scaletrain.ps.worker")


def connect_store(cfg: RunConfig) -> Any:
    """A client connection to the job's store (the launcher hosts it: launch/ps.py)."""
    from torch.distributed import TCPStore

    host, _, port = os.environ[env.PS_STORE].rpartition(":")
    return TCPStore(host, int(port), is_master=False,
                    timeout=datetime.timedelta(seconds=cfg.launch.timeout_s))  # fmt: skip


class ServerLost(RuntimeError):
    pass


class PSWorkerStrategy(Strategy):
    collective = "parameter-server push and pull"
    plan_collective = "parameter-server lease"  # a wait there is the servers' (ssp's bound)
    holds_final_model = False  # the servers hold it; the launcher assembles and scores it
    leaves_when_asked = True  # the servers checkpoint once every worker has left
    balance_refusal = (
        "asynchronous workers never wait for each other (asp, ssp); bsp deals leases of "
        "--batch-size each"
    )

    # -- the launcher's checks, for the parameter server as a whole ----------------------
    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        super().check_config(cfg, world_size, model)
        k = cfg.ps.num_servers
        lo, hi = parse_nnodes(cfg.launch.nnodes)
        if lo != hi:
            raise ValueError(
                f"nnodes: a parameter server job has a fixed set of processes; pass --nnodes N, "
                f"not {cfg.launch.nnodes!r}"
            )
        if hi > 1 and not (cfg.launch.join_token_file or os.environ.get(env.JOIN_TOKEN)):
            raise ValueError(
                "join token: a parameter server across nodes needs the same secret on every "
                f"node: --join-token-file PATH or ${env.JOIN_TOKEN} (otherwise each node draws "
                "its own and their processes cannot join each other)"
            )
        if cfg.optim.clip_grad_norm and cfg.ps.consistency == "bsp" and k > 1:
            raise ValueError(
                "clip_grad_norm: under --consistency bsp the servers clip the step's aggregated "
                "gradient by its norm, which with --num-servers > 1 is spread over servers "
                "that do not exchange norms; use --num-servers 1 to clip it, or asp/ssp, "
                "which clip each push"
            )
        if cfg.ps.ps_replicas and k < 2:
            raise ValueError(
                "ps_replicas: under --strategy ps a slice's backup lives on another server "
                "process; --num-servers 1 has none (give --num-servers 2 or more)"
            )
        if k >= world_size:
            raise ValueError(
                f"num_servers: {k} servers leave no worker in a world of {world_size} processes; "
                f"--nproc-per-node must be more than --num-servers (e.g. --nproc-per-node "
                f"{k + 2} --num-servers {k} gives 2 workers)"
            )

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        """The larger of a worker (a replica and its gradients) and a server (its slice, the
        optimizer state for it and a gradient buffer)."""
        total = model_bytes(model)
        server = -(-total // cfg.ps.num_servers) * (2 + optimizer_copies)
        return max(2 * total, server)

    # -- one worker ----------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.worker, self.attempt = ctx.rank, ctx.attempt
        self.num_workers = ctx.world_size - cfg.ps.num_servers
        self.store = connect_store(cfg)
        self.token = os.environ[env.JOIN_TOKEN]
        self.module, self.loss_fn = model, loss_fn
        self.params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype
        self.ranges = shard_ranges(self.numel, cfg.ps.num_servers)
        self.links: dict[int, wire.Link] = {}
        self.incarnation: dict[int, int] = {}
        self.versions = [0] * len(self.ranges)
        self.flat = torch.zeros(self.numel, dtype=self.dtype)
        self.lease: tuple[int, int, list[int]] | None = None  # (epoch, step, indices); None: end
        self.joined = False
        self.pushes = 0  # this attempt's
        # The ssp clock: pushes in the job, as every server holds this worker by it (None
        # until server 0's first reply gives it: a new worker starts level with the slowest).
        self.clock: int | None = None

    def new_store(self) -> Any:
        """A store connection per link (see server.py)."""
        return connect_store(self.cfg)

    def build_plan(self, dataset: Any) -> BatchPlan:
        return LeasePlan(self, dataset)

    @property
    def model(self) -> nn.Module:
        return self.module

    def eval_model(self) -> nn.Module:
        """The parameters of this worker's last pull."""
        torch.nn.utils.vector_to_parameters(self.flat.to(self.ctx.device), self.params)
        return self.module

    def state_dict(self) -> dict[str, Any]:
        return {}  # the servers hold the state; a restarted worker pulls it again

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def memory_bytes(self) -> dict[str, int]:
        size = self.numel * self.flat.element_size()
        return {"param_bytes": size, "grad_bytes": size, "optimizer_bytes": 0}

    # -- connections ---------------------------------------------------------------------
    def _link(self, k: int) -> wire.Link:
        """A new link to server ``k``'s current incarnation (waiting for a restarted one)."""
        inc = self._await_incarnation(k)
        # Tried: if it dies before the link is made, the next attempt waits for its successor.
        self.incarnation[k] = inc
        peer = (self.num_workers + k, inc)
        host = keys.server_host(k, inc)  # the process serving it (a backup's, taken over)
        if self.store.check([host]):
            rank, attempt = self.store.get(host).decode().split(".")
            peer = (int(rank), int(attempt))
        scope = keys.server_scope(k, inc)
        base = f"{scope}/joins"
        n = self.store.add(f"{base}/count", 1)
        self.store.set(f"{base}/{n}", join_record(self.token, scope, self.worker, self.attempt))
        self._await_answer(f"{base}/{n}/answer", peer)
        answer = self.store.get(f"{base}/{n}/answer").decode()
        if answer != "ok":
            raise JoinRefused(
                f"server {k} {answer}: this worker's SCALETRAIN_JOIN_TOKEN is not the servers' "
                "(give every node the same --join-token-file)"
            )
        try:
            link = wire.Link(self.new_store(), keys.worker_link(k, inc, self.worker, self.attempt),
                           server_side=False, timeout_s=self.cfg.launch.timeout_s,
                           peer=peer)  # fmt: skip
        except wire.PeerDied:
            raise
        except RuntimeError as e:
            # Gloo gave up connecting ("Connection refused"): the server may have died before
            # its launcher said so. Its death notice then follows within moments.
            if self._death_said(peer, 2.0):
                raise wire.PeerDied(f"server {k} died while its link was made") from e
            raise
        self.links[k] = link
        return link

    def _death_said(self, peer: tuple[int, int], within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while not self.store.check([wire.death_key(*peer)]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _await_answer(self, key: str, peer: tuple[int, int]) -> None:
        """Until the server has answered a join (``key``), or PeerDied once the launcher
        says it died first (it was waited for until the store's timeout)."""
        dead = wire.death_key(*peer)
        while not self.store.check([key]):
            if self.store.check([dead]):
                raise wire.PeerDied(f"server rank {peer[0]} died before it answered the join")
            time.sleep(0.01)

    def _await_incarnation(self, k: int) -> int:
        """Server ``k``'s incarnation to join: its first, or the one after the incarnation
        that failed. The first is waited for without a clock: the server is starting as this
        worker did (imports, the task), and on a loaded host that can take longer than
        --timeout-s; if it dies, the launcher restarts it or ends the job, and this worker
        with it. A restarted one must come back within --timeout-s."""
        key = keys.incarnation(k)
        failed = self.incarnation.get(k)
        deadline = time.monotonic() + self.cfg.launch.timeout_s
        while True:
            if self.store.check([key]):
                inc = int(self.store.get(key))
                if inc != failed:
                    return inc
            if failed is not None and time.monotonic() > deadline:
                raise ServerLost(f"server {k} did not come back within --timeout-s")
            time.sleep(0.05)

    def _hello(self, k: int, step: int) -> torch.Tensor:
        """Join server ``k`` (again): returns its reply header, parameters loaded."""
        while True:
            try:
                link = self.links.get(k) or self._link(k)
            except wire.PeerDied as e:  # it died while admitting this worker: its successor
                log.warning("server %d lost during its join: %s", k, e)
                continue
            try:
                # version_on: the last version this worker saw of the slice (a restarted
                # server counts what it lost of it: exposure.py).
                link.send(wire.header(kind=wire.Kind.HELLO, step=step, worker=self.worker,
                                    attempt=self.attempt, version_on=self.versions[k],
                                    clock=-1 if self.clock is None else self.clock))  # fmt: skip
                return self._receive(k)
            except RuntimeError as e:
                log.warning("server %d lost during hello: %s", k, str(e).splitlines()[0][:160])
                self._drop_link(k)

    def _drop_link(self, k: int) -> None:
        link = self.links.pop(k, None)
        if link is not None:
            link.close()

    def _join(self) -> None:
        """Join every server: server 0 first (it deals the lease whose step the others need)."""
        self._hello(0, 0)
        step = self.lease[1] if self.lease else 0
        for k in range(1, len(self.ranges)):
            self._hello(k, step)

    def _buffers(self, k: int) -> list[torch.Tensor]:
        lo, hi = self.ranges[k]
        out = [torch.zeros(wire.HEADER, dtype=torch.int64), self.flat[lo:hi]]
        if k == 0:
            out.append(torch.zeros(self.cfg.samples_per_step, dtype=torch.int64))
        return out

    def _receive(self, k: int) -> torch.Tensor:
        bufs = self._buffers(k)
        self.links[k].recv(*bufs)
        return self._accept_reply(k, bufs)

    def _accept_reply(self, k: int, bufs: list[torch.Tensor]) -> torch.Tensor:
        head = bufs[0]
        self.versions[k] = int(head[wire.VERSION])
        if k == 0:
            if self.clock is None:
                self.clock = int(head[wire.REPLY_CLOCK])
            if int(head[wire.STATUS]) == wire.Status.END:
                self.lease = None
            elif int(head[wire.STATUS]) == wire.Status.OK:
                n = int(head[wire.LEASE_LEN])
                self.lease = (int(head[wire.LEASE_EPOCH]), int(head[wire.LEASE_STEP]),
                              bufs[2][:n].tolist())  # fmt: skip
        return head

    # -- the step ------------------------------------------------------------------------
    def join(self) -> None:
        """Join every server once, before the first step (it deals the first lease)."""
        if not self.joined:
            self._join()
            self.joined = True

    def _gradient(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """The flat gradient of the mean loss over the batch (zeros and no loss when empty).
        --clip-grad-norm under asp and ssp clips each push (each is its own update on the
        servers, so its own gradient's norm bounds the update); under bsp the server clips
        the step's aggregated gradient instead, as ddp does (server.py)."""
        if not batch.num_samples:
            return torch.zeros(self.numel, dtype=self.dtype), None, {}
        torch.nn.utils.vector_to_parameters(self.flat.to(self.ctx.device), self.params)
        self.module.zero_grad(set_to_none=True)
        loss = self.forward_backward(
            self.module, self.loss_fn, batch.inputs, batch.targets, batch.num_samples
        )
        extras: dict[str, Any] = {}
        if self.cfg.optim.clip_grad_norm > 0 and self.cfg.ps.consistency != "bsp":
            held = [p for p in self.params if p.grad is not None]
            extras["grad_norm"] = self.clip_gradients(held, self.cfg.optim.clip_grad_norm)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.reshape(-1) for g in grads]).cpu(), loss, extras

    def train_step(self, batch: Batch) -> StepResult:
        assert self.lease is not None
        _, step, _ = self.lease
        assert self.clock is not None  # set by server 0's reply to the first hello
        self.pushes += 1
        self.clock += 1  # this push made; a server that loses it learns the clock on rejoin
        t0, started_at = time.perf_counter(), time.time()
        grad, loss, clipped = self._gradient(batch)
        compute_s = time.perf_counter() - t0
        t1, pushed_at = time.perf_counter(), time.time()
        heads, lost = self._exchange(step, batch.num_samples, grad)
        round_s = time.perf_counter() - t1
        held_s = max((int(h[wire.HELD_US]) for h in heads.values()), default=0) / 1e6
        dropped = any(int(h[wire.STATUS]) == wire.Status.DROPPED for h in heads.values())
        committed = 0 in heads and bool(int(heads[0][wire.COMMITTED]))
        if dropped:  # bsp: the barrier went on without this worker: join it again
            log.warning("dropped from step %d; joining again", step)
            self.lease = None  # server 0 deals a new one on the rejoin
            self._join()
        else:
            next_step = self.lease[1] if self.lease else 0
            for k in lost:  # a restarted server: join its new incarnation
                self._hello(k, next_step)
        factor = wire.bits_float(int(heads[0][wire.LR_FACTOR])) if 0 in heads else None
        return StepResult(
            loss=loss if loss is not None else torch.zeros(()),
            compute_s=compute_s,
            comm_s=max(round_s - held_s, 0.0),
            wait_s=held_s,
            comm_bytes=grad.numel() * grad.element_size(),
            # A push server 0 did not apply trained nothing (its lease is dealt again).
            samples=batch.num_samples if committed else 0,
            overlap=0.0,  # a blocking round trip
            extras={
                "staleness": max((int(h[wire.STALENESS]) for h in heads.values()), default=0),
                # The lr this push was applied with (server 0's: the servers' rules agree
                # but for their own staleness), and the factor of --lr it is.
                "lr_factor": factor,
                "lr": None if factor is None else self.cfg.optim.lr * factor,
                "version": self.versions[0],
                # This worker's own clock (pushes so far, this attempt) and when it began
                # computing the step and pushed it: enough to check ssp's bound from outside.
                "clock": self.pushes,
                "started_at": started_at,
                "pushed_at": pushed_at,
                "committed": committed,
                **clipped,
            },
        )

    def finish(self) -> None:
        """Tell every server this worker is done (its lease, if it holds one, is dealt
        again: a preempted worker leaves between steps) and close the links."""
        for k, link in self.links.items():
            try:
                link.send(wire.header(kind=wire.Kind.DONE, worker=self.worker))
            except RuntimeError:
                log.warning("server %d gone at the end", k)
            link.close()
        self.links = {}

    def close(self) -> None:
        """Leaving before the end (preempted: lifecycle.FleetWorld.preempted): done, too."""
        self.finish()

    def _exchange(
        self, step: int, num_samples: int, grad: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Push every server its gradient slice and take every reply, all at once. Returns
        the reply headers and the servers lost on the way (their slice was not applied)."""
        head = wire.header(kind=wire.Kind.PUSH, step=step, num_samples=num_samples,
                         worker=self.worker, attempt=self.attempt,
                         clock=self.clock or 0)  # fmt: skip
        pending: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        lost: list[int] = []
        sent: dict[int, torch.Tensor] = {}
        for k, (lo, hi) in enumerate(self.ranges):
            h = sent[k] = head.clone()
            h[wire.VERSION_ON] = self.versions[k]
            bufs = self._buffers(k)
            try:
                works = self.links[k].isend(h, grad[lo:hi]) + self.links[k].irecv(*bufs)
            except RuntimeError as e:
                log.warning("server %d lost: %s", k, str(e).splitlines()[0][:160])
                lost.append(k)
                continue
            pending[k] = (works, bufs)
        heads = {}
        for k, (works, bufs) in pending.items():
            try:
                self.links[k].wait(works)
            except RuntimeError as e:
                log.warning("server %d lost: %s", k, str(e).splitlines()[0][:160])
                lost.append(k)
                continue
            heads[k] = self._accept_reply(k, bufs)
        for k in lost:
            self._drop_link(k)
        if self.cfg.ps.ps_replicas:  # its restarted server has every push but this one
            for k in lost:
                heads[k] = self._push_again(k, step, sent[k], grad)
            return heads, []
        if 0 in lost:  # server 0 lost the push with the lease: it deals a new one on rejoin
            self.lease = None
            self._hello(0, 0)
            lost.remove(0)
        return heads, lost

    def _push_again(
        self, k: int, step: int, head: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor:
        """--ps-replicas: server ``k`` died with this push unanswered. Its restarted process
        holds every push acknowledged before (from the backup); send this one again: it is
        applied once (the server knows whether it was, from the push's attempt and clock or
        step). Server 0 replies with the lease this worker goes on with."""
        lo, hi = self.ranges[k]
        while True:
            self._hello(k, step)
            bufs = self._buffers(k)
            try:
                self.links[k].send(head, grad[lo:hi])
                self.links[k].recv(*bufs)
            except RuntimeError as e:
                log.warning("server %d lost again: %s", k, str(e).splitlines()[0][:160])
                self._drop_link(k)
                continue
            return self._accept_reply(k, bufs)


class LeasePlan(BatchPlan):
    """The batches server 0 leases to this worker: each reply carries the next lease."""

    def __init__(self, strategy: PSWorkerStrategy, dataset: Any) -> None:
        self.strategy, self.dataset, self.cfg = strategy, dataset, strategy.cfg

    def next_step(self, progress: Any) -> StepPlan | None:
        self.strategy.join()
        lease = self.strategy.lease
        if lease is None:  # server 0 says the data is done
            return None
        epoch, step, indices = lease
        return StepPlan(step=step, epoch=epoch, indices=indices, num_samples=len(indices),
                        global_samples=len(indices))  # fmt: skip

    def load(self, plan: StepPlan) -> tuple[Any, Any]:
        if not plan.indices:
            return None, None
        return load_indices(self.dataset, plan.indices, self.strategy.ctx.device)

    def commit(self, plan: StepPlan) -> None:
        return None  # server 0 commits (or requeues) the lease

    def total_steps(self, progress: Any) -> int:
        return total_updates(self.cfg, len(self.dataset), self.strategy.num_workers)
