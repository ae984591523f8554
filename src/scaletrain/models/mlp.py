"""A three-layer perceptron on flattened inputs."""

from __future__ import annotations

import math

from torch import nn


def build_mlp(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    hidden = 4 * width
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
