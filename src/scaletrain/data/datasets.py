"""Built-in datasets and their registry.

- ``digits``: the real 8x8 handwritten digits bundled with scikit-learn (1,797 images, works
  offline), split 80/20 into train/test with a fixed stratified split (cached on disk after
  the first use: see ``digits_splits``).
- ``synthetic``: procedurally drawn RGB images of 10 shape classes (disk, square, ring, bars,
  cross, X, triangle, diamond, two dots) with random position, size, colours and noise. Sample i
  is a pure function of (split, i): nothing is stored, any size works, and every process draws
  the same image for the same index.

Both return whole batches from ``__getitems__`` (torch's batched-fetch hook) so the loader does
not build and stack one tensor per sample; ``collate_batch`` is the matching identity collate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scaletrain import env
from scaletrain.registry import lookup


class ImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A classification dataset that knows its input shape and class count."""

    input_shape: tuple[int, ...]
    num_classes: int

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]


def collate_batch(batch: Any) -> Any:
    """Identity collate for datasets whose ``__getitems__`` already returns a batch."""
    return batch


class TensorImageDataset(ImageDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> None:
        self.x, self.y = x, y
        self.input_shape = tuple(x.shape[1:])
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.y)

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.x[idx], self.y[idx]


def cache_dir() -> Path:
    """Where built-in data is cached: $SCALETRAIN_CACHE, else $XDG_CACHE_HOME/scaletrain, else
    ~/.cache/scaletrain."""
    if os.environ.get(env.CACHE):
        return Path(os.environ[env.CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scaletrain"


def digits_splits() -> dict[str, np.ndarray]:
    """The fixed train/test split of digits. Importing scikit-learn costs every process about
    1.5 s, so the split is cached as one .npz (written atomically; a damaged or foreign file
    is ignored and rewritten)."""
    names = ("x_train", "y_train", "x_test", "y_test")
    path = cache_dir() / "digits-v1.npz"
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in names}
        if len(arrays["y_train"]) == 1437 and len(arrays["y_test"]) == 360:
            return arrays
    except (OSError, ValueError, KeyError, EOFError):
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32) / 16.0
    y = bunch.target.astype(np.int64)
    split = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    arrays = dict(zip(("x_train", "x_test", "y_train", "y_test"), split, strict=True))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError:  # a read-only home: no cache, still correct
        pass
    return arrays


def build_digits(split: str, num_samples: int = 0, **_: Any) -> TensorImageDataset:
    arrays = digits_splits()
    x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
    if split == "train" and num_samples:
        if num_samples > len(y):
            raise ValueError(
                f"num_samples: digits has {len(y)} training samples, asked {num_samples}"
            )
        x, y = x[:num_samples], y[:num_samples]
    return TensorImageDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y), 10)


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Counter-based hash: independent uniform 64-bit values from integer keys."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def _uniforms(keys: np.ndarray, count: int) -> np.ndarray:
    """(len(keys), count) floats in [0, 1), a pure function of each key."""
    k = keys.astype(np.uint64)[:, None] * np.uint64(1024) + np.arange(count, dtype=np.uint64)
    return (_splitmix64(k) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _shape_mask(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    au, av = np.abs(u), np.abs(v)
    r2 = u * u + v * v
    inside = np.maximum(au, av) < 1.0
    masks: dict[int, Callable[[], np.ndarray]] = {
        0: lambda: r2 < 1.0,
        1: lambda: np.maximum(au, av) < 0.8,
        2: lambda: (r2 < 1.0) & (r2 > 0.4),
        3: lambda: (av < 0.3) & (au < 1.0),
        4: lambda: (au < 0.3) & (av < 1.0),
        5: lambda: ((au < 0.25) | (av < 0.25)) & inside,
        6: lambda: ((np.abs(u - v) < 0.35) | (np.abs(u + v) < 0.35)) & inside,
        7: lambda: (v < 0.8) & (au < (0.8 - v) / 1.6),
        8: lambda: au + av < 1.0,
        9: lambda: ((u - 0.5) ** 2 + v * v < 0.16) | ((u + 0.5) ** 2 + v * v < 0.16),
    }
    return masks[cls]()


class SyntheticShapes(ImageDataset):
    """RGB images of 10 shape classes, each a deterministic function of (split, index)."""

    num_classes = 10

    def __init__(self, num_samples: int, image_size: int, split: str) -> None:
        self.num_samples = num_samples
        self.size = image_size
        self.input_shape = (3, image_size, image_size)
        # Train and test draw from disjoint key ranges, so they never share an image.
        self.key_offset = 0 if split == "train" else 1 << 40
        grid = (np.arange(image_size) + 0.5) / image_size * 2 - 1
        self.yy, self.xx = np.meshgrid(grid, grid, indexing="ij")
        # Per-sample noise comes from a fixed bank: drawing fresh noise per image cost 2/3 of
        # the batch time, and a bank of 256 patterns is as good for learning shapes.
        bank_rng = np.random.Generator(np.random.PCG64(12345))
        self.noise_bank = bank_rng.random((256, 3, image_size, image_size), dtype=np.float32) - 0.5

    def __len__(self) -> int:
        return self.num_samples

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = np.asarray(indices, dtype=np.int64) + self.key_offset
        p = _uniforms(keys, 12)
        labels = (p[:, 0] * 10).astype(np.int64)
        cx, cy = (p[:, 1] - 0.5) * 0.6, (p[:, 2] - 0.5) * 0.6
        scale = 0.35 + 0.35 * p[:, 3]
        fg, bg = p[:, 4:7], p[:, 7:10] * 0.5
        images = np.empty((len(keys), 3, self.size, self.size), dtype=np.float32)
        for cls in np.unique(labels):
            sel = np.flatnonzero(labels == cls)
            u = (self.xx[None] - cx[sel, None, None]) / scale[sel, None, None]
            v = (self.yy[None] - cy[sel, None, None]) / scale[sel, None, None]
            mask = _shape_mask(int(cls), u, v)[:, None]
            images[sel] = np.where(mask, fg[sel, :, None, None], bg[sel, :, None, None])
        noise = self.noise_bank[(p[:, 11] * len(self.noise_bank)).astype(np.int64)]
        images += (0.3 * p[:, 10, None, None, None]).astype(np.float32) * noise
        return torch.from_numpy(images), torch.from_numpy(labels)


def build_synthetic(
    split: str, num_samples: int = 0, image_size: int = 32, **_: Any
) -> SyntheticShapes:
    n = num_samples or 20_000
    return SyntheticShapes(n if split == "train" else max(n // 10, 100), image_size, split)


DATASETS: dict[str, Callable[..., ImageDataset]] = {
    "digits": build_digits,
    "synthetic": build_synthetic,
}


def build_dataset(name: str, split: str, **options: Any) -> ImageDataset:
    return lookup(DATASETS, name, "dataset")(split, **options)
