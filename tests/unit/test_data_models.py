from __future__ import annotations

import pytest
import torch

from scaletrain.data.datasets import build_dataset
from scaletrain.fault.recovery import Progress
from scaletrain.metrics.summary import RankTotals, build_summary, params_sha256
from scaletrain.models import build_model


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known datasets: digits, synthetic"):
        build_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="known models: cnn, mlp"):
        build_model("resnet", (1, 8, 8), 10, 8)


def test_digits_split_is_fixed_and_disjoint():
    train, test = build_dataset("digits", "train"), build_dataset("digits", "test")
    assert (len(train), len(test)) == (1437, 360)
    assert train.input_shape == (1, 8, 8)
    x, y = train.__getitems__([0, 5])
    assert x.shape == (2, 1, 8, 8) and y.dtype == torch.int64
    assert float(x.max()) <= 1.0
    assert len(build_dataset("digits", "train", num_samples=100)) == 100


def test_synthetic_is_a_pure_function_of_the_index():
    a = build_dataset("synthetic", "train", num_samples=1000, image_size=16)
    b = build_dataset("synthetic", "train", num_samples=1000, image_size=16)
    xa, ya = a.__getitems__([3, 999, 17])
    xb, yb = b.__getitems__([17, 3])
    assert torch.equal(xa[0], xb[1]) and torch.equal(xa[2], xb[0])
    assert torch.equal(ya[[0, 2]], yb[[1, 0]])
    x1, y1 = a[999]
    assert torch.equal(x1, xa[1]) and int(y1) == int(ya[1])
    test = build_dataset("synthetic", "test", num_samples=1000, image_size=16)
    assert not torch.equal(test.__getitems__([3])[0], xa[:1])
    _, labels = a.__getitems__(list(range(1000)))
    assert set(labels.tolist()) == set(range(10))  # every class occurs


def test_synthetic_is_learnable():
    torch.manual_seed(0)
    train = build_dataset("synthetic", "train", num_samples=3000, image_size=16)
    test = build_dataset("synthetic", "test", num_samples=3000, image_size=16)
    model = build_model("cnn", train.input_shape, 10, 16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _epoch in range(4):
        perm = torch.randperm(len(train)).tolist()
        for i in range(0, len(perm), 64):
            x, y = train.__getitems__(perm[i : i + 64])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    x, y = test.__getitems__(list(range(len(test))))
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.7


def test_models_fit_both_datasets():
    for shape in ((1, 8, 8), (3, 32, 32)):
        for name in ("cnn", "mlp"):
            out = build_model(name, shape, 10, 8)(torch.zeros(2, *shape))
            assert out.shape == (2, 10)


def test_params_hash_sees_every_bit():
    model = build_model("mlp", (1, 8, 8), 10, 4)
    h = params_sha256(model)
    assert h == params_sha256(model)
    with torch.no_grad():
        p = next(model.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1.0))
    assert params_sha256(model) != h


def test_summary_weights_final_loss_by_samples():
    ranks = [RankTotals(rank=0), RankTotals(rank=1)]
    base = {
        "step_s": 1.0,
        "compute_s": 0.5,
        "comm_s": 0.2,
        "wait_s": 0.1,
        "data_s": 0.1,
        "comm_bytes": 8,
        "dense_bytes": 8,
    }
    ranks[0].add({**base, "samples": 3, "loss": 1.0})
    ranks[1].add({**base, "samples": 1, "loss": 3.0})
    progress = Progress(step=1, samples_trained=4)
    s = build_summary(ranks, wall_s=2.0, checkpoint_s=0.0, progress=progress,
                      test_accuracy=None, params_hash="x", info={})  # fmt: skip
    assert s["final_loss"] == pytest.approx(1.5)
    assert s["samples"] == 4 and s["samples_per_s"] == 2.0 and s["steps"] == 1
    assert s["time_breakdown"]["comm_s"] == pytest.approx(0.2)
    assert s["comm_share"] == pytest.approx(0.2)


def test_digits_split_is_cached_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    from scaletrain.data.datasets import build_digits

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    first = build_digits("train")
    cached = tmp_path / "digits-v1.npz"
    assert cached.exists()
    assert torch.equal(build_digits("train").x, first.x)  # read back from the cache
    cached.write_bytes(b"not an npz")
    again = build_digits("test")
    assert len(again) == 360 and cached.stat().st_size > 1000  # rebuilt and rewritten
    assert torch.equal(build_digits("train").y, first.y)
