"""PowerSGD (Vogels et al. 2019): rank-r approximation of each gradient matrix by one step of
power iteration, with error feedback and warm start.

Per bucket, every gradient with two or more dimensions is viewed as a matrix M (n x m, conv
kernels as out x in*kh*kw) and, where rank r saves bytes, sent as two thin factors:

  round 1: P = M Q            (n x r), all-reduced; P <- orthonormal basis of P
  round 2: Q = M^T P          (m x r), all-reduced and divided by the world size
  result:  M ~ P Q^T,  residual = M - P Q^T   (added to the next step's M)

Vectors (biases) and matrices too small to gain go uncompressed, in round 1's payload. Both
products are linear in M, so summing the factors over ranks equals factoring the summed
gradient: the rounds are all-reduces. Q starts random from a generator seeded identically on
every rank (every rank must multiply by the same Q) and, with warm start, continues from the
last step's Q, which makes the single power iteration converge over steps.

Why not torch's powerSGD_hook: on gloo with several buckets it crashes or hangs (torch 2.13),
because it launches round 2 from round 1's completion callback, so ranks can issue the
collectives of different buckets in different orders. Here round 1 blocks (compression/hook.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from math import prod

import torch

from scaletrain.compression.base import Compressor, Residuals, Shapes


def as_matrix(shape: torch.Size) -> tuple[int, int]:
    return shape[0], prod(shape[1:])


def compressible(shape: torch.Size, rank: int) -> bool:
    """Whether a tensor of this shape is sent as rank-r factors: a matrix on which the factors
    (n + m) * r are fewer numbers than the matrix n * m."""
    if len(shape) < 2:
        return False
    n, m = as_matrix(shape)
    return (n + m) * min(rank, n, m) < n * m


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of p's columns (reduced QR), the same on every rank for the same p."""
    return torch.linalg.qr(p, mode="reduced").Q


@dataclass
class _BucketState:
    corrected: torch.Tensor  # this step's gradient plus residual (flat)
    p: list[torch.Tensor] = field(default_factory=list)  # orthonormal P per matrix (round 1)
    plain_mean: torch.Tensor | None = None  # the uncompressed pieces' average (round 1)


class PowerSGDCompressor(Compressor):
    rounds = 2

    def __init__(self, world_size: int, *, rank: int = 4, warm_start: bool = True) -> None:
        super().__init__(world_size)
        self.rank = rank
        self.warm_start = warm_start
        self.residuals = Residuals()
        # Q is kept transposed (r x m, contiguous): every product below then runs on
        # contiguous operands, ~4-10x faster on CPU than with the transposed gradient view.
        self.qt: dict[Hashable, list[torch.Tensor]] = {}
        self.pending: dict[Hashable, _BucketState] = {}
        self.shapes: dict[Hashable, Shapes] = {}
        self.generator = torch.Generator().manual_seed(0)

    def _views(
        self, key: Hashable, flat: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Split a flat bucket into (compressed matrices, uncompressed pieces), as views."""
        matrices, plain, offset = [], [], 0
        for shape in self.shapes[key]:
            numel = prod(shape)
            piece = flat[offset : offset + numel]
            offset += numel
            if compressible(shape, self.rank):
                matrices.append(piece.view(as_matrix(shape)))
            else:
                plain.append(piece)
        return matrices, plain

    def _initial_qt(self, key: Hashable, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        old = self.qt.get(key)
        same_layout = old is not None and [qt.shape[1] for qt in old] == [
            m.shape[1] for m in matrices
        ]
        if self.warm_start and same_layout:
            return old  # type: ignore[return-value]
        qts = []
        for m in matrices:
            r = min(self.rank, *m.shape)
            q = torch.randn(m.shape[1], r, generator=self.generator)
            qts.append(orthonormalize(q).t().contiguous().to(m.device))
        return qts

    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        self.shapes[key] = list(shapes)
        corrected = self.residuals.add_to(key, grad)
        matrices, plain = self._views(key, corrected)
        qts = self._initial_qt(key, matrices)
        self.qt[key] = qts
        self.pending[key] = _BucketState(corrected=corrected)
        ps = [m @ qt.t() for m, qt in zip(matrices, qts, strict=True)]
        return torch.cat([t.reshape(-1) for t in plain + ps]) if plain or ps else grad.new_zeros(0)

    def next_round(self, key: Hashable, payload: torch.Tensor) -> torch.Tensor:
        state = self.pending[key]
        matrices, plain = self._views(key, state.corrected)
        offset = sum(t.numel() for t in plain)
        # Uncompressed pieces are complete after round 1: keep their average as the result.
        state.plain_mean = payload[:offset] / self.world_size
        for m, qt in zip(matrices, self.qt[key], strict=True):
            size = m.shape[0] * qt.shape[0]
            p = payload[offset : offset + size].view(m.shape[0], qt.shape[0])
            offset += size
            state.p.append(orthonormalize(p))
        qts = [p.t() @ m for m, p in zip(matrices, state.p, strict=True)]  # (M^T P)^T
        return torch.cat([qt.reshape(-1) for qt in qts]) if qts else payload.new_zeros(0)

    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        state = self.pending.pop(key)
        matrices_out, plain_out = self._views(key, out)
        offset, qts = 0, []
        for m, p in zip(matrices_out, state.p, strict=True):
            size = m.shape[1] * p.shape[1]
            qt = payload[offset : offset + size].view(p.shape[1], m.shape[1]) / self.world_size
            offset += size
            torch.matmul(p, qt, out=m)
            qts.append(qt)
        assert state.plain_mean is not None
        start = 0
        for piece in plain_out:
            piece.copy_(state.plain_mean[start : start + piece.numel()])
            start += piece.numel()
        # Error feedback: what this rank's corrected gradient holds beyond the shared low-rank
        # result. Uncompressed pieces lost nothing, so their residual is zero.
        residual = state.corrected.sub_(out)
        for piece in self._views(key, residual)[1]:
            piece.zero_()
        self.residuals.set(key, residual)
        if self.warm_start:
            self.qt[key] = qts

    def forget(self, key: Hashable) -> None:
        """Also the warm start: Q computed from a non-finite gradient is NaN. Every rank
        forgets at the same step, so their next Q (drawn from the same generator) agrees."""
        super().forget(key)
        self.qt.pop(key, None)

    def ratio(self, shapes: Shapes) -> float:
        dense = sum(prod(s) for s in shapes)
        sent = 0
        for shape in shapes:
            if compressible(shape, self.rank):
                n, m = as_matrix(shape)
                sent += (n + m) * min(self.rank, n, m)
            else:
                sent += prod(shape)
        return dense / sent
