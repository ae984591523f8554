"""The Strategy ABC: how one training step is computed and synchronized across workers.

The trainer hands a strategy one ``Batch`` per step and gets a ``StepResult`` back; it never
asks which strategy it holds. A new strategy is a subclass here plus one entry in
``strategies/__init__.py``'s registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from scaletrain.config import RunConfig
from scaletrain.data.plans import BatchPlan, SamplerPlan
from scaletrain.runtime import DistContext
from scaletrain.strategies.essentials import StepEssentials

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One rank's share of one global step. ``num_samples`` is this rank's count and
    ``global_samples`` the count over all ranks, so a strategy can weight by samples."""

    inputs: Any
    targets: Any
    num_samples: int
    global_samples: int


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """``loss`` is this rank's mean loss over its samples (a 0-dim tensor, not yet synced).
    Times are seconds: compute (forward, backward, optimizer, minus time blocked on peers),
    comm (gradient communication in flight, hidden or not), wait (blocked on communication).
    ``comm_bytes``: bytes this rank sent (metrics/timers.sent_bytes); ``dense_bytes``: what
    it would have sent without compression (None: the same).
    ``committed``: False when nothing was applied (a peer failed mid-step under torchft): the
    loop then neither advances the plan nor records the step, and the samples are dealt
    again. ``samples``: what the step trained when not the batch's share (a push the
    parameter servers did not apply trained none). ``overlap``: how much communication was
    hidden, when the strategy knows better than the loop's estimate (0 for blocking round
    trips). ``extras`` go into metrics.jsonl as they are (e.g. staleness)."""

    loss: torch.Tensor
    compute_s: float
    comm_s: float
    wait_s: float
    comm_bytes: int = 0
    dense_bytes: int | None = None
    committed: bool = True
    samples: int | None = None
    overlap: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def replica_memory(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """memory_bytes() of a strategy that keeps a whole replica on every rank."""

    def size(tensors: Iterable[torch.Tensor | None]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "param_bytes": size(params),
        "grad_bytes": size(p.grad for p in params),
        "optimizer_bytes": size(state),
    }


class StrategyChecks:
    """What the launcher asks a strategy before any process starts (class level)."""

    # Whether gradients pass through DDP comm hooks, so --compression applies.
    supports_compression: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        """Raise ValueError for a configuration this strategy cannot run, before any worker
        starts (the launcher passes the model only when ``checks_model``). The default
        refuses tensor parallelism, which only strategies holding DTensors can run; an
        override calls it unless it runs --tp."""
        if cfg.parallel.tp != 1:
            raise ValueError(
                f"tp: tensor parallelism runs under --strategy tensor or fsdp, not "
                f"{cfg.train.strategy!r}"
            )
        if cfg.ps.ps_replicas and cfg.train.strategy != "ps":
            how = f"--strategy {cfg.train.strategy}"
            if cfg.fault.recovery == "inplace":
                how += " --recovery inplace"
            raise ValueError(
                f"ps_replicas: backups of a parameter server's slices; {how} has no "
                "parameter server (--strategy ps has)"
            )

    @classmethod
    def checks_model(cls, cfg: RunConfig) -> bool:
        """Whether check_config needs the model (the launcher then builds it once)."""
        return False

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        """Per-rank training state before training starts (for --max-memory-per-rank):
        parameters, gradients and ``optimizer_copies`` parameter-sized optimizer buffers; None
        when this strategy cannot run this model. The default is a whole replica per rank."""
        return model_bytes(model) * (2 + optimizer_copies)


class ReplicaGroup:
    """The processes of one replica when it is more than one: in-place HSDP's group of R
    ranks, each holding a shard of the state (strategies/inplace_hsdp.py). Its checkpoint
    is one file of the shared state and one file per shard, written by the ranks of the
    writing group; what the ranks of a group must agree on (the checkpoint they resume
    from, the step they leave at, the interval auto chooses) goes through these."""

    def __init__(self, size: int, rank: int) -> None:
        self.size = size  # the group's ranks: the checkpoint's shard files
        self.rank = rank  # this process's rank in its group: the shard file it writes, reads

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of the group's ``values`` (a collective of the group)."""
        raise NotImplementedError

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the group (a collective of the group)."""
        flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
        return float(self.max(flag)[0]) == 0.0

    def shard_written(self, step: int) -> None:
        """This rank's shard file of the checkpoint of ``step`` is on disk."""
        raise NotImplementedError

    def await_shards(self, step: int) -> None:
        """Block until every rank of the group wrote its shard file of ``step`` (the
        group's rank 0, before it publishes the checkpoint: one that names missing shards
        would be one nobody can resume from). Raises when one does not come in time."""
        raise NotImplementedError


class Strategy(StepEssentials, StrategyChecks, ABC):
    # The collective a train step waits in, as hang reports name it (fault/watchdog.py); the
    # one the plan waits in before a step, and the one reading ``model`` takes part in.
    collective: ClassVar[str] = "gradient all-reduce"
    plan_collective: ClassVar[str] = ""
    collective_of_model: ClassVar[str] = ""
    # Sharded state: when a checkpoint is due every rank calls save_sharded(dir) (a collective,
    # through torch.distributed.checkpoint), and load_state_dict receives {"dcp": dir}.
    collective_state_dict: ClassVar[bool] = False
    # Every rank holds the whole model (data parallelism): the ranks' final weights are
    # hashed and compared (summary.json's replicas_agree).
    holds_replica: ClassVar[bool] = False
    # The final model is on this process at the end (not so for a parameter-server worker:
    # the servers hold it), so it evaluates its part of the test split.
    holds_final_model: ClassVar[bool] = True
    # Leaves after its step whenever the launcher asks it to (a preemption), checkpoints on
    # or not: a parameter server's worker, whose state the servers hold and checkpoint once
    # every worker has left. Otherwise a fleet's process leaves only where its job
    # checkpoints (in place), and a group's ranks by their agreement (lifecycle.py).
    leaves_when_asked: ClassVar[bool] = False

    def __init__(self, ctx: DistContext, cfg: RunConfig) -> None:
        self.ctx = ctx
        self.cfg = cfg

    @abstractmethod
    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        """Wrap the model, build the optimizer. Called once, before the first step."""

    def build_plan(self, dataset: Any) -> BatchPlan:
        """Which samples each step trains here (data/plans.py): by default the sampler's plan
        over this strategy's data-parallel ranks."""
        return SamplerPlan(
            dataset,
            self.cfg,
            data_rank=self.data_rank,
            data_world_size=self.data_world_size,
            device=self.ctx.device,
        )

    def bind_state(
        self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]
    ) -> None:
        """The loop's whole training state (strategy, plan, progress), for a strategy that
        copies it between processes (a healing torchft replica). Default: not needed."""
        return None

    def eval_model(self) -> nn.Module:
        """The weights as they are now, as a plain module, during training (--eval-every).
        Every rank calls it at once: a strategy with sharded state gathers it here."""
        return self.model

    def eval_part(self) -> tuple[int, int]:
        """(part, parts): which balanced slice of the test split this process scores."""
        return self.ctx.rank, self.ctx.world_size

    def close(self) -> None:
        """Called last, after the world reported: release what setup started."""
        return None

    @abstractmethod
    def train_step(self, batch: Batch) -> StepResult:
        """Forward, backward, synchronize, update."""

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The user's plain module with current weights (for evaluation, hashing, saving)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to continue training (weights, optimizer state)."""

    # Data parallelism within the strategy: ranks with the same data_rank see the same batch
    # (the stages of one pipeline, the ranks of one tensor-parallel group). Exactly one rank
    # of each such group reports the samples and the loss (reports_samples).
    @property
    def data_rank(self) -> int:
        return self.ctx.rank

    @property
    def data_world_size(self) -> int:
        return self.ctx.world_size

    @property
    def reports_samples(self) -> bool:
        return True

    def summary_info(self) -> dict[str, Any]:
        """Strategy-specific entries for summary.json (rank 0's)."""
        return {}

    def save_sharded(self, path: Path) -> None:
        """Strategies with collective_state_dict: write this rank's shards under ``path``."""
        raise NotImplementedError

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds: param_bytes, grad_bytes, optimizer_bytes."""
        return {}

    def finish(self) -> None:
        """Called once after the last step, before evaluation: e.g. a final synchronization
        for strategies whose replicas drift apart between synchronizations."""
        return None

    def may_leave(self) -> bool:
        """Whether a replica may leave the job after the step just trained (a preemption in
        place) with nothing of the others' lost: local SGD in place only just after a
        synchronization, so that every replica leaves with the state of the same one."""
        return True

    def replica_group(self) -> ReplicaGroup | None:
        """The processes of this rank's replica when it is more than this one (in-place
        HSDP's group); None: a replica is a process."""
        return None

    def resumed_at(self, step: int) -> None:
        """The loop began from the checkpoint of ``step`` (in place: where the quorum's step
        count starts)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, on every rank."""

    def rank_state_dict(self) -> dict[str, Any] | None:
        """State that differs between ranks (a local-SGD replica between synchronizations):
        every rank saves its own beside the checkpoint. None: nothing of the kind."""
        return None

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's ``rank_state_dict``, after ``load_state_dict``."""
        return None
