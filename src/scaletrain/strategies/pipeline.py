"""Pipeline parallelism on torch.distributed.pipelining: the model is cut into P stages, one
per rank, and each batch into M microbatches that flow through the stages (GPipe: all
forwards, then all backwards; 1F1B: one forward, one backward in the steady state, so at most
P microbatches' activations are alive per stage).

Layout: ranks form a (data-parallel D) x (pipeline P) mesh, W = D x P; the P stages of one
pipeline are consecutive ranks, so activations travel between neighbours, and stage s of every
pipeline averages its gradients with its D - 1 peers (an all-reduce over the "dp" dimension,
weighted by samples, timed as communication). Every rank of a pipeline loads the same batch:
stage 0 feeds the inputs, the last stage the targets.

Split: the model must be an ``nn.Sequential`` (the built-in models are); its top-level layers
are cut into P contiguous stages, either where the user names (``--split-points 4,7``: the
layers that begin stages 2..P) or balanced by parameter count (the cut that minimizes the
largest stage). A stage keeps its layers' original names, so its state_dict keys are the full
model's: checkpoints are DCP directories keyed by those names, which load into any other split
or stage count. Layers a rank does not own are moved to the meta device (their memory freed);
``finish`` gathers the final weights into a whole replica on every rank for evaluation,
hashing and final.pt, as fsdp does.

Measurement: each stage times its own forward and backward chunks (and the loss on the last
stage): that is its busy time; the rest of the schedule's wall time it was idle, waiting for
a neighbour (the bubble, plus transfers). The trainer records ``stage_busy_s`` and
``stage_idle_s`` per step; summary.json's ``pipeline`` section gives the measured bubble
fraction, 1 - busy / wall summed over stages and steps (leaving out each attempt's first step,
which also infers the shapes between stages), beside the theoretical (P-1)/(M+P-1).

Constraints, checked before any worker starts: the batch divides into M equal microbatches
(stages exchange fixed shapes: a smaller step, an epoch's last, is padded to the full batch
with zero-weight stand-ins, so every sample still trains once and weighs what it would in one
process); 1F1B needs M >= P; P <= layers.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from scaletrain.config import RunConfig
from scaletrain.metrics.timers import sent_bytes
from scaletrain.strategies.base import Batch, LossFn, OptimizerFactory, StepResult, Strategy
from scaletrain.strategies.sharded_load import load_sharded

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Optimizer state flattened to one key per parameter and setting ("state.3.weight.
# momentum_buffer", "param_groups.3.weight.lr"): stages hold disjoint keys, none shared, so
# DCP keeps every stage's, and any other split finds its parameters' by name.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def layer_bytes(model: nn.Module) -> list[tuple[str, int]]:
    """(name, parameter bytes) of each top-level layer of a Sequential model."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"strategy: --strategy pipeline cuts the model into stages, so it must be an "
            f"nn.Sequential of layers; got {type(model).__name__}. Wrap its layers in "
            "nn.Sequential (in your task's model), or choose another strategy"
        )
    return [
        (name, sum(p.numel() * p.element_size() for p in layer.parameters()))
        for name, layer in model.named_children()
    ]


