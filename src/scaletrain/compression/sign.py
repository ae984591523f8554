"""Scaled sign compression (1 bit per entry) with error feedback, after 1-bit SGD (Seide et al.
2014) and EF-SignSGD (Karimireddy et al. 2019).

Each rank sends sign(g) as packed bits plus one fp32 scale per gradient tensor (one scale per
bucket would let the largest layer's magnitude swamp the others), and keeps g - scale * sign(g)
as its residual. The scale is norm-preserving, ||g||_2 / sqrt(n), so the decoded tensor has
the gradient's L2 norm. EF-SignSGD's mean(|g|) is the scale its convergence proof needs (it
never makes the residual grow), but under momentum SGD it trained the digits CNN to 86% test
accuracy against 97% uncompressed at lr 0.05 (and diverged at 0.1), while the norm-preserving
scale reached 97%: residuals under mean(|g|) hold back the large entries for many steps and
momentum amplifies their late release. The decoded gradient is the mean over
ranks of scale_r * sign_r. Bits of different ranks cannot be summed bitwise, so payloads are
all-gathered. Payload: ceil(n / 8) + 4 bytes per tensor, so the ratio approaches 32.
"""

from __future__ import annotations

from collections.abc import Hashable
from math import prod

import torch

from scaletrain.compression.base import Compressor, Residuals, Shapes

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per entry, 1 where value >= 0, eight entries to a uint8, zero-padded."""
    bits = (values >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).reshape(-1, 8)
    return (bits * _BIT_WEIGHTS.to(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of pack_signs, as +1.0 / -1.0 (leading dimensions kept)."""
    weights = _BIT_WEIGHTS.to(packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :numel]
    return bits.to(torch.float32) * 2 - 1


class SignCompressor(Compressor):
    collective = "all_gather"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.residuals = Residuals()
        self.sizes: dict[Hashable, torch.Tensor] = {}

    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        sizes = self.sizes[key] = torch.tensor([prod(s) for s in shapes], device=grad.device)
        corrected = self.residuals.add_to(key, grad)
        pieces = corrected.split(sizes.tolist())
        scales = torch.stack([piece.norm() / piece.numel() ** 0.5 for piece in pieces])
        signs = torch.where(corrected >= 0, 1.0, -1.0)
        self.residuals.set(key, corrected - scales.repeat_interleave(sizes) * signs)
        return torch.cat([pack_signs(corrected), scales.view(torch.uint8)])

    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        sizes = self.sizes[key]
        num_scale_bytes = 4 * len(sizes)
        scales = payload[:, -num_scale_bytes:].contiguous().view(torch.float32)  # (world, T)
        signs = unpack_signs(payload[:, :-num_scale_bytes], out.numel())  # (world, n)
        torch.sum(signs * scales.repeat_interleave(sizes, dim=1), dim=0, out=out)
        out.div_(self.world_size)

    def ratio(self, shapes: Shapes) -> float:
        numel = sum(prod(s) for s in shapes)
        return 4 * numel / (-(-numel // 8) + 4 * len(shapes))
