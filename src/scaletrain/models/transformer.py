"""A small vision transformer: the image is cut into 16 patches (tokens), embedded, passed
through pre-norm blocks (multi-head self-attention, then an MLP) and mean-pooled into a linear
head. With width w the model dimension is 2w (64 at the default 32), 4 heads, 2 blocks.

It is an ``nn.Sequential`` of named layers (embed, block0, block1, ..., head), so pipeline
parallelism can cut it between blocks, and it carries its tensor-parallel plan
(``tensor_parallel_plan``): Megatron-style, q/k/v and the MLP's first layer split by output
columns, the attention projection and the MLP's second layer by input rows, so each block
needs one all-reduce forward and one backward for attention and for the MLP. Attention works
on whatever heads its rank holds (``-1`` in the reshape), which is how a column-split q/k/v
gives each rank heads / tp heads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HEADS = 4
DEPTH = 2


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, image: int, dim: int) -> None:
        super().__init__()
        self.patch = max(1, image // 4)
        tokens = (image // self.patch) ** 2
        self.proj = nn.Conv2d(channels, dim, self.patch, stride=self.patch)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, T, h*d) -> (B, h, T, d), h local
            return t.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(y.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class Transformer(nn.Sequential):
    def __init__(self, channels: int, image: int, num_classes: int, dim: int) -> None:
        layers: list[tuple[str, nn.Module]] = [("embed", PatchEmbed(channels, image, dim))]
        layers += [(f"block{i}", Block(dim, HEADS)) for i in range(DEPTH)]
        layers.append(("head", Head(dim, num_classes)))
        super().__init__(OrderedDict(layers))
        self.dim, self.heads = dim, HEADS

    def activation_checkpoint_modules(self) -> tuple[type, ...]:
        """What --activation-checkpointing recomputes: each block (models/checkpointing.py)."""
        return (Block,)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(DEPTH):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
                plan[f"block{i}.{name}"] = ColwiseParallel()
            for name in ("attn.out", "mlp.fc2"):
                plan[f"block{i}.{name}"] = RowwiseParallel()
        return plan

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """What a tensor-parallel degree must divide, by name."""
        return {"the hidden size": self.dim, "the number of attention heads": self.heads}


def build_transformer(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(
            f"model transformer needs square images (C, H, H); the dataset gives {input_shape}"
        )
    channels, image, _ = input_shape
    dim = 2 * width
    if dim % HEADS:
        raise ValueError(f"width: the transformer needs 2 * width divisible by {HEADS} heads")
    return Transformer(channels, image, num_classes, dim)
