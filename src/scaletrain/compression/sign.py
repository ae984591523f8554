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

import itertools
from collections.abc import Hashable
from math import prod

import torch

from scaletrain.compression.base import Compressor, Residuals, Shapes

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per entry, 1 where value >= 0, eight entries to a uint8, zero-padded."""
    bits = (values >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).reshape(-1, 8)
    packed = bits[:, 0] << 7
    for column in range(1, 8):
        packed |= bits[:, column] << (7 - column)
    return packed


# Row b: the eight signs (+1.0 / -1.0) that byte b encodes, so unpacking is one table lookup.
_SIGN_TABLE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) & _BIT_WEIGHTS) != 0) * 2.0 - 1


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of pack_signs, as +1.0 / -1.0 (leading dimensions kept)."""
    signs = _SIGN_TABLE.to(packed.device)[packed.long()]
    return signs.reshape(*packed.shape[:-1], -1)[..., :numel]


class SignCompressor(Compressor):
    collective = "all_gather"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.residuals = Residuals()
        self.bounds: dict[Hashable, list[tuple[int, int]]] = {}  # each tensor's [lo, hi)

    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        sizes = [prod(s) for s in shapes]
        ends = list(itertools.accumulate(sizes))
        self.bounds[key] = list(zip([0, *ends[:-1]], ends, strict=True))
        corrected = self.residuals.add_to(key, grad)
        packed = pack_signs(corrected)
        scales = torch.stack(
            [corrected[lo:hi].norm() / (hi - lo) ** 0.5 for lo, hi in self.bounds[key]]
        )
        # The residual, in place: corrected - scale * sign(corrected), tensor by tensor.
        for scale, (lo, hi) in zip(scales, self.bounds[key], strict=True):
            piece = corrected[lo:hi]
            piece.sub_(torch.where(piece >= 0, scale, -scale))
        self.residuals.set(key, corrected)
        return torch.cat([packed, scales.view(torch.uint8)])

    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        num_scale_bytes = 4 * len(self.bounds[key])
        # A fresh copy, not .contiguous(): with one rank the slice already counts as
        # contiguous, at an offset and row stride a float32 view refuses unless the packed
        # signs happen to fill whole words.
        scale_bytes = payload[:, -num_scale_bytes:].clone(memory_format=torch.contiguous_format)
        scales = scale_bytes.view(torch.float32)  # (world, T)
        signs = unpack_signs(payload[:, :-num_scale_bytes], out.numel())  # (world, n)
        # Per tensor, the weighted sum over ranks is one (world,) x (world, len) product.
        for tensor, (lo, hi) in enumerate(self.bounds[key]):
            torch.mv(signs[:, lo:hi].t(), scales[:, tensor], out=out[lo:hi])
        out.div_(self.world_size)

    def ratio(self, shapes: Shapes) -> float:
        numel = sum(prod(s) for s in shapes)
        return 4 * numel / (-(-numel // 8) + 4 * len(shapes))
