"""What every strategy's step does the same way, written once: mixed precision (--precision),
gradient accumulation (--grad-accum), gradient clipping (--clip-grad-norm) and the learning
rate the schedule sets (--lr-schedule, --warmup-steps). Strategy (base.py) inherits it;
each strategy's ``train_step`` calls ``forward_backward`` and ``step_optimizer`` instead of
writing forward, backward and ``optimizer.step()`` itself.

- Precision: forward (and the loss) run under ``torch.autocast`` in bf16 or fp16; weights,
  gradients and optimizer state stay fp32, so what the ranks communicate is fp32 gradients.
  fp16 adds torch's GradScaler (its state is in checkpoints); a strategy whose ranks hold
  different gradients (shards, stages) would need the scaler's overflow check agreed over
  ranks, and refuses fp16 (``supports_fp16``). bf16 needs no scaler: it runs everywhere, on
  CPU too.
- Accumulation: a rank's share of the step (up to --grad-accum x --batch-size samples) is
  cut into --grad-accum micro-batches (balanced; empty ones skipped), each one's mean loss
  weighted by its share of the rank's samples times the strategy's sample weight, so the sum
  of their gradients is exactly the gradient of the step's sample-weighted mean. The
  strategy's ``no_sync`` context keeps DDP (or FSDP) from synchronizing but on the last.
  Where the forward itself communicates over ranks that hold different samples (FSDP
  all-gathers each unit's parameters in every forward and backward), every rank must run
  the same number of micro-batches: a rank with fewer samples than --grad-accum in a step
  (an uneven last step, --balance) fills the empty ones with zero-weight stand-ins
  (``same_micro_batch_count``). Skipping them instead left that rank's all-gathers short
  of the others' and the step hung.
- Clipping: the norm over every rank's gradient (``clip_gradients``: torch's clip_grad_norm_,
  which reduces DTensor shards over their mesh; strategies whose gradients are split another
  way override it), measured after the gradients are synchronized, before the update; it
  goes into metrics.jsonl as ``grad_norm``.
- Learning rate: the loop sets each step's (``set_lr``); the schedule is schedule.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from scaletrain.data.partition import split_counts
from scaletrain.schedule import scale_lr

AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def slice_batch(obj: Any, lo: int, hi: int) -> Any:
    """Samples [lo, hi) of a batch: tensors along their first dimension, containers
    element by element, anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi]
    if isinstance(obj, tuple | list):
        return type(obj)(slice_batch(o, lo, hi) for o in obj)
    if isinstance(obj, dict):
        return {k: slice_batch(v, lo, hi) for k, v in obj.items()}
    return obj


def micro_batches(
    inputs: Any, targets: Any, num_samples: int, parts: int, pad: bool = False
) -> Iterator[Any]:
    """(inputs, targets, share of the rank's samples) of each non-empty micro-batch. A rank
    with no sample of its own (it holds one zero-weight stand-in) has one, of weight 0.
    With ``pad``, always ``parts`` micro-batches: the empty ones are the rank's first sample
    again, of weight 0 (a forward and backward that adds nothing but the collectives)."""
    if num_samples == 0:
        for _ in range(parts if pad else 1):
            yield inputs, targets, 0.0
        return
    lo = 0
    for count in split_counts(num_samples, parts):
        if count:
            yield (slice_batch(inputs, lo, lo + count), slice_batch(targets, lo, lo + count),
                   count / num_samples)  # fmt: skip
            lo += count
        elif pad:
            yield slice_batch(inputs, 0, 1), slice_batch(targets, 0, 1), 0.0


