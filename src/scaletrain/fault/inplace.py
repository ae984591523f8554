"""In-place recovery (``--recovery inplace``), worker side: when a worker dies the others keep
training from their current state, with no restart and no rollback to a checkpoint; a
restarted or new worker joins at a step boundary and copies the state from a live peer.

Built on torchft (pytorch/torchft): a lighthouse (hosted by the launcher, fault/supervisor.py)
forms a quorum of live replicas before every step; each worker is a replica of its own with a
torchft ``Manager`` and a reconfigurable gloo process group that the manager rebuilds whenever
the membership changes. A replica behind the quorum's step heals before the step: the manager
fetches the state registered here (model, optimizer, sampler cursor, progress) from a peer
over HTTP. We use torchft instead of a quorum protocol of our own: its quorum, heartbeats,
process-group reconfiguration and healing did exactly this in a probe on this stack
(torch 2.13 CPU, torchft 0.2), and a second implementation of membership agreement is where
split brains come from.

What torchft's own sampler does not do, this loop does: the data cursor commits with the
step. Each step takes the next ``batch_size x participants`` samples of the epoch's global
order (sampler.py) and splits them over the step's participants by their quorum rank; the
gradient is the sample-weighted mean over them (each rank scales its mean loss by
``n_r x participants / N``, then the manager averages). Only when every participant commits
(``should_commit``) does the optimizer step and the cursor advance. A step that fails (a peer
died mid all-reduce) is not applied, and its samples are re-split over the survivors at the
next step: every sample is trained on exactly once per epoch, also across failures.
The global batch follows the membership (the per-worker batch is kept); the learning rate is
not rescaled.

Each worker appends its steps to metrics.jsonl (with ``participants`` and ``quorum_s``, the
time the step waited for its quorum) and at the end writes ``logs/final/replica<R>.json``;
the launcher builds summary.json from those and its own record of deaths and restarts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from scaletrain import __version__
from scaletrain.config import RunConfig
from scaletrain.data.partition import rank_indices, split_counts
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.fault.checkpoint import atomic_torch_save, atomic_write_json
from scaletrain.fault.inject import parse_inject
from scaletrain.metrics.sinks import StepSinks
from scaletrain.metrics.summary import RankTotals, params_sha256, peak_rss_bytes
from scaletrain.rendezvous import bound_store
from scaletrain.runtime import pick_device
from scaletrain.task import Task, build_optimizer

log = logging.getLogger("scaletrain.inplace")

LIGHTHOUSE_ENV = "SCALETRAIN_LIGHTHOUSE"
# This node's address: where a replica's store, manager and checkpoint server listen, and what
# they tell the others (the supervisor sets it; 127.0.0.1 on one node).
ADDR_ENV = "SCALETRAIN_ADDR"


def url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def bound_checkpoint_transport(addr: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server (healing copies the state through it), listening on
    ``addr`` and advertising it. torchft's own listens on every interface ([::]) and
    advertises socket.gethostname(), which need not resolve to this host elsewhere (it does
    not inside a network namespace). This and manager_server_bound_to reach into torchft
    0.2.0's internals (constraints/cpu.txt pins it); tests/e2e/test_netns.py checks with ss
    that nothing listens elsewhere, so a torchft that changes them fails there, loudly."""
    import socket
    import threading
    from http.server import ThreadingHTTPServer

    from torchft.checkpointing.http_transport import HTTPTransport

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

    class BoundTransport(HTTPTransport[dict[str, Any]]):
        def __init__(self) -> None:
            super().__init__(timeout=timeout, num_chunks=0)
            handler = self._server.RequestHandlerClass  # type: ignore[has-type]
            self.shutdown()  # the one on [::], before anyone learnt its address
            self._server = Server((addr.strip("[]"), 0), handler)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{url_host(addr)}:{port}/checkpoint/"

    return BoundTransport()


@contextlib.contextmanager
def manager_server_bound_to(addr: str) -> Iterator[None]:
    """torchft's Manager starts its ManagerServer on ``[::]:PORT`` (hard-coded); this makes it
    listen on ``addr`` instead, while the Manager is built."""
    import torchft.manager as torchft_manager

    real = torchft_manager.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        return real(*args, bind=f"{url_host(addr)}:{bind.rpartition(':')[2]}", **kwargs)

    torchft_manager.ManagerServer = bound  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torchft_manager.ManagerServer = real  # type: ignore[misc]


