"""Fault-tolerant HSDP (``--recovery inplace --strategy fsdp --replica-size R``): replica
groups of R ranks, each sharding the model with FSDP2 over a process group of its own; the
quorum and the gradient all-reduce run across the groups (torchft's model: fault tolerance
on the replicate dimension, none within a group).

A group is one torchft replica (``replica_id`` ``group<g>``) of R processes: each rank has
its own Manager (rank = its rank in the group, world size R); the group's rank 0 hosts the
manager server that gathers the group's quorum requests and commit votes, and torchft
builds one fault-tolerant gloo group per shard index, across the groups. After backward,
FSDP has reduce-scattered the gradients over the group (a mean over its R ranks); each rank
then all-reduces its local shard of every gradient with the ranks that hold the same shard
in the other groups of the step's quorum (a mean over the groups). The optimizer steps on
the local shards only when every rank of every group commits.

Data: the step's global batch is dealt over groups x R processes, by (quorum rank, rank in
the group) (QuorumPlan, through ``data_membership``); each rank scales its mean loss by
``n_r x groups x R / N``, so the two means give the gradient of the mean over all N
samples, as in every other mode.

Failure: a rank that dies leaves its group's collectives hung, so the launcher ends the
group at once and restarts all of it (launch/inplace.py); the other groups train on, the
quorum without the lost group. The restarted group's ranks come back at step 0 and each
heals from the same rank of a live group: the heal state is the rank's local shards of the
parameters and of the optimizer state (no collective: torchft serves it from its HTTP
thread while the group trains), with the sampler and progress, which every rank holds alike.

Checkpoints (--checkpoint-every): the group of the step's quorum rank 0 writes them, each
rank its local shards in the file of its rank in the group, and the group's rank 0 publishes
the checkpoint once all are on disk (``GroupShards``; checkpointing.ReplicaCheckpointing).
The same command after the whole job was lost loads, on rank i of every group, shard file i.

Not in place yet, each refused before anything starts (launch/modes.py): --balance speed,
compression (FSDP reduce-scatters in fp32 or the policy's type), and groups across nodes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from scaletrain import env
from scaletrain.data.plans import RunEnded
from scaletrain.fault.recovery import rng_state
from scaletrain.net import bound_store
from scaletrain.strategies.base import Batch, LossFn, OptimizerFactory, ReplicaGroup, StepResult
from scaletrain.strategies.fsdp import (
    compile_units,
    gather_replica,
    gradient_sync_off,
    mixed_precision_policy,
    shard_units,
    sharded_memory,
)
from scaletrain.strategies.inplace import InplaceStrategy, run_ended


def local_state(state: Any) -> Any:
    """``state`` with every DTensor replaced by this rank's local shard (a plain tensor)."""
    if isinstance(state, DTensor):
        return state.to_local().detach().clone()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_state(v) for v in state]
    return state


def load_local(target: Any, source: Any) -> Any:
    """Copy ``source`` (what local_state gave on the same rank of another group) into
    ``target`` (this rank's own state of the same layout): a DTensor's local shard in place,
    a plain tensor by copy, anything else taken as it is."""
    if isinstance(target, DTensor):
        with torch.no_grad():
            target.to_local().copy_(source)
        return target
    if isinstance(target, torch.Tensor):
        return source.to(device=target.device, dtype=target.dtype)
    if isinstance(target, dict):
        return {k: load_local(target[k], v) if k in target else v for k, v in source.items()}
    if isinstance(target, list):
        return [load_local(t, v) for t, v in zip(target, source, strict=True)]
    return source


