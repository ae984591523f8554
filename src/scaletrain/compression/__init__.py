"""Compressor registry: name -> Compressor class, parsed from ``--compression NAME[:opts]``."""

from __future__ import annotations

from scaletrain.compression.base import Compressor
from scaletrain.compression.fp16 import BF16Compressor, FP16Compressor
from scaletrain.compression.powersgd import PowerSGDCompressor
from scaletrain.compression.sign import SignCompressor
from scaletrain.compression.spec import parse_compression
from scaletrain.compression.topk import TopKCompressor

COMPRESSORS: dict[str, type[Compressor]] = {
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
    "topk": TopKCompressor,
    "powersgd": PowerSGDCompressor,
    "sign": SignCompressor,
}


def build_compressor(spec: str, world_size: int) -> Compressor | None:
    """The compressor ``spec`` names, or None for 'none' (plain all-reduce)."""
    name, options = parse_compression(spec)
    if name == "none":
        return None
    return COMPRESSORS[name](world_size, **options)


__all__ = ["COMPRESSORS", "Compressor", "build_compressor"]
