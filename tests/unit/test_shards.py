"""Shard writer and reader on a real file system: round trips, sources, and every bad file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scaletrain.data.shards import ShardedDataset, ShardError, SplitSource, open_split, write_shards
from scaletrain.data.sources import build_source


def random_images(n, seed=0, shape=(3, 8, 8)):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, *shape), dtype=np.uint8), rng.integers(0, 5, n).astype(np.int64)


@pytest.fixture
def shard_dir(tmp_path):
    x, y = random_images(25)
    chunks = [(x[:7], y[:7]), (x[7:8], y[7:8]), (x[8:], y[8:])]  # ragged on purpose
    out = tmp_path / "shards"
    write_shards(out, [SplitSource(name="train", chunks=chunks)], num_classes=5, shard_size=10,
                 source="test")  # fmt: skip
    return out, x, y


def test_round_trip_and_plain_numpy_readability(shard_dir):
    out, x, y = shard_dir
    manifest = json.loads((out / "manifest.json").read_text())
    entries = manifest["splits"]["train"]
    assert [e["num_samples"] for e in entries] == [10, 10, 5]
    # Readable without scaletrain: plain numpy, memory-mapped.
    first = np.load(out / entries[1]["images"], mmap_mode="r")
    assert np.array_equal(first, x[10:20])
    ds = ShardedDataset(out, "train", verify=True)
    assert len(ds) == 25 and ds.shard_sizes == [10, 10, 5] and ds.input_shape == (3, 8, 8)
    idx = [24, 0, 13, 9, 10, 13]
    images, labels = ds.__getitems__(idx)
    assert torch.allclose(images, torch.from_numpy(x[idx]).float() / 255)
    assert labels.tolist() == y[idx].tolist()


def test_refuses_to_overwrite(shard_dir):
    out, x, y = shard_dir
    with pytest.raises(ValueError, match="already holds shards"):
        write_shards(out, [SplitSource(name="train", chunks=[(x, y)])], num_classes=5,
                     shard_size=10, source="again")  # fmt: skip


def test_missing_truncated_corrupted_and_mismatched_shards(shard_dir):
    out, _, _ = shard_dir
    images = out / "train" / "shard-00001.images.npy"
    data = images.read_bytes()

    images.write_bytes(data[:-100])
    with pytest.raises(ShardError, match=r"shard-00001.images.npy is truncated"):
        open_split(out, "train")

    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    images.write_bytes(bytes(flipped))
    open_split(out, "train")  # same shape: only the checksum can tell
    with pytest.raises(ShardError, match=r"shard-00001.images.npy is corrupted"):
        open_split(out, "train", verify=True)

    images.unlink()
    with pytest.raises(ShardError, match=r"shard-00001.images.npy is missing"):
        open_split(out, "train")
    images.write_bytes(data)

    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"]["train"][2]["num_samples"] = 6
    (out / "manifest.json").write_text(json.dumps(manifest))
    expected = r"shard-00002.images.npy holds uint8\[5, 3, 8, 8\], the manifest says uint8\[6, "
    with pytest.raises(ShardError, match=expected):
        open_split(out, "train")
    with pytest.raises(ShardError, match="no split 'test'"):
        open_split(out, "test")
    with pytest.raises(ShardError, match="not a shard directory"):
        open_split(out / "train", "train")


def test_image_folder_source(tmp_path):
    from PIL import Image

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.png")
    source = build_source(str(root))
    assert source.class_names == ["cat", "dog"] and source.num_classes == 2
    write_shards(tmp_path / "out", source.splits, num_classes=2, shard_size=4, source="folder")
    ds = ShardedDataset(tmp_path / "out")
    assert len(ds) == 6 and ds.input_shape == (3, 12, 12)
    assert ds.__getitems__(list(range(6)))[1].tolist() == [0, 0, 0, 1, 1, 1]

    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(root / "dog" / "odd.png")
    with pytest.raises(ValueError, match="odd.png is 9x9, others are 12x12"):
        write_shards(tmp_path / "out2", build_source(str(root)).splits, num_classes=2,
                     shard_size=4, source="folder")  # fmt: skip
    resized = build_source(str(root), image_size=8)
    write_shards(tmp_path / "out3", resized.splits, num_classes=2, shard_size=4, source="folder")
    assert ShardedDataset(tmp_path / "out3").input_shape == (3, 8, 8)


def test_numpy_source_channels_last_floats(tmp_path):
    x = np.random.default_rng(1).random((10, 6, 6, 3), dtype=np.float32)
    y = np.arange(10) % 3
    np.savez(tmp_path / "data.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    source = build_source(str(tmp_path / "data.npz"))
    write_shards(tmp_path / "out", source.splits, num_classes=source.num_classes, shard_size=4,
                 source="npz")  # fmt: skip
    train, test = (
        ShardedDataset(tmp_path / "out", "train"),
        ShardedDataset(tmp_path / "out", "test"),
    )
    assert (len(train), len(test), train.num_classes) == (10, 4, 3)
    images, _ = train.__getitems__([3])
    assert torch.allclose(images[0], torch.from_numpy(x[3]).permute(2, 0, 1), atol=1 / 255)


def test_unknown_source(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in dataset"):
        build_source(str(tmp_path / "nothing"))


def test_numpy_source_npy_pair_grayscale(tmp_path):
    src = tmp_path / "arrays"
    src.mkdir()
    x = np.random.default_rng(2).integers(0, 256, (9, 5, 5), dtype=np.uint8)
    np.save(src / "images.npy", x)
    np.save(src / "labels.npy", np.arange(9) % 2)
    source = build_source(str(src))
    write_shards(tmp_path / "out", source.splits, num_classes=source.num_classes, shard_size=4,
                 source="npy")  # fmt: skip
    ds = ShardedDataset(tmp_path / "out")
    assert ds.input_shape == (1, 5, 5) and ds.shard_sizes == [4, 4, 1]
    assert torch.equal((ds.__getitems__([8])[0][0, 0] * 255).round().byte(), torch.from_numpy(x[8]))
