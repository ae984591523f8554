"""A small convolutional classifier for images of any size from 8x8 up.

Two 3x3 convolutions (pooling after the first one only when the image is large enough), an
adaptive pool to 4x4 and a two-layer head. No BatchNorm: its running statistics differ between
data-parallel ranks, which makes weight comparisons across world sizes noisier than they need
to be for the built-in model. With width w: about 150k parameters at w=32.
"""

from __future__ import annotations

from torch import nn


def build_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(f"model cnn needs images (C, H, W); the dataset gives shape {input_shape}")
    channels, height, _ = input_shape
    w = width
    layers: list[nn.Module] = [nn.Conv2d(channels, w, 3, padding=1), nn.ReLU()]
    if height >= 16:
        layers.append(nn.MaxPool2d(2))
    layers += [
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(2 * w * 16, 4 * w),
        nn.ReLU(),
        nn.Linear(4 * w, num_classes),
    ]
    return nn.Sequential(*layers)
