"""Claim: reading shards through ShardedDataset + DataLoader runs at the speed of the memory map.

Writes N (default 1,000,000) synthetic 32x32x3 images into shards with scaletrain's writer and
prints GB written and seconds. Then reads one epoch in the sampler's shard-aware order, side
by side, interleaved, best of --repeats:

- raw: numpy only, straight from np.load(mmap_mode="r") of the same files, the same batches,
  gathered and converted to float32 in [0, 1] (the least work a training step needs);
- ShardedDataset + torch DataLoader with num_workers 0 and 2.

Prints samples/s of each and its ratio to raw (floor: 0.9). A last row feeds zeros of the same
shape through DataLoader with 2 workers: the ceiling torch's worker IPC sets for any dataset,
to read the workers=2 row against.

    python benchmarks/data_loading.py [--num-samples 1000000] [--dir /tmp/shards] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from floors import Floors  # noqa: E402
from torch.utils.data import DataLoader, Dataset

from scaletrain.data.datasets import build_dataset, collate_batch
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.shards import ShardedDataset, SplitSource, write_shards
from scaletrain.data.sources import to_uint8_nchw

FLOORS = Floors()


def write(out: Path, num_samples: int, shard_size: int) -> float:
    synthetic = build_dataset("synthetic", "train", num_samples=num_samples, image_size=32)

    def chunks():
        for lo in range(0, num_samples, 8192):
            x, y = synthetic.__getitems__(list(range(lo, min(lo + 8192, num_samples))))
            yield to_uint8_nchw(x.numpy(), "synthetic"), y.numpy()

    start = time.perf_counter()
    write_shards(out, [SplitSource(name="train", chunks=chunks())], num_classes=10,
                 shard_size=shard_size, source="synthetic")  # fmt: skip
    return time.perf_counter() - start


def batches(dataset: ShardedDataset, batch_size: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(len(dataset), world_size=1, rank=0, batch_size=batch_size, seed=0,
                              shard_sizes=dataset.shard_sizes)  # fmt: skip


def read_raw(root: Path, dataset: ShardedDataset, batch_size: int) -> float:
    maps = [(np.load(root / f"train/shard-{i:05d}.images.npy", mmap_mode="r"),
             np.load(root / f"train/shard-{i:05d}.labels.npy", mmap_mode="r"))
            for i in range(len(dataset.shard_sizes))]  # fmt: skip
    starts = np.cumsum([0, *dataset.shard_sizes])
    samples = 0
    start = time.perf_counter()
    for ids in batches(dataset, batch_size):
        idx = np.asarray(ids)
        shard = np.searchsorted(starts, idx, side="right") - 1
        parts = [(maps[s][0][idx[shard == s] - starts[s]], maps[s][1][idx[shard == s] - starts[s]])
                 for s in np.unique(shard)]  # fmt: skip
        images = np.concatenate([p[0] for p in parts]).astype(np.float32) * np.float32(1 / 255)
        samples += len(images)
    return samples / (time.perf_counter() - start)


def read_loader(dataset: ShardedDataset | Zeros, batch_size: int, workers: int) -> float:
    like = dataset.like if isinstance(dataset, Zeros) else dataset
    loader = DataLoader(dataset, batch_sampler=batches(like, batch_size),
                        collate_fn=collate_batch, num_workers=workers)  # fmt: skip
    samples = 0
    start = time.perf_counter()
    for images, _ in loader:
        samples += len(images)
    return samples / (time.perf_counter() - start)


class Zeros(Dataset):
    """Batches of zeros shaped like the shards': what DataLoader's worker IPC alone allows."""

    def __init__(self, like: ShardedDataset) -> None:
        self.like = like

    def __len__(self) -> int:
        return len(self.like)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(indices), *self.like.input_shape), torch.zeros(len(indices))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", help="where to write the shards (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the shards afterwards")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="scaletrain-shards-"))
    try:
        seconds = write(root, args.num_samples, args.shard_size)
        size = sum(p.stat().st_size for p in root.rglob("*.npy"))
        print(f"wrote {args.num_samples:,} images, {size / 1e9:.2f} GB in {seconds:.1f} s "
              f"({size / 1e9 / seconds:.2f} GB/s, generation included)")  # fmt: skip
        dataset = ShardedDataset(root)
        runs = {"raw memmap": lambda: read_raw(root, dataset, args.batch_size)}
        for workers in (0, 2):
            runs[f"DataLoader workers={workers}"] = lambda w=workers: read_loader(
                dataset, args.batch_size, w
            )
        # Not a reader of shards: the ceiling torch's worker processes put on any dataset.
        runs["zeros, DataLoader workers=2"] = lambda: read_loader(
            Zeros(dataset), args.batch_size, 2
        )
        best: dict[str, float] = {}
        for rep in range(args.repeats):
            for name, fn in runs.items():
                rate = fn()
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  rep {rep} {name:24s} {rate:12,.0f} samples/s", flush=True)
        print(f"\nreading one epoch, batch {args.batch_size}, shard-aware order, best of "
              f"{args.repeats}")  # fmt: skip
        print(f"{'reader':26s} {'samples/s':>12} {'ratio to raw':>13}  floor 0.9")
        for name, rate in best.items():
            ratio = rate / best["raw memmap"]
            judged = name.startswith("DataLoader")
            verdict = FLOORS.check(f"{name}: ratio to raw >= 0.9", ratio >= 0.9) if judged else "-"
            print(f"{name:26s} {rate:12,.0f} {ratio:13.3f}  {verdict}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    FLOORS.finish()


if __name__ == "__main__":
    main()
