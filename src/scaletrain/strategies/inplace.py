"""In-place recovery (``--recovery inplace``) as a strategy of the one loop: when a worker dies
the others keep training from their current state, with no restart and no rollback to a
checkpoint; a restarted or new worker joins at a step boundary and copies the state from a
live peer.

Built on torchft (pytorch/torchft): a lighthouse (hosted by the launcher, launch/inplace.py)
forms a quorum of live replicas before every step; each worker is a replica of its own with a
torchft ``Manager`` and a reconfigurable gloo process group that the manager rebuilds whenever
the membership changes. A replica behind the quorum's step heals before the step: the manager
fetches the loop's training state (model, optimizer, sampler cursor, progress:
Trainer.heal_state) from a peer over HTTP. We use torchft instead of a quorum protocol of our
own: its quorum, heartbeats, process-group reconfiguration and healing did exactly this in a
probe on this stack (torch 2.13 CPU, torchft 0.2), and a second implementation of membership
agreement is where split brains come from.

What torchft's own sampler does not do, the plan here does: the data cursor commits with the
step. Each step takes the next ``batch_size x participants`` samples of the epoch's global
order (sampler.py) and splits them over the step's participants by their quorum rank
(``QuorumPlan``); the gradient is the sample-weighted mean over them (each rank scales its mean
loss by ``n_r x participants / N``, then the manager averages). Only when every participant
commits (``should_commit``) does the optimizer step and the cursor advance; a step that fails
(a peer died mid all-reduce) is reported not committed, and the loop deals its samples again
over the survivors: every sample is trained exactly once per epoch, also across failures.
The global batch follows the membership (the per-worker batch is kept); the learning rate is
not rescaled.

Records carry ``participants`` and ``quorum_s`` (the time the step waited for its quorum);
the step of a replica that healed before it also ``healed_bytes``, the tensors it copied,
and ``heal_copy_s``, the copy's seconds (its quorum_s includes them).

``--balance speed`` in place: each replica's rate (samples per busy second over
--balance-every steps) rides on every step's gradient all-reduce, in two small slots of
world-size floats appended to the flat gradient: one by replica id for the rates, one by
quorum rank for the replica ids (so every participant learns who holds which rank). When the
next quorum is the same one (torchft's quorum id unchanged), the step is split in proportion
to its participants' rates (balance.py: no share below a quarter of an even one, and the
split is kept unless someone waits and some share moves by more than the hysteresis); a new
quorum splits evenly for one step, until
its members are known. The rates are the plan's state, so a replica that heals copies them
and splits the same way. A replica slowed down then holds up nobody for long: it gets fewer
samples, and the others more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain import env
from scaletrain.compression import build_compressor
from scaletrain.data.balance import rebalanced
from scaletrain.data.partition import rank_indices, split_counts
from scaletrain.data.plans import (
    BatchPlan,
    RunEnded,
    SampledPlan,
    StepPlan,
    build_sampler,
    load_indices,
)
from scaletrain.fault.checkpoint import read_index
from scaletrain.fault.jobs import job_runs_path
from scaletrain.io import read_jsonl
from scaletrain.net import bound_store, url_host
from scaletrain.strategies.base import (
    Batch,
    LossFn,
    OptimizerFactory,
    StepResult,
    Strategy,
    replica_memory,
)

log = logging.getLogger("scaletrain.inplace")


def bound_checkpoint_transport(addr: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server (healing copies the state through it), listening on
    ``addr`` and advertising it. torchft's own listens on every interface ([::]) and
    advertises socket.gethostname(), which need not resolve to this host elsewhere (it does
    not inside a network namespace). This and manager_server_bound_to reach into torchft
    0.2.0's internals (constraints/cpu.txt pins it); tests/e2e/test_netns.py checks with ss
    that nothing listens elsewhere, so a torchft that changes them fails there, loudly."""
    import socket
    from http.server import ThreadingHTTPServer

    from torchft.checkpointing.http_transport import HTTPTransport

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

    class BoundTransport(HTTPTransport[dict[str, Any]]):
        recv_s = 0.0  # the last copy from a peer took (the state's transfer alone)

        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            started = time.perf_counter()
            state = super().recv_checkpoint(*args, **kwargs)
            self.recv_s = time.perf_counter() - started
            return state

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


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state (dicts, lists, tuples)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def wait_for_peers(run_dir: Path, job_run: int, rank: int, world: int, timeout_s: float) -> None:
    """A job run's first start only, just before its first quorum: every replica announces
    itself and waits for all, so the first step runs with all of them instead of with
    whichever got there first. Just before: a quorum waits 5 s (JOIN_TIMEOUT_MS) for a live
    replica that has not asked yet, and on a loaded host the rest of a replica's start-up
    (the loop's set-up, a checkpoint to load) took longer than that: the first step ran
    without it, and a --deterministic run no longer matched its twin. A replica that died
    before it announced itself (its supervisor recorded the death) is not waited for: a
    restarted replica does not announce itself, it joins a later quorum and heals."""
    ready = run_dir / "logs" / "ready" / f"job{job_run}"
    ready.mkdir(parents=True, exist_ok=True)
    (ready / f"replica{rank}").touch()
    deadline = time.monotonic() + timeout_s
    looked = 0.0
    lost: set[str] = set()
    while time.monotonic() < deadline:
        if time.monotonic() - looked > 0.5:
            looked = time.monotonic()
            lost = {f"replica{r}" for r in lost_in_job_run(run_dir, job_run)}
        if len({path.name for path in ready.iterdir()} | lost) >= world:
            return
        time.sleep(0.05)