def clip_over_meshes(params: list[nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ for gradients on several device meshes (fsdp x tensor: layers
    split over "tp" and sharded over "dp" beside layers sharded over "dp" only): torch stacks
    the per-tensor norms, which DTensor refuses across meshes. One norm per mesh, reduced to
    a number, then the total; the same clip coefficient as torch's."""
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    squares = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        full = getattr(norm, "full_tensor", None)
        squares += float(full() if full is not None else norm) ** 2
    total = squares**0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    for p in params:
        assert p.grad is not None
        p.grad.mul_(coef)
    return total


class StepEssentials:
    """Mixed into Strategy; ``self.cfg`` and ``self.ctx`` are the strategy's."""

    # fp16's loss scaler skips a step when a gradient overflows: every rank must see the same
    # gradients to decide alike (replicas after their all-reduce do; shards and stages not).
    supports_fp16: ClassVar[bool] = False
    # Why --grad-accum, --compile do not apply ("" where they do).
    grad_accum_refusal: ClassVar[str] = ""
    compile_refusal: ClassVar[str] = ""
    balance_refusal: ClassVar[str] = ""
    # Every rank runs --grad-accum micro-batches, padding with zero-weight stand-ins: for a
    # strategy whose forward or backward communicates over ranks with different samples.
    same_micro_batch_count: ClassVar[bool] = False
    cfg: Any
    ctx: Any

    @classmethod
    def check_step_options(cls, cfg: Any) -> None:
        """ValueError, naming the strategy, for a step option it cannot honour."""
        # The mode that steps, as the user named it (in-place recovery steps for ddp).
        inplace = cfg.fault.recovery == "inplace" and cfg.train.strategy != "ps"
        name = "--recovery inplace" if inplace else f"--strategy {cfg.train.strategy}"
        if cfg.train.precision == "fp16-mixed" and not cls.supports_fp16:
            raise ValueError(
                f"precision: fp16-mixed needs a loss scaler whose overflow check every rank "
                f"agrees on; under {name} the ranks hold different gradients "
                "(shards, stages, or replicas of their own between synchronizations). Use "
                "--precision bf16-mixed, which needs no scaler"
            )
        if cfg.train.grad_accum > 1 and cls.grad_accum_refusal:
            raise ValueError(f"grad_accum: under {name} {cls.grad_accum_refusal}")
        if cfg.train.compile and cls.compile_refusal:
            raise ValueError(f"compile: under {name} {cls.compile_refusal}")
        if cfg.train.compile and cfg.parallel.tp > 1:  # fsdp x tensor: the same DTensor layers
            raise ValueError(
                f"compile: under {name} --tp {cfg.parallel.tp} the layers are "
                "DTensor-parallel, and compiling those is not supported here yet; drop "
                "--compile or --tp"
            )
        if cfg.train.balance != "none" and (cls.balance_refusal or cfg.parallel.tp > 1):
            why = cls.balance_refusal or "a tensor-parallel group shares one batch (--tp)"
            raise ValueError(f"balance: under {name} {why}")

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        if not hasattr(self, "_scaler"):
            fp16 = self.cfg.train.precision == "fp16-mixed"
            self._scaler = torch.amp.GradScaler(self.ctx.device.type) if fp16 else None
        return self._scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """--precision's autocast (a no-op under 32)."""
        dtype = AUTOCAST.get(self.cfg.train.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=dtype)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Backward without the strategy's gradient synchronization (accumulation's first
        micro-batches); strategies that synchronize inside backward override it."""
        return contextlib.nullcontext()

    def forward_backward(
        self,
        forward: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        inputs: Any,
        targets: Any,
        num_samples: int,
        weight: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of this rank's share (``num_samples`` samples) as --grad-accum
        micro-batches, each loss weighted by its share times ``weight`` (the strategy's sample
        weight); returns the mean loss over the share (detached)."""
        parts = list(micro_batches(inputs, targets, num_samples, self.cfg.train.grad_accum,
                                   pad=self.same_micro_batch_count))  # fmt: skip
        total = torch.zeros((), device=self.ctx.device)
        for i, (x, y, share) in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                with self.autocast():
                    loss = loss_fn(forward(x), y)
                scaled = loss * (share * weight) if share * weight != 1.0 else loss
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            total = total + loss.detach().float() * (share if num_samples else 1 / len(parts))
        return total

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip to ``max_norm`` the norm over every rank's gradient; returns that norm."""
        meshes = {id(getattr(p.grad, "device_mesh", None)) for p in params}
        if len(meshes) > 1:
            return clip_over_meshes(params, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor's norm is reduced over its mesh
        return float(full() if full is not None else norm)

    def step_optimizer(
        self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]
    ) -> dict[str, Any]:
        """Unscale (fp16), clip, update; the extras for the step's record."""
        extras: dict[str, Any] = {}
        max_norm = self.cfg.optim.clip_grad_norm
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if max_norm > 0:
            grads = [p for p in params if p.grad is not None]
            extras["grad_norm"] = self.clip_gradients(grads, max_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
            extras["loss_scale"] = float(self.scaler.get_scale())
        else:
            optimizer.step()
        return extras

    def compile_model(self, model: nn.Module) -> None:
        """--compile, before the strategy wraps the model: torch.compile its forward, in
        place (names, state dicts and the weights' hash stay the plain model's)."""
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers this process steps (for the learning rate)."""
        optimizer = getattr(self, "optimizer", None)
        return [optimizer] if optimizer is not None else []

    def set_lr(self, factor: float) -> None:
        """This step's learning rate: --lr's own (each group's as built) times ``factor``."""
        for optimizer in self.optimizers():
            scale_lr(optimizer, factor)

    def essentials_state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_essentials_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
