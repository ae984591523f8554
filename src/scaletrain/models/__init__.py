"""Built-in models and their registry: name -> factory(input_shape, num_classes, width)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from scaletrain.models.cnn import build_cnn
from scaletrain.models.mlp import build_mlp
from scaletrain.models.transformer import build_transformer
from scaletrain.registry import lookup

MODELS: dict[str, Callable[[tuple[int, ...], int, int], nn.Module]] = {
    "cnn": build_cnn,
    "mlp": build_mlp,
    "transformer": build_transformer,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, width: int) -> nn.Module:
    return lookup(MODELS, name, "model")(input_shape, num_classes, width)
