"""Sharded data parallelism (ZeRO-3) on torch's FSDP2 ``fully_shard``: every rank keeps 1/W
of the parameters, gradients and optimizer state, and gathers a layer's parameters only while
that layer runs.

Sharding unit: every submodule that owns parameters directly (a Linear, a Conv, a norm) is
one FSDP unit, then the root. A layer's parameters are all-gathered before its forward (and
again before its backward), its gradients reduce-scattered after backward; the optimizer steps
on the local shards (DTensors), so its state is sharded too.

Replica groups (HSDP, ``--replica-size R``): the W ranks form W/R groups of R consecutive
ranks; each group shards the model over its own R ranks (FSDP2 on a 2-D ("replicate",
"shard") device mesh), so a rank holds 1/R of the state instead of 1/W. After backward each
group reduce-scatters the gradients over its R ranks, then the ranks that hold the same shard
(one per group) all-reduce it. The all-gathers stay within a group: on a cluster, R = the
devices of a node keeps the per-layer traffic on the node's fast links and sends only the
gradient all-reduce of 1/R of the model over the network. 0 (the default), or R = W, is plain
FSDP; R = 1 is replication (each rank the whole model, DDP's traffic).

Gradient semantics as in ddp.py: each rank scales its mean loss by ``n_r * W / N`` and FSDP's
reduce-scatter averages over W, which gives the gradient of the mean over all N samples.

State: checkpoints are sharded, through torch.distributed.checkpoint (DCP): every rank writes
its own shards of the model and optimizer state into one directory (``save_sharded``, a
collective), which rank 0 then publishes atomically beside the trainer's small checkpoint
file, hashed as a whole; DCP reshards on load, so a run can resume with another world size.
``state_dict``/``load_state_dict`` also move full (unsharded) tensors. ``finish`` gathers the final
full weights into a plain replica of the model (built from a meta-device skeleton taken before
sharding) for evaluation, hashing and final.pt: that replica needs the whole model in host
memory on every rank once, at the end.

Measurement: FSDP2 runs its collectives on its own schedule, with no hook to time them, so
``comm_s`` stays 0 and the step's time is all ``compute_s``; ``comm_bytes`` is the textbook
volume: two all-gathers (forward, backward) and one reduce-scatter of the parameters, each
(W-1)/W of the parameter bytes per rank.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from scaletrain.config import RunConfig
from scaletrain.strategies.base import Batch, LossFn, OptimizerFactory, StepResult, Strategy
from scaletrain.strategies.dtensor import (
    apply_tensor_parallel,
    check_tensor_parallel,
    tensor_parallel_mesh,
)
from scaletrain.strategies.sharded_load import load_sharded


def unit_bytes(model: nn.Module) -> tuple[int, int]:
    """(all parameter bytes, the largest FSDP unit's: a module's own parameters)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(
        (sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
         for m in model.modules()),
        default=0,
    )  # fmt: skip
    return total, largest


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_size(cfg: RunConfig, data_parallel: int) -> int:
    """The ranks one copy of the model is sharded over: --replica-size, or every
    data-parallel rank (0, plain FSDP)."""
    size = cfg.parallel.replica_size
    return size if 0 < size <= data_parallel else data_parallel


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def shard_units(model: nn.Module, mesh: Any, policy: MixedPrecisionPolicy) -> None:
    """FSDP2 over ``mesh``: every submodule that owns parameters directly, then the root.
    Children before parents: fully_shard takes every parameter below a module that no unit
    below it holds yet, so a parent first would swallow its children's."""
    for module in reversed(list(model.modules())):
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def mixed_precision_policy(cfg: RunConfig) -> MixedPrecisionPolicy:
    """Under --precision bf16-mixed, FSDP2 all-gathers and computes with bf16 parameters and
    reduce-scatters gradients in fp32 (the sharded fp32 weights stay the optimizer's);
    autocast (essentials.py) covers the ops between. fp16 is refused (no agreed loss scale
    over shards)."""
    if cfg.train.precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compile_units(model: nn.Module) -> None:
    """Each unit shard_units made, compiled on its own (FSDPStrategy.compile_model says why)."""
    for module in model.modules():
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            module.forward = torch.compile(module.forward)  # type: ignore[method-assign]


