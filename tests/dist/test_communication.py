"""Less communication, nearly the same model: every compressor, local_sgd and diloco reach
the accuracy of uncompressed DDP on digits within the gap measured over 6 seeds (TOLERANCE),
and local_sgd / diloco reduce exactly to sync DDP in their degenerate settings. Real worker
processes, real gloo collectives."""

from __future__ import annotations

import json

import pytest
import torch

import scaletrain
from scaletrain.config import RunConfig, with_overrides
from tests.dist.test_equivalence import train

# Small buckets, so every compressor runs on several buckets per step, as gloo users have them.
BASE = {
    "nproc_per_node": 2,
    "dataset": "digits",
    "model": "cnn",
    "epochs": 12,
    "batch_size": 32,
    "lr": 0.05,
    "seed": 1,
    "deterministic": True,
    "bucket_mb": 0.05,
}
METHODS = {
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "topk": {"compression": "topk:ratio=0.01"},
    "powersgd": {"compression": "powersgd:rank=2"},
    "sign": {"compression": "sign"},
    "local_sgd": {"strategy": "local_sgd", "sync_every": 4},
    # The paper's inner optimizer; outer Nesterov SGD at the defaults (0.7, 0.9).
    "diloco": {"strategy": "diloco", "sync_every": 8, "optimizer": "adamw", "lr": 0.003},
}
# How far below ddp's accuracy each method may end (this test runs seed 1), set from the
# measured gap (method - ddp) on seeds 1-6 of this very configuration, ddp itself 0.969-0.983:
#   fp16 -0.006..+0.003   powersgd -0.006..+0.008   topk -0.025..+0.011   sign -0.014..+0.011
#   local_sgd -0.006..+0.008   diloco -0.033..0.000 (mean -0.020: at 12 epochs and these
#   outer settings diloco trails synchronous ddp by about 2 points; it is not "within 1")
# Each bound is the worst gap measured plus a small margin; none is 1 point for every method.
TOLERANCE = {"fp16": 0.01, "powersgd": 0.01, "topk": 0.03, "sign": 0.02, "local_sgd": 0.01,
             "diloco": 0.04}  # fmt: skip
# Compression ratio on the wire (2 workers): fp32 bytes / bytes sent.
RATIOS = {"fp16": (2, 2), "bf16": (2, 2), "topk": (45, 51), "powersgd": (5, 100), "sign": (25, 32)}


def run(tmp_path, name: str, overrides: dict) -> tuple[dict, list[dict]]:
    out = tmp_path / name
    cfg = with_overrides(RunConfig(), {**BASE, **overrides, "out": str(out)})
    summary = scaletrain.run(cfg, show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, records


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp"), "ddp", {})


def test_uncompressed_baseline_reports_its_communication(baseline):
    summary, records = baseline
    assert summary["test_accuracy"] >= 0.95
    assert summary["compression_ratio"] == pytest.approx(1.0)
    assert 0.0 <= summary["overlap"] <= 1.0
    # 2 ranks, ring all-reduce: each rank sends its whole fp32 gradient once per step.
    num_params = sum(
        v.numel()
        for v in torch.load(summary["run_dir"] + "/checkpoints/final.pt")["model"].values()
    )
    assert summary["comm_bytes_per_step"] == pytest.approx(4 * num_params, rel=0.01)
    # DDP starts with one bucket and rebuilds them after the first step.
    assert all(r["collectives"] > 2 for r in records if r["step"] > 2), "expected several buckets"


# bf16 is fp16's code path with another dtype (compression/fp16.py; unit tests cover its
# cast): one training run of the pair keeps the suite inside its time budget.
@pytest.mark.parametrize("method", sorted(m for m in METHODS if m != "bf16"))
def test_method_reaches_ddp_accuracy(tmp_path, baseline, method):
    base_summary, _ = baseline
    summary, records = run(tmp_path, method, METHODS[method])
    assert summary["test_accuracy"] >= base_summary["test_accuracy"] - TOLERANCE[method], (
        f"{method}: {summary['test_accuracy']:.4f} vs ddp {base_summary['test_accuracy']:.4f}"
    )
    keys = {"overlap", "comm_bytes", "dense_bytes", "comm_s", "compute_s", "cpu_s"}
    assert keys <= records[0].keys()
    assert all(r["cpu_s"] > 0 for r in records)  # the loop's own CPU, every step
    assert summary["replicas_agree"] is True  # every rank decoded the same update
    if method in RATIOS:
        lo, hi = RATIOS[method]
        assert lo <= summary["compression_ratio"] <= hi + 1e-9
        assert all(r["collectives"] > 2 for r in records if r["step"] > 2)
    else:
        # Parameters travel only on synchronization steps: H times fewer bytes than ddp.
        every = METHODS[method]["sync_every"]
        synced = [r for r in records if r["synced"]]
        assert {r["step"] % every for r in synced} == {0}
        assert all(r["comm_bytes"] == 0 for r in records if not r["synced"])
        assert summary["comm_bytes_per_step"] < base_summary["comm_bytes_per_step"] / (every - 1)


def test_top_k_keeping_everything_is_plain_ddp(tmp_path):
    """topk:ratio=1 sends every value and index: the update, and so the weights, must be
    plain DDP's (up to float order: within 1e-5), and the replicas must agree."""
    ref, _ = train(tmp_path / "ddp", 2, 115)
    weights, run_ = train(tmp_path / "topk", 2, 115, compression="topk:ratio=1")
    diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"
    assert run_["summary"]["replicas_agree"] is True


@pytest.mark.parametrize(
    "overrides",
    [
        {"strategy": "local_sgd", "sync_every": 1},
        {"strategy": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
    ],
    ids=["local_sgd", "diloco"],
)
def test_degenerate_settings_equal_sync_ddp(tmp_path, overrides):
    """Plain SGD, averaging after every step (and for diloco an outer step of lr 1 without
    momentum) is sync data parallelism: the sample-weighted average of the replicas' SGD steps
    is the SGD step on the mean gradient, also in the step where 3 ranks hold 3+2+2 samples."""
    plain_sgd = {"momentum": 0.0}
    ref, _ = train(tmp_path / "ddp", 1, 115, **plain_sgd)
    weights, run_ = train(tmp_path / "periodic", 3, 115, **plain_sgd, **overrides)
    assert run_["summary"]["steps"] == 20
    diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"