def lost_in_job_run(run_dir: Path, job_run: int) -> set[int]:
    """The replicas whose death a supervisor recorded since job run ``job_run`` started."""
    started = [j["started_at"] for j in read_jsonl(job_runs_path(run_dir))
               if j.get("job_run") == job_run and "started_at" in j]  # fmt: skip
    since = started[-1] if started else 0.0
    return {
        int(i["rank"])
        for i in read_jsonl(run_dir / "logs" / "incidents.jsonl")
        if i.get("kind") == "inplace" and i.get("died_at", 0.0) >= since
    }


def run_ended(run_dir: Path) -> bool:
    """The other replicas finished the run (their final reports are there): a replica that
    restarts after that must not train the run again alone."""
    final = run_dir / "logs" / "final"
    return final.is_dir() and any(final.iterdir())


class StateLost(RuntimeError):
    """A replica restarted during a job run found no live peer with the job's state
    (InplaceStrategy.check_state_held)."""


class InplaceStrategy(Strategy):
    supports_fp16 = True  # every participant holds the same gradients after the all-reduce
    collective = "torchft gradient all-reduce"
    plan_collective = "torchft quorum"
    holds_replica = True

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.module, self.loss_fn = model, loss_fn
        self.optimizer = build_optimizer(model.parameters())
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shapes = [p.shape for p in self.params]
        # --compression fp16 / bf16 (launch/modes.py refuses the others in place).
        self.compressor = build_compressor(cfg.comm.compression, ctx.world_size)
        # This replica's own store (a group of one): torchft keeps its process-group
        # rendezvous keys there.
        addr = os.environ.get(env.ADDR, "127.0.0.1")
        self.store, self._listener = bound_store(addr, 0, cfg.launch.timeout_s)
        self.start_manager(self.store.port, 0, 1, f"replica{ctx.rank}")

    def start_manager(self, store_port: int, rank: int, world_size: int, replica_id: str) -> None:
        """torchft's Manager of this process: rank ``rank`` of a replica of ``world_size``
        processes (``replica_id``), whose store (on this node's address) is at
        ``store_port``; the replica's rank 0 hosts the manager server there."""
        from torchft import Manager, ProcessGroupGloo

        cfg = self.cfg
        timeout = timedelta(seconds=cfg.hang_timeout_s)
        addr = os.environ.get(env.ADDR, "127.0.0.1")
        self.transport = bound_checkpoint_transport(addr, timeout)
        with manager_server_bound_to(addr):
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                load_state_dict=None,
                state_dict=None,  # bind_state registers the loop's
                min_replica_size=1,
                use_async_quorum=False,  # the step's membership decides its data split
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.launch.timeout_s),
                connect_timeout=timedelta(seconds=cfg.launch.timeout_s),
                rank=rank,
                world_size=world_size,
                store_addr=addr,
                store_port=store_port,
                lighthouse_addr=os.environ[env.LIGHTHOUSE],
                replica_id=replica_id,
                hostname=url_host(addr),
                checkpoint_transport=self.transport,
                heartbeat_interval=timedelta(milliseconds=100),
            )
        self.run_dir = Path(cfg.out)
        self.peers_pending = self.ctx.attempt == 0  # QuorumPlan.next_step waits for them once
        self.state_checked = False  # check_state_held, after the first quorum

    def build_plan(self, dataset: Any) -> BatchPlan:
        self.plan = QuorumPlan(self, dataset)
        return self.plan

    def quorum_id(self) -> int:
        """torchft's id of the quorum just formed (it changes with the membership only).
        torchft 0.2 keeps it private; the pin in constraints/cpu.txt holds it there."""
        return int(self.manager._quorum_id)

    def bind_state(
        self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]
    ) -> None:
        """The training state the quorum copies between replicas: a healing replica loads
        a peer's ``consistent_state``."""

        def healed(state: dict[str, Any]) -> None:
            self.healed_bytes = tensor_bytes(state)  # what the next step's record says
            self.heal_copy_s = self.transport.recv_s
            load(state)
            self.after_heal(state)

        self.healed_bytes = 0
        self._live_state = save
        self.manager.register_state_dict_fn("trainer", healed, self.consistent_state)

    def after_heal(self, state: dict[str, Any]) -> None:
        """After the quorum loaded a peer's ``state`` into this replica (nothing more here)."""

    def resumed_at(self, step: int) -> None:
        """This replica began its job run from the checkpoint of ``step``: torchft's step
        counter starts there, not at 0, so that the quorum ranks it above a replica
        restarted afresh. At equal steps torchft takes the first replica id as the source
        (at step 0 it even copies that one's state to the others): a replica restarted
        before the job run's first commit would have handed its fresh state to the peers
        that had resumed."""
        self.manager.load_state_dict(
            {"step": step, "batches_committed": self.manager.batches_committed()}
        )

    def check_state_held(self) -> None:
        """After this replica's first quorum: a replica restarted during the job run must
        have found a peer holding the job's state (the quorum's step is above 0 once anyone
        resumed from a checkpoint or committed a step). When none did, every replica that
        held it was lost (on one node the launcher begins the job run again; across nodes
        it cannot know): training on from a fresh state would train the job again from its
        start and write checkpoints over the ones it has, so this replica fails instead,
        and the same command continues from the newest checkpoint."""
        if self.state_checked:
            return
        self.state_checked = True
        if self.ctx.attempt == 0 or self.manager.current_step() > 0:
            return
        index = read_index(self.run_dir / "checkpoints")
        if index:
            raise StateLost(
                f"replica {self.ctx.rank} restarted and found no live replica holding the "
                f"job's state: every one that held it was lost. The newest checkpoint is "
                f"step {index[-1]['step']}; run the same command (--out {self.run_dir}) to "
                "continue from it"
            )

    def heal_extras(self) -> dict[str, Any]:
        """For the record of the step a heal came before: the bytes copied and the copy's
        seconds (``heal_copy_s``; the quorum's wait also holds the wait for the quorum)."""
        if not self.healed_bytes:
            return {}
        extras = {"healed_bytes": self.healed_bytes, "heal_copy_s": self.heal_copy_s}
        self.healed_bytes = 0
        return extras

    def consistent_state(self) -> dict[str, Any]:
        """The state every replica holds alike, with its progress (what a checkpoint of the
        job holds): after a committed step, the live one."""
        return self._live_state()

    def replica_state(self, held: dict[str, Any]) -> dict[str, Any] | None:
        """What of ``held`` (a consistent_state) differs between replicas and so each writes
        beside a checkpoint of it (None: nothing; after a committed step they are alike).
        Tensors training no longer changes: a background write reads them later."""
        return None

    @property
    def model(self) -> nn.Module:
        return self.module

    def membership(self) -> tuple[int, int]:
        """(participants, this replica's rank among them) of the quorum just formed."""
        n, rank = self.manager.num_participants(), self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum leaves every replica participating"
        return n, rank

    def data_membership(self) -> tuple[int, int]:
        """(the step's data-parallel ranks, this process's among them): its replicas and
        quorum rank here, each a process (replica groups split further: inplace_hsdp.py)."""
        return self.membership()

    def eval_part(self) -> tuple[int, int]:
        """The last quorum's split: its participants hold the same weights. A job run that
        had nothing left to train (it resumed from the checkpoint of the last step) formed
        no quorum: every replica loaded that checkpoint, and each takes its own rank."""
        if self.quorum_id() < 0:  # torchft formed none yet
            return self.ctx.rank, self.ctx.world_size
        n, rank = self.data_membership()
        return rank, n

    def train_step(self, batch: Batch) -> StepResult:
        n = self.manager.num_participants()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        weight = batch.num_samples * n / batch.global_samples
        loss = self.forward_backward(
            self.module, self.loss_fn, batch.inputs, batch.targets, batch.num_samples, weight
        )
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        slots = self.plan.rate_slots(n, self.membership()[1]) if self.plan.balancing else None
        flat = torch.cat([g.reshape(-1) for g in grads])
        compute_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        flat, sent = self._average(flat, n, slots)
        if self.manager.errored() is not None:
            self.drop_group()
        committed = self.manager.should_commit()
        comm_s = time.perf_counter() - t1
        extras: dict[str, Any] = {"participants": n}
        if committed:  # else a peer failed mid-step: nothing is applied (the sum is junk)
            if slots is not None:
                self.plan.heard(flat[flat.numel() - slots.numel() :], n)
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                p.grad = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
            t2 = time.perf_counter()
            extras |= self.step_optimizer(self.optimizer, self.params)
            compute_s += time.perf_counter() - t2
        dense = 2 * (n - 1) * flat.numel() * flat.element_size() // n
        return StepResult(
            loss=loss,
            compute_s=compute_s,
            comm_s=comm_s,
            wait_s=comm_s,  # a blocking all-reduce: all of it waited for
            comm_bytes=2 * (n - 1) * sent // n,
            dense_bytes=dense,
            committed=committed,
            overlap=0.0,
            extras=extras,
        )

    def _average(
        self, grad: torch.Tensor, n: int, slots: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """The mean over the step's ``n`` participants of the flat gradient, the rate slots
        (--balance speed) after it; and the bytes one participant handed the all-reduce.
        Compressed (--compression fp16 or bf16), the gradient goes in the half type, each
        replica's already divided by ``n`` (so the sum stays in fp16's range); the slots
        then go in fp32 in an all-reduce of their own (replica ids and rates need its
        precision)."""
        if self.compressor is None:
            flat = torch.cat([grad, slots]) if slots is not None else grad
            self.manager.allreduce(flat).wait()
            return flat, flat.numel() * flat.element_size()
        from torch.distributed import ReduceOp

        self.compressor.world_size = n  # the participants of this step
        payload = self.compressor.compress(0, grad, self.shapes)
        self.manager.allreduce(payload, reduce_op=ReduceOp.SUM).wait()
        self.compressor.decompress(0, payload, grad)
        sent = payload.numel() * payload.element_size()
        if slots is None:
            return grad, sent
        self.manager.allreduce(slots).wait()
        return torch.cat([grad, slots]), sent + slots.numel() * slots.element_size()

    def drop_group(self) -> None:
        """This step's all-reduce failed (a peer died or went silent): close this replica's
        gloo connections now. In a ring, only the dead peer's neighbours see it die; the
        others wait on their neighbours, which would have held their connections open until
        the next quorum, so every survivor sat out the collective's whole timeout
        (--hang-timeout-s; 3.3 s stalls after each SIGKILL in benchmarks/chaos.py). Closed,
        the failure runs round the ring in milliseconds. The next quorum builds a new group
        (torchft reconfigures it). This reaches into torchft 0.2's wrapper (its ``_pg``)."""
        self.manager._pg.abort()

    def memory_bytes(self) -> dict[str, int]:
        return replica_memory(self.module, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def summary_info(self) -> dict[str, Any]:
        return {"recovery": "inplace"}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class QuorumPlan(SampledPlan):
    """The sampler's plan, dealt anew at every step over that step's quorum."""

    def __init__(self, strategy: InplaceStrategy, dataset: Any) -> None:
        self.strategy, self.dataset, self.cfg = strategy, dataset, strategy.cfg
        self.sampler = build_sampler(dataset, self.cfg, world_size=1, rank=0)
        self.device = strategy.ctx.device
        self.run_dir = strategy.run_dir
        # --balance speed (the module's docstring): this replica's latest rate, and what the
        # last committed step's all-reduce said: each replica's rate (by replica id), who
        # held each quorum rank, in which quorum; the split in force.
        self.balancing = self.cfg.train.balance == "speed"
        self.world = strategy.ctx.world_size
        self.offered = 0.0
        self.rates: dict[int, float] = {}
        self.holders: list[int] = []
        self.holders_quorum = -1
        self.split: list[float] | None = None
        self._heard: tuple[list[int], dict[int, float]] | None = None

    def offer_rate(self, rate: float) -> bool:
        self.offered = rate
        return True

    def rate_slots(self, n: int, rank: int) -> torch.Tensor:
        """What this replica adds to the step's all-reduce (a mean over ``n``): its rate in
        its replica id's slot, its replica id (+1) in its quorum rank's."""
        slots = torch.zeros(2 * self.world, dtype=torch.float32)
        me = self.strategy.ctx.rank
        slots[me] = self.offered * n
        slots[self.world + rank] = (me + 1) * n
        return slots

    def heard(self, slots: torch.Tensor, n: int) -> None:
        """The all-reduced slots of a step that commits (the plan keeps them at commit)."""
        values = slots.tolist()
        holders = [round(x) - 1 for x in values[self.world : self.world + n]]
        rates = {i: values[i] for i in holders if values[i] > 0}
        self._heard = (holders, rates)

    def commit(self, plan: StepPlan) -> None:
        super().commit(plan)
        if self._heard is not None:  # the same numbers on every participant
            self.holders, heard = self._heard
            self.rates.update(heard)
            self.holders_quorum = self.strategy.quorum_id()
            self._heard = None

    def _shares(self, n: int) -> list[float] | None:
        """The split of a step of this quorum: by rate once its members are known, else
        even. The same on every participant (the same state, the same quorum id)."""
        known = (
            self.balancing
            and self.strategy.quorum_id() == self.holders_quorum
            and len(self.holders) == n
            and all(self.rates.get(i, 0.0) > 0 for i in self.holders)
        )
        if not known:
            self.split = None
            return None
        rates = [self.rates[i] for i in self.holders]
        now = self.split if self.split and len(self.split) == n else [1.0 / n] * n
        self.split = rebalanced(now, rates) or self.split
        return self.split

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "balance": {"rates": dict(self.rates), "holders": self.holders,
                        "holders_quorum": self.holders_quorum, "split": self.split},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        balance = state.get("balance") or {}
        self.rates = {int(k): v for k, v in balance.get("rates", {}).items()}
        self.holders = list(balance.get("holders", []))
        self.holders_quorum = balance.get("holders_quorum", -1)
        self.split = balance.get("split")

    def _run_ended(self) -> bool:
        return run_ended(self.run_dir)

    def _data_done(self) -> bool:
        """Every sample of the last epoch is trained: no quorum is needed to know that (so
        the replicas that finish leave after the last step's quorum, which says how they
        share the evaluation)."""
        epochs = self.cfg.train.epochs
        if self.sampler.epoch >= epochs:
            return True
        last = self.sampler.epoch == epochs - 1
        return last and self.sampler.cursor >= self.sampler.num_samples

    def _max_steps_reached(self, progress: Any) -> bool:
        return bool(self.cfg.train.max_steps and progress.step >= self.cfg.train.max_steps)

    def _before_quorum(self) -> None:
        """What comes before a quorum: the run may have ended without this replica (it was
        down); a job run's first quorum waits for every replica to start."""
        if self._run_ended():
            raise RunEnded("the other replicas finished the run before this one rejoined")
        strategy = self.strategy
        if strategy.peers_pending:
            strategy.peers_pending = False
            ctx = strategy.ctx
            wait_for_peers(self.run_dir, ctx.job_run, ctx.rank, ctx.world_size,
                           self.cfg.launch.timeout_s)  # fmt: skip

    def next_step(self, progress: Any) -> StepPlan | None:
        """The quorum may heal this replica: the manager loads a peer's training state into
        the loop, ``progress`` included (in place), and into this plan's sampler."""
        self._heard = None
        if self._max_steps_reached(progress) or self._data_done():
            return None  # this replica's run is over too: it finishes (and reports) normally
        self._before_quorum()
        t0 = time.perf_counter()
        self.strategy.manager.start_quorum()  # heals first if this replica is behind
        quorum_s = time.perf_counter() - t0
        if self._run_ended():
            raise RunEnded("the other replicas finished the run while this one healed")
        self.strategy.check_state_held()
        if self._max_steps_reached(progress):  # healed into a finished run
            return None
        n, rank = self.strategy.data_membership()
        self.sampler.resize(n, rank)
        while not len(self.sampler):  # the epoch is done: the next starts at its beginning
            if self.sampler.epoch + 1 >= self.cfg.train.epochs:
                return None
            self.sampler.set_epoch(self.sampler.epoch + 1)
        bounds = self.sampler.next_bounds()
        assert bounds is not None
        lo, hi = bounds
        shares = self._shares(n)
        extras: dict[str, Any] = {"quorum_s": quorum_s}
        extras |= self.strategy.heal_extras()
        if shares:
            extras["share"] = shares[rank]
        return StepPlan(
            step=progress.step + 1,
            epoch=self.sampler.epoch,
            indices=rank_indices(self.sampler.order(), lo, hi, n, rank, shares),
            num_samples=split_counts(hi - lo, n, shares)[rank],
            global_samples=hi - lo,
            wait_s=quorum_s,
            extras=extras,
        )

    def load(self, plan: StepPlan) -> tuple[Any, Any]:
        return load_indices(self.dataset, plan.indices, self.device)
