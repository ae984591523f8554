"""From a dataset to tensors on the device: the DataLoader every mode uses, and moving a
batch (tensors, or tuples, lists and dicts of them) to the device."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from scaletrain.data.datasets import ImageDataset, collate_batch


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def make_loader(dataset: Dataset[Any], *, cuda: bool, **kwargs: Any) -> DataLoader[Any]:
    # Built-in datasets return whole batches from __getitems__; user datasets get torch's collate.
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    if isinstance(base, ImageDataset):
        kwargs["collate_fn"] = collate_batch
    # Its own generator: iter(DataLoader) draws a base seed, which would otherwise come from
    # the global RNG, so a run resumed mid-epoch (one extra iter) would shift every random
    # stream (dropout masks) against the uninterrupted run.
    return DataLoader(dataset, pin_memory=cuda, generator=torch.Generator(), **kwargs)
