"""Top-k sparsification with error feedback (Stich et al. 2018; Lin et al.'s Deep Gradient
Compression).

Each rank sends its k = ratio * n largest-magnitude entries (value and index) and keeps the
rest as a residual that is added to the next step's gradient, so nothing is dropped for good,
only delayed. Different ranks pick different indices, so the payloads are all-gathered and
summed, not all-reduced. Values (fp32) and indices (int32) travel as one int32 tensor: 8 bytes
per kept entry, so the ratio is 1 / (2 * ratio) (50x at the default 0.01).
"""

from __future__ import annotations

from collections.abc import Hashable
from math import prod

import torch

from scaletrain.compression.base import Compressor, Residuals, Shapes


def num_kept(numel: int, ratio: float) -> int:
    return max(1, min(numel, int(numel * ratio)))


def top_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries, as torch.topk gives, in a fraction of its time on
    large tensors: a threshold from a strided 1% sample (set so that about 1.5 k entries pass)
    narrows the search to the candidates above it; an exact top-k runs on those. When fewer
    than k pass (a skewed tensor), the full top-k runs instead, so the result is always exact.
    (torch.topk over 4.2M entries for k = 42k takes ~100 ms on one CPU thread.)"""
    n = magnitudes.numel()
    if n < 100_000 or 2 * k > n:
        return magnitudes.topk(k, sorted=False).indices
    sample = magnitudes[:: n // (n // 100)]
    sample_k = min(sample.numel(), max(1, int(1.5 * k * sample.numel() / n)))
    threshold = sample.topk(sample_k, sorted=False).values.min()
    candidates = (magnitudes >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitudes.topk(k, sorted=False).indices
    return candidates[magnitudes[candidates].topk(k, sorted=False).indices]


class TopKCompressor(Compressor):
    collective = "all_gather"

    def __init__(self, world_size: int, *, ratio: float = 0.01) -> None:
        super().__init__(world_size)
        self.keep = ratio
        self.residuals = Residuals()

    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        corrected = self.residuals.add_to(key, grad)
        k = num_kept(corrected.numel(), self.keep)
        indices = top_indices(corrected.abs(), k)
        values = corrected[indices]
        corrected[indices] = 0  # what is left over becomes the residual
        self.residuals.set(key, corrected)
        return torch.cat([values.view(torch.int32), indices.to(torch.int32)])

    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        k = payload.shape[1] // 2
        values = payload[:, :k].contiguous().view(torch.float32).reshape(-1)
        indices = payload[:, k:].reshape(-1).long()
        out.zero_()
        out.index_add_(0, indices, values)
        out.div_(self.world_size)

    def ratio(self, shapes: Shapes) -> float:
        numel = sum(prod(s) for s in shapes)
        return numel / (2 * num_kept(numel, self.keep))