class GroupShards(ReplicaGroup):
    """A replica group's agreements (over its process group) and its checkpoint's shard
    files: a rank says its file is written by a key in the group's store, which the group's
    rank 0 waits for. The keys go through a connection of their own, made by the thread
    that writes (a background writer's, or training's), one at a time."""

    def __init__(self, size: int, rank: int, device: torch.device, store_at: tuple[str, int],
                 timeout_s: float) -> None:  # fmt: skip
        super().__init__(size, rank)
        self.device, self.store_at, self.timeout_s = device, store_at, timeout_s
        self._store: dist.TCPStore | None = None

    def max(self, values: torch.Tensor) -> torch.Tensor:
        out = values.to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.to(values.device)

    def _key(self, step: int, rank: int) -> str:
        return f"checkpoint/step{step}/shard{rank}"

    def _client(self) -> dist.TCPStore:
        if self._store is None:
            addr, port = self.store_at
            self._store = dist.TCPStore(addr, port, is_master=False,
                                        timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
        return self._store

    def shard_written(self, step: int) -> None:
        self._client().set(self._key(step, self.rank), "written")

    def await_shards(self, step: int) -> None:
        try:
            self._client().wait([self._key(step, r) for r in range(self.size)])
        except Exception as e:  # the store's timeout (or its host gone)
            raise RuntimeError(
                f"internal failure: the checkpoint of step {step} was not published: not "
                f"every rank of the replica group wrote its shard file within "
                f"{self.timeout_s:.0f} s ({e}); the previous checkpoint stands"
            ) from e


class InplaceHSDPStrategy(InplaceStrategy):
    collective = "FSDP reduce-scatter in the group, torchft all-reduce across groups"
    same_micro_batch_count = True  # every micro-batch all-gathers over the group
    supports_fp16 = False  # no loss scale agreed over shards (as fsdp)
    holds_replica = True  # the final weights, gathered: alike in every group

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.group_size = cfg.parallel.replica_size
        self.group, self.group_rank = divmod(ctx.rank, self.group_size)
        self.run_dir = Path(cfg.out)
        try:
            self._init_group()
        except Exception as e:
            # The other groups finished while this one restarted: its rank 0, which hosts
            # the group's store, found that first and left.
            if run_ended(self.run_dir):
                raise RunEnded("the other replicas finished the run while this one rejoined") from e
            raise
        self.skeleton = copy.deepcopy(model).to("meta")
        self.param_bytes_full = sum(p.numel() * p.element_size() for p in model.parameters())
        mesh = init_device_mesh(ctx.device.type, (self.group_size,))
        shard_units(model, mesh, mixed_precision_policy(cfg))
        if getattr(self, "compile_units", False):
            compile_units(model)
        self.module, self.loss_fn = model, loss_fn
        self.optimizer = build_optimizer(model.parameters())
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.compressor = None  # refused with replica groups (launch/modes.py)
        self.replica: nn.Module | None = None
        try:
            self.start_manager(self.group_store_port, self.group_rank, self.group_size,
                               f"group{self.group}")  # fmt: skip
        except Exception as e:
            if run_ended(self.run_dir):  # as above
                raise RunEnded("the other replicas finished the run while this one rejoined") from e
            raise

    def _init_group(self) -> None:
        """This rank's replica group as a torch.distributed world of its own (FSDP shards over
        it): a store on the port the launcher holds for this incarnation of the group, hosted
        by the group's rank 0 on this node's address; torchft's manager keys go there too."""
        addr = os.environ.get(env.ADDR, "127.0.0.1")
        port = int(os.environ[env.GROUP_PORT])
        timeout_s = self.cfg.launch.timeout_s
        if self.group_rank == 0:
            self.store, self._listener = bound_store(addr, port, timeout_s, reuse_port=True)
        else:
            self.store = dist.TCPStore(addr, port, is_master=False,
                                       timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self.group_store_port = port
        self.shards = GroupShards(self.group_size, self.group_rank, self.ctx.device,
                                  (addr, port), timeout_s)  # fmt: skip
        dist.init_process_group(
            "nccl" if self.ctx.device.type == "cuda" else "gloo",
            store=dist.PrefixStore("hsdp", self.store),
            rank=self.group_rank,
            world_size=self.group_size,
            timeout=timedelta(seconds=self.cfg.hang_timeout_s),
        )

    def compile_model(self, model: nn.Module) -> None:
        self.compile_units = True  # each unit once sharded (FSDPStrategy.compile_model)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return gradient_sync_off(self.module)

    def data_membership(self) -> tuple[int, int]:
        n, rank = self.membership()
        return n * self.group_size, rank * self.group_size + self.group_rank

    def train_step(self, batch: Batch) -> StepResult:
        n = self.manager.num_participants()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        weight = batch.num_samples * n * self.group_size / batch.global_samples
        loss = self.forward_backward(
            self.module, self.loss_fn, batch.inputs, batch.targets, batch.num_samples, weight
        )
        # After backward FSDP holds each gradient's shard, averaged over the group.
        shards = [local_grad(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in shards])
        compute_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.manager.allreduce(flat).wait()  # the mean over the step's groups
        if self.manager.errored() is not None:
            self.drop_group()
        committed = self.manager.should_commit()
        comm_s = time.perf_counter() - t1
        # The processes of the step's quorum, as in place without groups.
        extras: dict[str, Any] = {"participants": n * self.group_size}
        if committed:  # else a group failed mid-step: nothing is applied (the sum is junk)
            offset = 0
            with torch.no_grad():
                for g in shards:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            t2 = time.perf_counter()
            extras |= self.step_optimizer(self.optimizer, self.params)
            compute_s += time.perf_counter() - t2
        sent = flat.numel() * flat.element_size()
        s = self.group_size
        in_group = 3 * (s - 1) * self.param_bytes_full // s
        return StepResult(
            loss=loss,
            compute_s=compute_s,
            comm_s=comm_s,
            wait_s=comm_s,
            comm_bytes=in_group + 2 * (n - 1) * sent // n,
            dense_bytes=in_group + 2 * (n - 1) * sent // n,
            committed=committed,
            overlap=0.0,
            extras=extras,
        )

    # -- state: this rank's shards (what the same rank of another group holds) --------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's local shards of the model and optimizer state: no collective, so
        torchft can serve it to a healing group from its HTTP thread while this group trains."""
        return {
            "model": local_state(self.module.state_dict()),
            "optimizer": local_state(self.optimizer.state_dict()),
        }

    def replica_group(self) -> GroupShards:
        return self.shards

    def replica_state(self, held: dict[str, Any]) -> dict[str, Any] | None:
        """A checkpoint's shard file of this rank, when its group writes the checkpoint (the
        group of the step's quorum rank 0): its local shards (``held``'s are copies) and its
        random streams."""
        if self.membership()[1] != 0:
            return None
        return {"rng": rng_state(), "strategy": held["strategy"]}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's shard file of the checkpoint a job run starts from."""
        self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "shards" in state:  # a checkpoint's shared part: the shards are in their files
            return
        load_local(self.module.state_dict(), state["model"])
        own = self.optimizer.state_dict()
        if not own["state"]:  # no step taken yet: build the state to copy into
            self._materialize_optimizer_state()
            own = self.optimizer.state_dict()
        self.optimizer.load_state_dict(load_local(own, state["optimizer"]))

    def _materialize_optimizer_state(self) -> None:
        """One optimizer step with zero gradients and a zero learning rate builds the state
        (as DTensors of the right layout) without moving a weight; the copy then overwrites
        it."""
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def memory_bytes(self) -> dict[str, int]:
        return sharded_memory(self.module, self.optimizer)

    # -- the whole model: gathered within the group ------------------------------------------
    @property
    def model(self) -> nn.Module:
        if self.replica is None:
            raise RuntimeError("fsdp in place: the full model exists only after finish()")
        return self.replica

    def eval_model(self) -> nn.Module:
        return gather_replica(self.module, self.skeleton, self.ctx.device)

    def finish(self) -> None:
        self.replica = gather_replica(self.module, self.skeleton, self.ctx.device)

    def summary_info(self) -> dict[str, Any]:
        return {
            "recovery": "inplace",
            "hsdp": {"replica_size": self.group_size,
                     "replica_groups": self.ctx.world_size // self.group_size},
        }  # fmt: skip

    def close(self) -> None:
        super().close()
        if dist.is_initialized():
            dist.destroy_process_group()


def local_grad(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient shard on this rank (zeros where backward left none), as a tensor
    that aliases the gradient: writing it writes the gradient."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    grad = p.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad
