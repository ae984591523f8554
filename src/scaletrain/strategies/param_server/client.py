"""One parameter-server worker: pull the parameters, compute a gradient on the leased batch,
push it to every server, repeat until server 0 says the data is done.

Each step is one round trip per server, all servers at once: the worker sends every server
its slice of the gradient (non-blocking sends on separate links) and waits for all replies,
which carry the updated slices and, from server 0, the next lease. How long a reply is held
(a bsp barrier, an ssp bound) is ``wait_s``; the rest of the round trip is ``comm_s``.

A server that fails (its link raises) is waited for: the worker polls the store until the
server announces a new incarnation, then joins it again. Under bsp a reply that says the
worker was dropped (it stayed silent past the barrier timeout) makes it join again.
Its metrics.jsonl record (one per applied push) carries ``staleness``: how many updates the
servers applied between the pull its gradient was computed on and its push (the largest over
the servers), and the worker's own ``clock``, ``started_at`` and ``pushed_at``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from scaletrain import __version__
from scaletrain.config import RunConfig
from scaletrain.fault.checkpoint import atomic_write_json
from scaletrain.fault.inject import parse_inject
from scaletrain.metrics.sinks import StepSinks
from scaletrain.metrics.summary import RankTotals, peak_rss_bytes
from scaletrain.strategies.param_server import transport as tp
from scaletrain.strategies.param_server.admission import JoinRefused, join_record
from scaletrain.strategies.param_server.consistency import shard_ranges
from scaletrain.task import Task

log = logging.getLogger("scaletrain.ps.worker")


class ServerLost(RuntimeError):
    pass


class PSWorker:
    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        run_dir: Path,
        *,
        worker: int,
        num_workers: int,
        attempt: int,
        store: Any,
        new_store: Callable[[], Any],
        device: torch.device,
        token: str,
    ) -> None:
        self.cfg, self.task, self.run_dir, self.device = cfg, task, run_dir, device
        self.worker, self.num_workers, self.attempt, self.store = (
            worker,
            num_workers,
            attempt,
            store,
        )
        self.new_store = new_store  # a store connection per link (see server.py)
        self.token = token
        self.model = task.model.to(device)
        self.params = [p for p in self.model.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype
        self.ranges = shard_ranges(self.numel, cfg.ps.num_servers)
        self.links: dict[int, tp.Link] = {}
        self.incarnation: dict[int, int] = {}
        self.versions = [0] * len(self.ranges)
        self.flat = torch.zeros(self.numel, dtype=self.dtype)
        self.lease: tuple[int, int, list[int]] | None = None  # (epoch, step, indices); None: end
        self.faults = parse_inject(cfg.fault.inject)
        self.totals = RankTotals(rank=worker)
        self.local_step = 0

    # -- connections ---------------------------------------------------------------------
    def _link(self, k: int) -> tp.Link:
        """A new link to server ``k``'s current incarnation (waiting for a restarted one)."""
        key = f"ps/server{k}/incarnation"
        self.store.wait([key])
        deadline = time.monotonic() + self.cfg.launch.timeout_s
        inc = int(self.store.get(key))
        while inc == self.incarnation.get(k, -1):  # the one that failed: wait for the next
            if time.monotonic() > deadline:
                raise ServerLost(f"server {k} did not come back within --timeout-s")
            time.sleep(0.1)
            inc = int(self.store.get(key))
        scope = f"ps/server{k}.{inc}"
        base = f"{scope}/joins"
        n = self.store.add(f"{base}/count", 1)
        self.store.set(f"{base}/{n}", join_record(self.token, scope, self.worker, self.attempt))
        self.store.wait([f"{base}/{n}/answer"])
        answer = self.store.get(f"{base}/{n}/answer").decode()
        if answer != "ok":
            raise JoinRefused(
                f"server {k} {answer}: this worker's SCALETRAIN_JOIN_TOKEN is not the servers' "
                "(give every node the same --join-token-file)"
            )
        link = tp.Link(self.new_store(), f"ps/link/s{k}.{inc}/w{self.worker}.{self.attempt}",
                       server_side=False, timeout_s=self.cfg.launch.timeout_s)  # fmt: skip
        self.incarnation[k], self.links[k] = inc, link
        return link

    def _hello(self, k: int, step: int) -> torch.Tensor:
        """Join server ``k`` (again): returns its reply header, parameters loaded."""
        while True:
            link = self.links.get(k) or self._link(k)
            try:
                link.send(tp.header(kind=tp.Kind.HELLO, step=step, worker=self.worker,
                                    attempt=self.attempt))  # fmt: skip
                return self._receive(k)
            except RuntimeError as e:
                log.warning("server %d lost during hello: %s", k, str(e).splitlines()[0][:160])
                self.links.pop(k, None)

    def _join(self) -> None:
        """Join every server: server 0 first (it deals the lease whose step the others need)."""
        self._hello(0, 0)
        step = self.lease[1] if self.lease else 0
        for k in range(1, len(self.ranges)):
            self._hello(k, step)

    def _buffers(self, k: int) -> list[torch.Tensor]:
        lo, hi = self.ranges[k]
        out = [torch.zeros(tp.HEADER, dtype=torch.int64), self.flat[lo:hi]]
        if k == 0:
            out.append(torch.zeros(self.cfg.train.batch_size, dtype=torch.int64))
        return out

    def _receive(self, k: int) -> torch.Tensor:
        bufs = self._buffers(k)
        self.links[k].recv(*bufs)
        return self._accept_reply(k, bufs)

    def _accept_reply(self, k: int, bufs: list[torch.Tensor]) -> torch.Tensor:
        head = bufs[0]
        self.versions[k] = int(head[tp.VERSION])
        if k == 0:
            if int(head[tp.STATUS]) == tp.Status.END:
                self.lease = None
            elif int(head[tp.STATUS]) == tp.Status.OK:
                n = int(head[tp.LEASE_LEN])
                self.lease = (int(head[tp.LEASE_EPOCH]), int(head[tp.LEASE_STEP]),
                              bufs[2][:n].tolist())  # fmt: skip
        return head

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> None:
        sink = StepSinks(self.run_dir, self.worker)
        start = time.perf_counter()
        self._join()
        try:
            while self.lease is not None:
                self._step(start, sink)
        finally:
            sink.close()
        for k, link in self.links.items():
            try:
                link.send(tp.header(kind=tp.Kind.DONE, worker=self.worker))
            except RuntimeError:
                log.warning("server %d gone at the end", k)
        self._finish(time.perf_counter() - start)

    def _load(self, indices: list[int]) -> tuple[Any, Any]:
        from scaletrain.trainer import make_loader, to_device

        loader = make_loader(Subset(self.task.train_data, indices), cuda=False,
                             batch_size=len(indices))  # fmt: skip
        inputs, targets = next(iter(loader))
        return to_device(inputs, self.device), to_device(targets, self.device)

    def _gradient(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """The flat gradient of the mean loss over ``indices`` (zeros and no loss when empty)."""
        if not indices:
            return torch.zeros(self.numel, dtype=self.dtype), None, 0.0
        t0 = time.perf_counter()
        inputs, targets = self._load(indices)
        data_s = time.perf_counter() - t0
        torch.nn.utils.vector_to_parameters(self.flat.to(self.device), self.params)
        self.model.zero_grad(set_to_none=True)
        loss = self.task.loss_fn(self.model(inputs), targets)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.reshape(-1) for g in grads]).cpu(), loss.detach(), data_s

    def _step(self, start: float, sink: StepSinks) -> None:
        assert self.lease is not None
        epoch, step, indices = self.lease
        self.local_step += 1
        for fault in self.faults:
            fault.before_step(self.local_step, self.worker, self.attempt)
        t0, started_at = time.perf_counter(), time.time()
        grad, loss, data_s = self._gradient(indices)
        compute_s = time.perf_counter() - t0 - data_s
        compute_s += sum(f.after_step(self.local_step, self.worker, self.attempt, compute_s)
                         for f in self.faults)  # fmt: skip
        t1, pushed_at = time.perf_counter(), time.time()
        heads, lost = self._exchange(step, len(indices), grad)
        round_s = time.perf_counter() - t1
        held_s = max((int(h[tp.HELD_US]) for h in heads.values()), default=0) / 1e6
        dropped = any(int(h[tp.STATUS]) == tp.Status.DROPPED for h in heads.values())
        committed = 0 in heads and bool(int(heads[0][tp.COMMITTED]))
        if dropped:  # bsp: the barrier went on without this worker: join it again
            log.warning("dropped from step %d; joining again", step)
            self.lease = None  # server 0 deals a new one on the rejoin
            self._join()
        else:
            next_step = self.lease[1] if self.lease else 0
            for k in lost:  # a restarted server: join its new incarnation
                self._hello(k, next_step)
        samples = len(indices) if committed else 0
        record: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "rank": self.worker,
            "attempt": self.attempt,
            "samples": samples,
            "global_samples": samples,
            "loss": loss.item() if loss is not None and samples else None,
            "step_s": time.perf_counter() - t0,
            "compute_s": compute_s,
            "comm_s": max(round_s - held_s, 0.0),
            "wait_s": held_s,
            "data_s": data_s,
            "checkpoint_s": 0.0,
            "overlap": 0.0,
            "comm_bytes": grad.numel() * grad.element_size(),
            "dense_bytes": grad.numel() * grad.element_size(),
            "staleness": max((int(h[tp.STALENESS]) for h in heads.values()), default=0),
            "version": self.versions[0],
            # This worker's own clock (pushes so far, this attempt) and when it began
            # computing the step and pushed it: enough to check ssp's bound from outside.
            "clock": self.local_step,
            "started_at": started_at,
            "pushed_at": pushed_at,
            "committed": committed,
            "time_s": time.perf_counter() - start,
            "unix_time": time.time(),
            "total_steps": self._total_steps(),
        }
        if self.cfg.fault.log_sample_ids:
            record["sample_ids"] = indices if committed else []
        sink.write(record)
        if committed:
            self.totals.add(record)

    def _exchange(
        self, step: int, num_samples: int, grad: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Push every server its gradient slice and take every reply, all at once. Returns
        the reply headers and the servers lost on the way (their slice was not applied)."""
        head = tp.header(kind=tp.Kind.PUSH, step=step, num_samples=num_samples,
                         worker=self.worker, attempt=self.attempt)  # fmt: skip
        pending: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        lost: list[int] = []
        for k, (lo, hi) in enumerate(self.ranges):
            h = head.clone()
            h[tp.VERSION_ON] = self.versions[k]
            bufs = self._buffers(k)
            try:
                works = self.links[k].isend(h, grad[lo:hi]) + self.links[k].irecv(*bufs)
            except RuntimeError:
                lost.append(k)
                continue
            pending[k] = (works, bufs)
        heads = {}
        for k, (works, bufs) in pending.items():
            try:
                for work in works:
                    work.wait()
            except RuntimeError as e:
                log.warning("server %d lost: %s", k, str(e).splitlines()[0][:160])
                lost.append(k)
                continue
            heads[k] = self._accept_reply(k, bufs)
        for k in lost:
            self.links.pop(k, None)
        if 0 in lost:  # server 0 lost the push with the lease: it deals a new one on rejoin
            self.lease = None
            self._hello(0, 0)
            lost.remove(0)
        return heads, lost

    def _total_steps(self) -> int:
        n, b, w = len(self.task.train_data), self.cfg.train.batch_size, self.num_workers  # type: ignore[arg-type]
        if self.cfg.ps.consistency == "bsp":
            per_epoch = n // (b * w) if self.cfg.train.drop_last else -(-n // (b * w))
            cap = self.cfg.train.max_steps
        else:
            per_epoch = n // b if self.cfg.train.drop_last else -(-n // b)
            cap = self.cfg.train.max_steps * w
        total = per_epoch * self.cfg.train.epochs
        return min(total, cap) if cap else total

    def _finish(self, wall_s: float) -> None:
        self.totals.peak_rss_bytes = peak_rss_bytes()
        self.totals.memory = {
            "param_bytes": self.numel * self.flat.element_size(),
            "grad_bytes": self.numel * self.flat.element_size(),
            "optimizer_bytes": 0,
        }
        final = self.run_dir / "logs" / "final"
        final.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            final / f"worker{self.worker}.json",
            {
                "totals": self.totals.__dict__,
                "wall_s": wall_s,
                "attempt": self.attempt,
                "device": self.device.type,
                "torch_version": torch.__version__,
                "scaletrain_version": __version__,
            },
        )
