"""Activation checkpointing (--activation-checkpointing): each chosen block keeps only its
input in forward and recomputes its activations in backward (torch.utils.checkpoint, the
non-reentrant kind), trading compute for memory.

The block's ``forward`` is wrapped in place, so parameter names, state dicts and the weights'
hash stay those of the plain model, and every strategy wraps the model as before (DDP, FSDP2,
pipeline stages cut from it). Which blocks: the Task's ``checkpoint_modules`` (module
types), else the model's own ``activation_checkpoint_modules()`` (the built-in transformer's
blocks). The recomputation is deterministic: dropout inside a block draws the same mask
again (torch saves and restores the RNG state around it).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_types(model: nn.Module, named: tuple[type, ...] = ()) -> tuple[type, ...]:
    """The module types to checkpoint: ``named`` (a Task's), else the model's own."""
    if named:
        return named
    own = getattr(model, "activation_checkpoint_modules", None)
    return tuple(own()) if callable(own) else ()


def apply_activation_checkpointing(model: nn.Module, types: tuple[type, ...]) -> int:
    """Wrap the forward of every submodule of one of ``types``; how many were wrapped."""
    count = 0
    for module in model.modules():
        if module is not model and isinstance(module, types):
            # A partial (not a closure): deep copies of the model (pipeline stages, FSDP's
            # skeleton) bind it to their own copy of the module.
            module.forward = functools.partial(  # type: ignore[method-assign]
                checkpoint, module.forward, use_reentrant=False
            )
            count += 1
    return count
