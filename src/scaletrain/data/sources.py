"""What ``scaletrain shard SRC OUT`` can convert, each as splits of (uint8 NCHW, int64) chunks.

- a built-in dataset name (``digits``, ``synthetic``): train and test splits, images quantized
  to uint8;
- an image folder with one subfolder per class (PNG/JPEG, read with Pillow), or with
  ``train/`` and ``test/`` folders laid out that way;
- numpy arrays: a ``.npz`` with ``images``/``labels`` (or ``x_train``/``y_train`` and
  optionally ``x_test``/``y_test``), or a directory with ``images.npy`` and ``labels.npy``.
  Images may be (N, H, W), (N, C, H, W) or (N, H, W, C), uint8 or floats in [0, 1].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.data.datasets import DATASETS, build_dataset
from scaletrain.data.shards import SplitSource

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
CHUNK = 4096


@dataclass(frozen=True, kw_only=True)
class Source:
    splits: list[SplitSource]
    num_classes: int
    class_names: list[str]
    description: str


def to_uint8_nchw(x: np.ndarray, where: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise ValueError(
            f"{where}: images must be (N, H, W), (N, C, H, W) or (N, H, W, C), got {x.shape}"
        )
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return np.clip(np.rint(x * 255), 0, 255).astype(np.uint8)
    raise ValueError(f"{where}: images must be uint8 or floats in [0, 1], got {x.dtype}")


def builtin_source(name: str, num_samples: int, image_size: int) -> Source:
    splits = []
    num_classes = 0
    for split in ("train", "test"):
        dataset = build_dataset(name, split, num_samples=num_samples, image_size=image_size)
        num_classes = dataset.num_classes

        def chunks(ds=dataset) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for lo in range(0, len(ds), CHUNK):
                x, y = ds.__getitems__(list(range(lo, min(lo + CHUNK, len(ds)))))
                yield to_uint8_nchw(x.numpy(), name), y.numpy()

        splits.append(SplitSource(name=split, chunks=chunks()))
    return Source(splits=splits, num_classes=num_classes, class_names=[], description=name)


def _read_image(path: Path, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
            if size is not None and rgb.size != size:
                rgb = rgb.resize(size)
            return np.asarray(rgb, dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from None


def folder_source(root: Path, image_size: int) -> Source:
    split_dirs = {s: root / s for s in ("train", "test") if (root / s).is_dir()}
    if "train" not in split_dirs:
        split_dirs = {"train": root}
    classes = sorted(p.name for p in split_dirs["train"].iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{root}: no class subfolders (expected {root}/<class>/<image>.png)")
    size = (image_size, image_size) if image_size else None
    first_shape: list[tuple[int, ...]] = []

    def chunks(split_dir: Path) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        files = [
            (path, label)
            for label, name in enumerate(classes)
            if (split_dir / name).is_dir()
            for path in sorted((split_dir / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not files:
            raise ValueError(f"{split_dir}: no PNG or JPEG images in the class folders")
        for lo in range(0, len(files), 512):
            images, labels = [], []
            for path, label in files[lo : lo + 512]:
                image = _read_image(path, size)
                if not first_shape:
                    first_shape.append(image.shape)
                if image.shape != first_shape[0]:
                    raise ValueError(
                        f"image {path} is {image.shape[1]}x{image.shape[0]}, others are "
                        f"{first_shape[0][1]}x{first_shape[0][0]}; pass --image-size to resize all"
                    )
                images.append(image)
                labels.append(label)
            yield to_uint8_nchw(np.stack(images), str(split_dir)), np.asarray(labels, np.int64)

    splits = [SplitSource(name=s, chunks=chunks(d)) for s, d in split_dirs.items()]
    return Source(
        splits=splits, num_classes=len(classes), class_names=classes, description=str(root)
    )


def numpy_source(path: Path) -> Source:
    if path.is_dir():
        try:
            arrays = {
                "images": np.load(path / "images.npy"),
                "labels": np.load(path / "labels.npy"),
            }
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: expected images.npy and labels.npy ({e})") from None
    else:
        try:
            with np.load(path) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path} as .npz: {e}") from None
    pairs = {"train": ("x_train", "y_train"), "test": ("x_test", "y_test")}
    if "images" in arrays:
        pairs = {"train": ("images", "labels")}
    elif "x_train" not in arrays:
        raise ValueError(
            f"{path}: expected arrays images/labels or x_train/y_train, found {sorted(arrays)}"
        )
    splits, max_label = [], 0
    for split, (xk, yk) in pairs.items():
        if xk not in arrays:
            continue
        x, y = to_uint8_nchw(arrays[xk], f"{path}:{xk}"), np.asarray(arrays[yk]).astype(np.int64)
        if len(x) != len(y):
            raise ValueError(f"{path}: {len(x)} images but {len(y)} labels in {split}")
        max_label = max(max_label, int(y.max()) if len(y) else 0)
        splits.append(SplitSource(name=split, chunks=[(x, y)]))
    return Source(splits=splits, num_classes=max_label + 1, class_names=[], description=str(path))


def build_source(src: str, *, num_samples: int = 0, image_size: int = 0) -> Source:
    if src in DATASETS:
        return builtin_source(src, num_samples, image_size or 32)
    path = Path(src)
    if not path.exists():
        raise ValueError(
            f"SRC {src!r} is neither a built-in dataset ({', '.join(sorted(DATASETS))}) "
            "nor an existing file or folder"
        )
    if path.suffix == ".npz" or (path / "images.npy").exists():
        return numpy_source(path)
    if path.is_dir():
        return folder_source(path, image_size)
    raise ValueError(
        f"SRC {src}: expected a .npz file, a folder of class folders, or a dataset name"
    )