def balanced_cuts(sizes: Sequence[int], stages: int) -> list[int]:
    """Start indices of stages 2..P for ``sizes`` cut into ``stages`` contiguous non-empty
    parts, minimizing the largest part (ties: the latest cut, so a layer without parameters,
    an activation, stays with the layer before it). Exact dynamic programming,
    O(P n^2): models have tens or hundreds of layers."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest possible largest part when the first i layers form k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return cuts[::-1]


def plan_stages(model: nn.Module, stages: int, split_points: str) -> list[list[str]]:
    """The top-level layer names of each stage. ValueError naming what does not fit."""
    layers = layer_bytes(model)
    names = [name for name, _ in layers]
    if stages > len(layers):
        raise ValueError(
            f"stages: {stages} stages but the model has only {len(layers)} top-level layers "
            f"({', '.join(names)}); use at most {len(layers)} stages"
        )
    if split_points:
        points = [p.strip() for p in split_points.split(",") if p.strip()]
        unknown = [p for p in points if p not in names]
        if unknown:
            raise ValueError(
                f"split_points: no top-level layer named {', '.join(unknown)}; the layers "
                f"are {', '.join(names)}"
            )
        cuts = [names.index(p) for p in points]
        if len(cuts) != stages - 1:
            raise ValueError(
                f"split_points: {stages} stages need {stages - 1} split points, got "
                f"{len(cuts)} ({split_points})"
            )
        if cuts != sorted(set(cuts)) or (cuts and cuts[0] == 0):
            raise ValueError(
                f"split_points: must name layers in model order, after the first layer, "
                f"each once; got {split_points}"
            )
    else:
        cuts = balanced_cuts([size for _, size in layers], stages)
    bounds = [0, *cuts, len(names)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(stages)]


def pipeline_shape(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data-parallel replicas D, stages P) for this world size. ValueError if it cannot."""
    stages = cfg.parallel.stages or world_size
    if world_size % stages:
        raise ValueError(
            f"stages: {stages} stages do not divide the world size {world_size}; the world "
            "must hold a whole number of pipelines"
        )
    if cfg.parallel.schedule == "1f1b" and cfg.parallel.microbatches < stages:
        raise ValueError(
            f"microbatches: schedule 1f1b needs at least as many microbatches as stages "
            f"({cfg.parallel.microbatches} < {stages}); raise --microbatches or use gpipe"
        )
    return world_size // stages, stages


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the seconds it spends computing (its busy time)."""

    busy_s = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


class StageLayers(nn.Sequential):
    """A stage's layers, whose output goes to the next stage contiguous: torch's stage makes
    the receiving buffer with the layout of the output it first saw, and gloo receives only
    into contiguous tensors (the transformer's embedding gives a transposed activation, and
    every step failed with "input tensor has to be contiguous")."""

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        out = super().forward(x)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


class PipelineStrategy(Strategy):
    grad_accum_refusal = (
        "the schedule already accumulates gradients over its --microbatches before one update; "
        "raise --microbatches (and --batch-size) instead of --grad-accum"
    )
    balance_refusal = "the stages of a pipeline share one batch; not balanced here yet"
    compile_refusal = (
        "the stages run layers cut out of the model, not its forward; --compile would "
        "compile nothing (not supported here yet)"
    )
    collective = "pipeline activation send/recv"
    collective_state_dict = True

    @classmethod
    def checks_model(cls, cfg: RunConfig) -> bool:
        return True

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, model: nn.Module | None) -> None:
        super().check_config(cfg, world_size, model)
        m = cfg.parallel.microbatches
        if cfg.train.batch_size % m:
            raise ValueError(
                f"microbatches: {m} does not divide the batch size {cfg.train.batch_size}: "
                "every microbatch must have the same size"
            )
        pipeline_shape(cfg, world_size)
        if model is not None:
            plan_stages(model, pipeline_shape(cfg, world_size)[1], cfg.parallel.split_points)

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        stages = cfg.parallel.stages or world_size
        try:
            if world_size % stages:
                return None
            plan = plan_stages(model, stages, cfg.parallel.split_points)
        except ValueError:
            return None
        sizes = dict(layer_bytes(model))
        largest = max(sum(sizes[name] for name in names) for names in plan)
        return largest * (2 + optimizer_copies)

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.dp_size, self.num_stages = pipeline_shape(cfg, ctx.world_size)
        plan = plan_stages(model, self.num_stages, cfg.parallel.split_points)
        mesh = init_device_mesh(
            ctx.device.type, (self.dp_size, self.num_stages), mesh_dim_names=("dp", "pp")
        )
        self.dp_rank, self.stage_index = ctx.rank // self.num_stages, ctx.rank % self.num_stages
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.skeleton = copy.deepcopy(model).to("meta")  # the whole architecture, no memory
        own = plan[self.stage_index]
        for name, layer in model.named_children():
            if name not in own:
                layer.to("meta")  # frees the layers other stages hold
        children = dict(model.named_children())
        self.module = StageLayers(OrderedDict((name, children[name]) for name in own))
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.module.parameters()) if self.params else None
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.loss_s = 0.0
        self.boundary_bytes = 0
        self.module.register_forward_hook(self._count_boundary_bytes)

        self.real_per_microbatch: list[int] = []
        self.targets_ptr = 0

        def timed_loss(output: Any, target: Any) -> torch.Tensor:
            start = time.perf_counter()
            loss = self._weighted_loss(loss_fn, output, target)
            self.loss_s += time.perf_counter() - start
            return loss

        self.stage = TimedStage(
            self.module, self.stage_index, self.num_stages, ctx.device, group=self.pp_group
        )
        schedule = SCHEDULE_CLASSES[cfg.parallel.schedule]
        self.schedule = schedule(self.stage, cfg.parallel.microbatches, loss_fn=timed_loss)
        self.replica: nn.Module | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def data_rank(self) -> int:
        return self.dp_rank

    @property
    def data_world_size(self) -> int:
        return self.dp_size

    @property
    def reports_samples(self) -> bool:
        return self.is_last

    def summary_info(self) -> dict[str, Any]:
        p, m = self.num_stages, self.cfg.parallel.microbatches
        return {
            "pipeline": {
                "stages": p,
                "microbatches": m,
                "schedule": self.cfg.parallel.schedule,
                "data_parallel": self.dp_size,
                "bubble_theoretical": (p - 1) / (m + p - 1),
            }
        }

    def _weighted_loss(self, loss_fn: LossFn, output: Any, target: Any) -> torch.Tensor:
        """The loss of one microbatch: (M / n) x the sum of its real samples' losses (n: the
        rank's real samples), so that the schedule's mean over the M microbatches is the mean
        over the real samples; stand-ins weigh nothing. Which microbatch ``target`` is comes
        from where it lies in the step's targets (the schedule hands out views of them; it
        also calls the loss once more, to infer shapes, on the first microbatch)."""
        real_counts, parts = self.real_per_microbatch, len(self.real_per_microbatch)
        n = sum(real_counts)
        if n == self.cfg.train.batch_size:  # a full step: plain, as it always was
            return loss_fn(output, target)
        row = target[0].numel() * target.element_size() if target.dim() else 0
        m = (target.data_ptr() - self.targets_ptr) // (row * len(target)) if row else -1
        if not 0 <= m < parts:
            raise RuntimeError(
                "internal failure: pipeline: a loss target that is not a view of the step's "
                "targets (cannot tell its microbatch, so its stand-in samples' weight)"
            )
        real = real_counts[m]
        if real == 0:
            return loss_fn(output, target) * 0.0
        mean = loss_fn(output[:real], target[:real])
        return mean * (real * parts / n)

    def _pad(self, batch: Batch) -> tuple[Any, Any]:
        """The rank's share, padded to the full batch with stand-ins (copies of its first
        sample): the stages exchange microbatches of one shape, also in an epoch's smaller
        last step. Records how many real samples each microbatch holds."""
        full, parts = self.cfg.train.batch_size, self.cfg.parallel.microbatches
        size = full // parts
        n = batch.num_samples
        self.real_per_microbatch = [min(size, max(0, n - m * size)) for m in range(parts)]

        def pad(t: Any) -> Any:
            if not torch.is_tensor(t) or len(t) >= full:
                return t
            return torch.cat([t, t[:1].expand(full - len(t), *t.shape[1:])])

        inputs, targets = pad(batch.inputs), pad(batch.targets)
        if n < full and not torch.is_tensor(targets):
            raise ValueError(
                "pipeline: a step smaller than the batch is padded with stand-in samples, which "
                "needs tensor targets; pass --drop-last to drop the epoch's last, smaller step"
            )
        if torch.is_tensor(targets):
            targets = targets.contiguous()
            self.targets_ptr = targets.data_ptr()
        return inputs, targets

    def train_step(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.stage.busy_s = self.loss_s = 0.0
        self.boundary_bytes = 0
        inputs, targets = self._pad(batch)
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        target = targets if self.is_last else None
        with self.autocast():  # every stage's forward runs inside the schedule's step
            self.schedule.step(*args, target=target, losses=losses if self.is_last else None)
        pipeline_s = time.perf_counter() - start
        busy_s = self.stage.busy_s + self.loss_s
        comm_s, sent = 0.0, self.boundary_bytes
        if self.dp_size > 1 and self.params:
            sent += sent_bytes("all_reduce", self.param_bytes, self.dp_size)
            comm_start = time.perf_counter()
            self._average_gradients(batch)
            comm_s = time.perf_counter() - comm_start
        extras: dict[str, Any] = {}
        if self.cfg.optim.clip_grad_norm > 0:  # a collective over the stages: every rank
            extras["grad_norm"] = self.clip_gradients(self.params, self.cfg.optim.clip_grad_norm)
        if self.optimizer is not None:
            self.optimizer.step()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        step_s = time.perf_counter() - start
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        idle_s = max(pipeline_s - busy_s, 0.0)
        return StepResult(
            loss=loss,
            compute_s=step_s - idle_s - comm_s,
            comm_s=comm_s,
            wait_s=idle_s + comm_s,
            comm_bytes=sent,
            extras={
                "stage": self.stage_index,
                "stage_busy_s": busy_s,
                "stage_idle_s": idle_s,
                **extras,
            },  # fmt: skip
        )

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The norm over the whole model is over every stage's gradients: each stage's sum
        of squares, summed over the pipeline (its data-parallel peers hold the same averaged
        gradients), then every stage scales its own by the same coefficient."""
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for g in grads:
            local += g.detach().double().pow(2).sum()
        dist.all_reduce(local, group=self.pp_group)
        norm = float(local.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def _average_gradients(self, batch: Batch) -> None:
        """Sample-weighted mean of this stage's gradients over its data-parallel peers."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.mul_(batch.num_samples / batch.global_samples)
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()

    def _count_boundary_bytes(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Forward hook: activations cross each stage boundary forward, their gradients
        backward, so this rank sends its output (unless last) and, in backward, the
        gradient of its input (unless first): both the size of those tensors."""

        def size(obj: Any) -> int:
            if torch.is_tensor(obj):
                return obj.numel() * obj.element_size()
            if isinstance(obj, tuple | list):
                return sum(size(o) for o in obj)
            return 0

        self.boundary_bytes += (0 if self.is_last else size(output)) + (
            0 if self.is_first else size(inputs)
        )

    @property
    def model(self) -> nn.Module:
        if self.replica is None:
            raise RuntimeError("pipeline: the whole model exists only after finish()")
        return self.replica

    def memory_bytes(self) -> dict[str, int]:
        def size(tensors: Any) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        state = (
            [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            if self.optimizer is not None
            else []
        )
        return {
            "param_bytes": size(self.params),
            "grad_bytes": size(p.grad for p in self.params),
            "optimizer_bytes": size(state),
        }

    def state_dict(self) -> dict[str, Any]:
        """This stage's state only (keys are the whole model's names)."""
        state: dict[str, Any] = {"model": self.module.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer, options=FLAT)
        return state

    def save_sharded(self, path: Path) -> None:
        # Stages hold disjoint keys; the D replicas of a stage hold equal ones, which DCP
        # writes once.
        dcp.save(self.state_dict(), checkpoint_id=str(path))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "dcp" in state:  # read just this stage's keys, whatever split wrote them
            state_dict = self.state_dict()
            load_sharded(state_dict, state["dcp"])
            state = state_dict
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=FLAT)

    def eval_model(self) -> nn.Module:
        return self.gather_replica()

    def finish(self) -> None:
        self.replica = self.gather_replica()

    def gather_replica(self) -> nn.Module:
        """Every rank gets the whole model: the first pipeline's stages share their weights."""
        mine = (
            {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
            if self.dp_rank == 0
            else {}
        )
        gathered: list[dict[str, torch.Tensor] | None] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, mine)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        replica = self.skeleton.to_empty(device=self.ctx.device)
        replica.load_state_dict(full)
        return replica