@contextlib.contextmanager
def gradient_sync_off(module: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of DDP's no_sync: keep the unsharded gradients, no reduce-scatter,
    until the last micro-batch."""
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def gather_replica(module: nn.Module, skeleton: nn.Module, device: torch.device) -> nn.Module:
    """A plain replica of ``module`` (sharded) with the full weights, built from
    ``skeleton`` (its meta-device copy taken before sharding). A collective: every rank of
    the shard group calls it."""
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    replica = skeleton.to_empty(device=device)
    replica.load_state_dict(full)
    return replica


def sharded_memory(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of training state this rank holds of a sharded module: its local shards of
    the parameters, their gradients and the optimizer state."""
    params = list(module.parameters())
    return {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params),
        "optimizer_bytes": local_bytes(optimizer_tensors(optimizer)),
    }


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class FSDPStrategy(Strategy):
    collective = "FSDP parameter all-gather / gradient reduce-scatter"
    # Each micro-batch's forward and backward all-gather every unit over "dp".
    same_micro_batch_count = True
    collective_state_dict = True

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        self.skeleton = copy.deepcopy(model).to("meta")  # the plain architecture, no memory
        self.param_bytes_full = sum(p.numel() * p.element_size() for p in model.parameters())
        self.tp = self.cfg.parallel.tp
        self.dp = self.ctx.world_size // self.tp
        self.shard = shard_size(self.cfg, self.dp)
        self.replicas = self.dp // self.shard
        if self.tp > 1:  # fsdp x tensor: split layers over "tp", then shard over "dp"
            mesh_2d = tensor_parallel_mesh(self.ctx, self.tp)
            apply_tensor_parallel(model, mesh_2d)
            mesh = mesh_2d["dp"]
        elif self.replicas > 1:  # HSDP: shard within each group, replicate across them
            mesh = init_device_mesh(self.ctx.device.type, (self.replicas, self.shard),
                                    mesh_dim_names=("replicate", "shard"))  # fmt: skip
        else:
            mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        shard_units(model, mesh, self.mp_policy())
        if getattr(self, "compile_units", False):
            self._compile_units(model)
        self.module = model
        self.optimizer = build_optimizer(model.parameters())
        self.loss_fn = loss_fn
        self.replica: nn.Module | None = None

    def mp_policy(self) -> MixedPrecisionPolicy:
        return mixed_precision_policy(self.cfg)

    @classmethod
    def checks_model(cls, cfg: RunConfig) -> bool:
        return cfg.parallel.tp > 1

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        if cfg.parallel.tp > 1:
            check_tensor_parallel(model, cfg.parallel.tp, world_size)
        size = cfg.parallel.replica_size
        if size and cfg.parallel.tp > 1:
            raise ValueError(
                "replica_size: fsdp x tensor (--tp) shards over the data-parallel ranks of a "
                "(dp, tp) mesh; replica groups as well would take a 3-D mesh, which is not "
                "supported: drop --replica-size or --tp"
            )
        if size and world_size % size:
            raise ValueError(
                f"replica_size: {size} does not divide the world size {world_size}; the world "
                "must hold a whole number of replica groups"
            )

    @property
    def data_rank(self) -> int:
        return self.ctx.rank // self.tp

    @property
    def data_world_size(self) -> int:
        return self.dp

    @property
    def reports_samples(self) -> bool:
        return self.ctx.rank % self.tp == 0

    def summary_info(self) -> dict[str, Any]:
        if self.tp > 1:
            return {"tensor_parallel": {"tp": self.tp, "data_parallel": self.dp}}
        if self.replicas > 1:
            return {"hsdp": {"replica_size": self.shard, "replica_groups": self.replicas}}
        return {}

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        # The shards, plus the largest unit's parameters and gradients while gathered.
        total, largest = unit_bytes(model)
        shards = shard_size(cfg, world_size // cfg.parallel.tp)
        return -(-total * (2 + optimizer_copies) // shards) + 2 * largest

    @property
    def model(self) -> nn.Module:
        if self.replica is None:
            raise RuntimeError("fsdp: the full model exists only after finish()")
        return self.replica

    def memory_bytes(self) -> dict[str, int]:
        return sharded_memory(self.module, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.module, options=FULL),
            "optimizer": get_optimizer_state_dict(self.module, self.optimizer, options=FULL),
        }

    def _sharded(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.module),
            "optimizer": get_optimizer_state_dict(self.module, self.optimizer),
        }

    def save_sharded(self, path: Path) -> None:
        dcp.save(self._sharded(), checkpoint_id=str(path))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "dcp" in state:  # a sharded checkpoint: DCP reshards it for this world size
            sharded = self._sharded()
            load_sharded(sharded, state["dcp"])
            set_model_state_dict(self.module, sharded["model"])
            set_optimizer_state_dict(self.module, self.optimizer, sharded["optimizer"])
            return
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, state["model"], options=options)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=options)

    def compile_model(self, model: nn.Module) -> None:
        """Each unit FSDP2 shards, compiled on its own once it is sharded (setup): FSDP2's
        hooks around a unit cannot be traced (dynamo breaks the graph there: a compiled root
        forward captured nothing, measured), and a forward compiled before sharding met the
        sharded DTensor parameters; compiled after, it runs between the hooks, on the
        unsharded parameters."""
        self.compile_units = True

    def _compile_units(self, model: nn.Module) -> None:
        compile_units(model)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return gradient_sync_off(self.module)

    def train_step(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        scale = batch.num_samples * self.dp / batch.global_samples
        loss = self.forward_backward(
            self.module, self.loss_fn, batch.inputs, batch.targets, batch.num_samples, scale
        )
        extras = self.step_optimizer(self.optimizer, self.module.parameters())
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return StepResult(
            loss=loss,
            compute_s=time.perf_counter() - start,
            comm_s=0.0,
            wait_s=0.0,
            comm_bytes=self.comm_bytes_per_step(),
            extras=extras,
        )

    def comm_bytes_per_step(self) -> int:
        """The textbook bytes a rank sends a step: two all-gathers and a reduce-scatter of
        its (dp or tp) part of the parameters within its shard group, then under HSDP a ring
        all-reduce of its 1/R shard across the replica groups (under --tp the
        tensor-parallel all-reduces come on top)."""
        part = self.param_bytes_full // self.tp
        s, g = self.shard, self.replicas
        return 3 * (s - 1) * part // s + 2 * (g - 1) * part // (g * s)

    def gather_replica(self) -> nn.Module:
        return gather_replica(self.module, self.skeleton, self.ctx.device)

    def eval_model(self) -> nn.Module:
        return self.gather_replica()

    def finish(self) -> None:
        self.replica = self.gather_replica()
