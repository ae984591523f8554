"""The Compressor ABC: how one gradient bucket travels between workers in fewer bytes.

A compressor turns a flat fp32 gradient bucket into one payload tensor (``compress``), the
payload goes through one collective, and ``decompress`` turns what came back into the averaged
gradient. ``collective`` says which collective carries it:

- ``all_reduce`` for linear encodings (fp16, bf16, PowerSGD's factors): the sum of payloads
  decodes to the sum of gradients, so the network adds them up;
- ``all_gather`` for non-linear ones (top-k, sign): every worker receives every worker's
  payload and decodes each.

PowerSGD needs two collectives per bucket (P, then Q, which depends on the reduced P); such a
compressor sets ``rounds = 2`` and implements ``next_round``. The hook (compression/hook.py)
runs every round but the last one blocking, because gloo pairs collectives by issue order and
a round launched from a completion callback could interleave differently on different ranks.

State: compressors with error feedback keep a residual per bucket (``Residuals``). Buckets
are keyed by their parameters' storage addresses, so DDP's one-time bucket rebuild after the
first step cannot mix up residuals or warm starts. Residuals are per rank and are not
checkpointed: after a restart they start from zero, as at the start of training.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

Shapes = Sequence[torch.Size]


class Compressor(ABC):
    collective: ClassVar[str] = "all_reduce"
    rounds: ClassVar[int] = 1

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    @abstractmethod
    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        """The payload for ``grad``: this rank's flat fp32 bucket, which holds gradients of
        the given ``shapes`` back to back. ``grad`` itself must not be modified."""

    @abstractmethod
    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the average over workers into ``out`` (``grad``'s shape) from the payload
        after the last collective: summed (all_reduce), or every worker's stacked along a
        new first dimension (all_gather)."""

    @abstractmethod
    def ratio(self, shapes: Shapes) -> float:
        """fp32 bytes of a bucket with these gradient shapes over its payload bytes (all
        rounds): the factor by which this compressor shrinks what a rank hands to the network."""

    def next_round(self, key: Hashable, payload: torch.Tensor) -> torch.Tensor:
        """Multi-round compressors: the next round's payload from this round's result."""
        raise NotImplementedError

    def forget(self, key: Hashable) -> None:
        """Drop what this compressor remembers of ``key`` (error feedback, a warm start). The
        hook calls it on every rank alike after a step whose decoded gradient is not finite
        (an fp16 overflow, which the loss scaler then skips): that memory holds inf or NaN
        by then, and kept, it made every later step overflow too."""
        residuals = getattr(self, "residuals", None)
        if isinstance(residuals, Residuals):
            residuals.drop(key)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Residuals:
    """Error feedback memory: what compression dropped, added back before the next step."""

    def __init__(self) -> None:
        self._store: dict[Hashable, torch.Tensor] = {}

    def add_to(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """grad + residual(key), in a tensor the caller owns (``grad`` is left alone). The
        stored residual is consumed: its memory is reused, so one bucket costs one buffer."""
        residual = self._store.pop(key, None)
        if residual is None or residual.shape != grad.shape:
            return grad.clone()
        return residual.add_(grad)

    def set(self, key: Hashable, residual: torch.Tensor) -> None:
        self._store[key] = residual

    def drop(self, key: Hashable) -> None:
        self._store.pop(key, None)

    def held(self, key: Hashable) -> torch.Tensor | None:
        """What is held back for ``key`` (for inspection)."""
        return self._store.get(key)