def wait_for_peers(run_dir: Path, rank: int, world: int, timeout_s: float) -> None:
    """First start only: every replica announces itself and waits for all, so the first step
    runs with all of them instead of with whichever imported torch first."""
    ready = run_dir / "logs" / "ready"
    ready.mkdir(parents=True, exist_ok=True)
    (ready / f"replica{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(ready.iterdir())) < world and time.monotonic() < deadline:
        time.sleep(0.05)


class InplaceTrainer:
    def __init__(self, cfg: RunConfig, task: Task, run_dir: Path) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.cfg, self.task, self.run_dir = cfg, task, run_dir
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
        self.model = task.model.to(self.device)
        self.optimizer = build_optimizer(task, self.model.parameters(), cfg)
        self.sampler = GlobalBatchSampler(
            len(task.train_data),  # type: ignore[arg-type]
            world_size=self.world,
            rank=self.rank,
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            drop_last=cfg.train.drop_last,
            shard_sizes=getattr(task.train_data, "shard_sizes", None),
        )
        self.progress = {"step": 0, "epoch": 0, "samples_trained": 0}
        self.faults = parse_inject(cfg.fault.inject)
        self.totals = RankTotals(rank=self.rank)
        timeout = timedelta(seconds=cfg.fault.hang_timeout_s or cfg.launch.timeout_s / 2)
        # This replica's own store (a group of one): torchft keeps its process-group
        # rendezvous keys there.
        addr = os.environ.get(ADDR_ENV, "127.0.0.1")
        self.store, self._listener = bound_store(addr, 0, cfg.launch.timeout_s)
        with manager_server_bound_to(addr):
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=1,
                use_async_quorum=False,  # the step's membership decides its data split
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.launch.timeout_s),
                connect_timeout=timedelta(seconds=cfg.launch.timeout_s),
                rank=0,
                world_size=1,
                store_addr=addr,
                store_port=self.store.port,
                lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
                replica_id=f"replica{self.rank}",
                hostname=url_host(addr),
                checkpoint_transport=bound_checkpoint_transport(addr, timeout),
                heartbeat_interval=timedelta(milliseconds=100),
            )

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "progress": dict(self.progress),
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.progress = dict(state["progress"])
        log.info("healed from a peer at step %d", self.progress["step"])

    def _done(self) -> bool:
        max_steps = self.cfg.train.max_steps
        return self.progress["epoch"] >= self.cfg.train.epochs or bool(
            max_steps and self.progress["step"] >= max_steps
        )

    def _run_ended(self) -> bool:
        """A replica that restarts after the others finished must not train the run again
        alone: their final reports say it is over."""
        final = self.run_dir / "logs" / "final"
        return final.is_dir() and any(final.iterdir())

    def _total_steps(self) -> int:
        """Where the run ends, as planned with this step's membership."""
        later = self.cfg.train.epochs - self.progress["epoch"] - 1
        steps = (self.progress["step"] + len(self.sampler.bounds())
                 + later * self.sampler.steps_per_epoch())  # fmt: skip
        max_steps = self.cfg.train.max_steps
        return min(steps, max_steps) if max_steps else steps

    def _load(self, indices: list[int]) -> tuple[Any, Any]:
        from scaletrain.trainer import make_loader, to_device

        loader = make_loader(Subset(self.task.train_data, indices), cuda=False,
                             batch_size=len(indices))  # fmt: skip
        inputs, targets = next(iter(loader))
        return to_device(inputs, self.device), to_device(targets, self.device)

    def fit(self) -> None:
        if self.attempt == 0:
            wait_for_peers(self.run_dir, self.rank, self.world, self.cfg.launch.timeout_s)
        sink = StepSinks(self.run_dir, self.rank)
        start = time.perf_counter()
        params = [p for p in self.model.parameters() if p.requires_grad]
        try:
            while not self._done():
                if self._run_ended():
                    log.info("the other replicas finished the run before this one rejoined")
                    return
                self._step(start, sink, params)
        finally:
            sink.close()
        self._finish(time.perf_counter() - start)
        self.manager.shutdown(wait=False)

    def _step(self, start: float, sink: StepSinks, params: list[torch.nn.Parameter]) -> None:
        step = self.progress["step"] + 1
        for fault in self.faults:
            fault.before_step(step, self.rank, self.attempt)
        t0 = time.perf_counter()
        self.manager.start_quorum()  # heals first if this replica is behind
        quorum_s = time.perf_counter() - t0
        if self._done() or self._run_ended():  # healed into a finished run, or came too late
            return
        step = self.progress["step"] + 1  # healing may have moved it
        n, rank = self.manager.num_participants(), self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum leaves every replica participating"
        self.sampler.set_epoch(self.progress["epoch"])
        self.sampler.resize(n, rank)
        bounds = self.sampler.bounds()
        if not bounds:  # the epoch is done: the next one starts at its beginning
            self.progress["epoch"] += 1
            return
        lo, hi = bounds[0]
        global_samples = hi - lo
        share = split_counts(global_samples, n)[rank]
        indices = rank_indices(self.sampler.order(), lo, hi, n, rank)
        t1 = time.perf_counter()
        inputs, targets = self._load(indices)
        data_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss_fn(self.model(inputs), targets)
        (loss * (share * n / global_samples)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        compute_s = time.perf_counter() - t2
        # A slow-rank fault stretches the step as slower hardware would; peers wait for it.
        compute_s += sum(f.after_step(step, self.rank, self.attempt, compute_s)
                         for f in self.faults)  # fmt: skip
        t3 = time.perf_counter()
        self.manager.allreduce(flat).wait()  # the mean over participants
        committed = self.manager.should_commit()
        comm_s = time.perf_counter() - t3
        if not committed:  # a peer failed mid-step: nothing applied, the samples stay
            log.warning("step %d not committed (a peer failed); retrying", step)
            return
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        t4 = time.perf_counter()
        self.optimizer.step()
        compute_s += time.perf_counter() - t4
        self.sampler.commit(global_samples)
        self.progress["step"] = step
        self.progress["samples_trained"] += global_samples
        record = {
            "step": step,
            "epoch": self.progress["epoch"],
            "rank": self.rank,
            "attempt": self.attempt,
            "samples": share,
            "global_samples": global_samples,
            "loss": loss.item() if share else None,
            "step_s": time.perf_counter() - t0,
            "compute_s": compute_s,
            "comm_s": comm_s,
            "wait_s": comm_s + quorum_s,
            "data_s": data_s,
            "checkpoint_s": 0.0,
            "overlap": 0.0,
            "comm_bytes": 2 * (n - 1) * flat.numel() * flat.element_size() // n,
            "dense_bytes": 2 * (n - 1) * flat.numel() * flat.element_size() // n,
            "participants": n,
            "quorum_s": quorum_s,
            "time_s": time.perf_counter() - start,
            "unix_time": time.time(),
            "total_steps": self._total_steps(),
        }
        if self.cfg.fault.log_sample_ids:
            record["sample_ids"] = indices if share else []
        sink.write(record)
        self.totals.add(record)

    @torch.no_grad()
    def _evaluate(self) -> float | None:
        test, eval_fn = self.task.test_data, self.task.eval_fn
        if test is None or eval_fn is None:
            return None
        from scaletrain.trainer import make_loader, to_device

        self.model.eval()
        correct = total = 0
        for inputs, targets in make_loader(test, cuda=False, batch_size=512):
            out = self.model(to_device(inputs, self.device))
            c, t = eval_fn(out, to_device(targets, self.device))
            correct, total = correct + c, total + t
        self.model.train()
        return correct / total if total else None

    def _finish(self, wall_s: float) -> None:
        """Every replica holds the same weights: each scores the test split alone and writes
        its totals; the one at quorum rank 0 of the last step also writes final.pt."""
        self.totals.peak_rss_bytes = peak_rss_bytes()
        if self.manager.participating_rank() == 0:
            atomic_torch_save(
                self.run_dir / "checkpoints" / "final.pt",
                {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()}},
            )
        final = self.run_dir / "logs" / "final"
        final.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            final / f"replica{self.rank}.json",
            {
                "totals": self.totals.__dict__,
                "progress": self.progress,
                "test_accuracy": self._evaluate(),
                "params_sha256": params_sha256(self.model),
                "wall_s": wall_s,
                "device": self.device.type,
                "torch_version": torch.__version__,
                "scaletrain_version": __version__,
                "steps_per_epoch": self.sampler.steps_per_epoch(),
            },
        )


def read_finals(run_dir: Path) -> list[dict[str, Any]]:
    final = run_dir / "logs" / "final"
    if not final.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(final.glob("replica*.json"))]
