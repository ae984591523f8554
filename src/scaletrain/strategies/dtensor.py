"""DTensor helpers that tensor.py and fsdp.py share (fsdp --tp T splits layers as tensor.py
does, then shards over "dp"): the check that T can split a world and a model, the (dp, tp)
mesh, and the split itself. Here so that neither strategy imports the other's module."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from scaletrain.runtime import DistContext


def check_tensor_parallel(model: nn.Module | None, tp: int, world_size: int) -> None:
    """ValueError when ``tp`` cannot split this world or this model."""
    if world_size % tp:
        raise ValueError(
            f"tp: {tp} does not divide the world size {world_size}; the world must hold a "
            "whole number of tensor-parallel groups"
        )
    if model is None or tp == 1:
        return
    plan_fn = getattr(model, "tensor_parallel_plan", None)
    if plan_fn is None:
        raise ValueError(
            f"tp: model {type(model).__name__} has no tensor_parallel_plan() saying which "
            "layers to split; the built-in transformer (--model transformer) has one"
        )
    for what, size in getattr(model, "tensor_parallel_divisors", dict)().items():
        if size % tp:
            raise ValueError(f"tp: {tp} does not divide {what} ({size})")
    modules = dict(model.named_modules())
    for name, style in plan_fn().items():
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"tp: the plan names {name!r}, which is not a Linear of the model")
        rows = isinstance(style, RowwiseParallel)
        size = layer.in_features if rows else layer.out_features
        if size % tp:
            kind = "input" if rows else "output"
            raise ValueError(
                f"tp: {tp} does not divide the hidden size {size} ({kind} features of {name})"
            )


def tensor_parallel_mesh(ctx: DistContext, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh of this world."""
    check_tensor_parallel(None, tp, ctx.world_size)
    return init_device_mesh(
        ctx.device.type, (ctx.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Split the model's planned layers over mesh["tp"]; returns the row-split layers."""
    plan = model.tensor_parallel_plan()  # type: ignore[operator]
    parallelize_module(model, mesh["tp"], plan)
    modules = dict(model.named_modules())
    return [modules[n] for n, style in plan.items() if isinstance(style, RowwiseParallel)]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def flat_zeros(shape: torch.Size, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape.numel(), device=device)
