"""Half-precision transport (fp16, bf16): half the bytes, no state.

Each rank divides by the world size before casting, as torch's fp16 hook does, so the sum
over ranks cannot overflow fp16's range where the undivided one might. bf16 keeps fp32's
exponent range with fewer mantissa bits. Both all-reduce in the half type (gloo and NCCL sum
fp16 and bf16).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from scaletrain.compression.base import Compressor, Shapes


class HalfCompressor(Compressor):
    dtype: torch.dtype = torch.float16

    def compress(self, key: Hashable, grad: torch.Tensor, shapes: Shapes) -> torch.Tensor:
        return (grad / self.world_size).to(self.dtype)

    def decompress(self, key: Hashable, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload)

    def ratio(self, shapes: Shapes) -> float:
        return 4 / (torch.finfo(self.dtype).bits // 8)


class FP16Compressor(HalfCompressor):
    dtype = torch.float16


class BF16Compressor(HalfCompressor):
    dtype = torch.bfloat16
