"""On-disk shards: a directory of plain .npy files and a JSON manifest.

Layout of a shard directory::

    manifest.json
    train/shard-00000.images.npy   (n, C, H, W) uint8
    train/shard-00000.labels.npy   (n,) int64
    train/shard-00001.images.npy   ...
    test/...                       (when the source has a test split)

Why .npy: it is the simplest standard container there is (a short header, then the raw
C-ordered bytes), readable with nothing but numpy (``np.load(path, mmap_mode="r")``), and a
memory map of it is the data itself: the page cache is the read buffer, so reading a sample is
a copy out of the page cache and nothing else. A batch gather is the one copy a batch needs,
fused with the uint8 -> float32 conversion. Parquet or WebDataset tars would add a
dependency and a decode step for fixed-size tensors that need neither; HDF5 adds a library
with its own locking and caching in the way of the page cache.

The manifest records, per split, every shard's files, sample count and sha256, plus the sample
shape, dtype and number of classes. Every shard but the last of a split holds exactly
``shard_size`` samples. Files are written to a temporary name and renamed, the manifest last,
so a directory with a manifest is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from scaletrain.data.datasets import ImageDataset
from scaletrain.io import atomic_write_json

FORMAT = "scaletrain-shards/1"
MANIFEST = "manifest.json"


class ShardError(ValueError):
    """A shard directory is missing, incomplete, corrupted or inconsistent with its manifest."""


class _HashingWriter:
    """File wrapper that hashes what np.save writes through it, so writing is one pass."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.f.write(data)


def _save_npy(path: Path, array: np.ndarray) -> str:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        np.save(writer, np.ascontiguousarray(array), allow_pickle=False)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return writer.digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _rechunk(
    chunks: Iterable[tuple[np.ndarray, np.ndarray]], size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Regroup (images, labels) chunks of any sizes into chunks of exactly ``size`` (the last
    one shorter)."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    held = 0
    for x, y in chunks:
        xs.append(x)
        ys.append(y)
        held += len(y)
        while held >= size:
            x_all, y_all = np.concatenate(xs), np.concatenate(ys)
            yield x_all[:size], y_all[:size]
            xs, ys, held = [x_all[size:]], [y_all[size:]], held - size
    if held:
        yield np.concatenate(xs), np.concatenate(ys)


@dataclass(frozen=True, kw_only=True)
class SplitSource:
    """One split to write: chunks of (uint8 images NCHW, int64 labels)."""

    name: str
    chunks: Iterable[tuple[np.ndarray, np.ndarray]]


def write_shards(
    out: Path,
    splits: Sequence[SplitSource],
    *,
    num_classes: int,
    shard_size: int,
    source: str,
    class_names: Sequence[str] = (),
) -> dict[str, Any]:
    """Write every split as shards of ``shard_size`` samples and the manifest, last."""
    if shard_size < 1:
        raise ValueError(f"shard_size: must be >= 1, got {shard_size}")
    if (out / MANIFEST).exists():
        raise ValueError(f"{out} already holds shards ({MANIFEST} exists); choose another OUT")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "source": source,
        "num_classes": num_classes,
        "class_names": list(class_names),
        "shard_size": shard_size,
        "splits": {},
    }
    for split in splits:
        (out / split.name).mkdir(parents=True, exist_ok=True)
        entries = []
        for index, (x, y) in enumerate(_rechunk(split.chunks, shard_size)):
            if x.dtype != np.uint8 or x.ndim != 4 or y.shape != (len(x),):
                raise ValueError(
                    f"split {split.name}: expected uint8 (n, C, H, W) images and n labels"
                )
            if "sample_shape" in manifest and list(x.shape[1:]) != manifest["sample_shape"]:
                raise ValueError(
                    f"split {split.name}: image shape {x.shape[1:]} differs from earlier ones"
                )
            manifest["sample_shape"] = list(x.shape[1:])
            stem = f"{split.name}/shard-{index:05d}"
            entries.append(
                {
                    "images": f"{stem}.images.npy",
                    "labels": f"{stem}.labels.npy",
                    "num_samples": len(y),
                    "sha256": {
                        "images": _save_npy(out / f"{stem}.images.npy", x),
                        "labels": _save_npy(out / f"{stem}.labels.npy", y.astype(np.int64)),
                    },
                }
            )
        if not entries:
            raise ValueError(f"split {split.name} of {source} has no samples")
        manifest["splits"][split.name] = entries
    manifest["dtype"] = "uint8"
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{root} is not a shard directory: {path} is missing") from None
    except (OSError, ValueError) as e:
        raise ShardError(f"{path} is unreadable or not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardError(f"{path} is not a {FORMAT} manifest")
    return manifest


def _open_npy(path: Path, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ShardError(f"shard file {path} is missing") from None
    except (OSError, ValueError) as e:
        raise ShardError(f"shard file {path} is truncated or not a .npy file ({e})") from None
    if array.shape != shape or array.dtype != dtype:
        raise ShardError(
            f"shard file {path} holds {array.dtype}{list(array.shape)}, "
            f"the manifest says {dtype}{list(shape)}"
        )
    return array


def open_split(
    root: Path, split: str, *, verify: bool = False
) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.ndarray]]]:
    """Memory-map every shard of ``split``, checking it against the manifest (and its sha256
    when ``verify``). Raises ShardError naming the first bad file."""
    manifest = read_manifest(root)
    if split not in manifest["splits"]:
        raise ShardError(f"{root} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    sample_shape = tuple(manifest["sample_shape"])
    shards = []
    for entry in manifest["splits"][split]:
        n = entry["num_samples"]
        for kind in ("images", "labels"):
            path = root / entry[kind]
            if verify and path.exists() and file_sha256(path) != entry["sha256"][kind]:
                raise ShardError(
                    f"shard file {path} is corrupted: its sha256 differs from the manifest"
                )
        images = _open_npy(root / entry["images"], (n, *sample_shape), np.dtype(np.uint8))
        labels = _open_npy(root / entry["labels"], (n,), np.dtype(np.int64))
        shards.append((images, labels))
    return manifest, shards


class ShardedDataset(ImageDataset):
    """A torch Dataset over one split of a shard directory, memory-mapped.

    ``__getitems__`` gathers a batch shard by shard straight from the memory maps and returns
    float32 images in [0, 1] and int64 labels. ``shard_sizes`` lets the
    sampler shuffle shard-aware, so consecutive batches read neighbouring bytes.
    """

    def __init__(self, root: str | Path, split: str = "train", *, verify: bool = False) -> None:
        self.root = Path(root)
        manifest, self.shards = open_split(self.root, split, verify=verify)
        self.num_classes = int(manifest["num_classes"])
        self.input_shape = tuple(manifest["sample_shape"])
        self.shard_sizes = [len(labels) for _, labels in self.shards]
        self.starts = np.cumsum([0, *self.shard_sizes])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range for {len(self)} samples")
        images = np.empty((len(idx), *self.input_shape), dtype=np.float32)
        labels = np.empty(len(idx), dtype=np.int64)
        shard_of = np.searchsorted(self.starts, idx, side="right") - 1
        for s in np.unique(shard_of):
            where = np.flatnonzero(shard_of == s)
            local = idx[where] - self.starts[s]
            shard_images, shard_labels = self.shards[s]
            images[where] = shard_images[local]  # the one copy: page cache -> batch, cast
            labels[where] = shard_labels[local]
        images *= np.float32(1 / 255)
        return torch.from_numpy(images), torch.from_numpy(labels)
