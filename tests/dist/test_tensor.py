"""Tensor parallelism (DTensor, Megatron-style splits of the built-in transformer): the same
training as one process, alone, with data-parallel replicas, and under fsdp (fsdp x tensor).
Real processes, real gloo all-reduces inside every block."""

from __future__ import annotations

import pytest
from torch import nn

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch import describe_plan
from scaletrain.models import build_model
from scaletrain.strategies.dtensor import check_tensor_parallel
from tests.dist.test_equivalence import GLOBAL_BATCH, train

SAMPLES = 115
# SGD, not Adam: Adam divides by the root of the squared gradient, so a near-zero gradient
# whose last bits differ (the split matmuls sum in another order) can flip an update of a
# whole lr; losses agree under Adam too, final weights only to ~1e-3.
TRANSFORMER = {"model": "transformer"}


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), 1, SAMPLES, **TRANSFORMER)


def assert_same_training(single, run, steps=10):
    ref_weights, ref = single
    weights, got = run
    ref_loss = {r["step"]: r["loss"] for r in ref["records"]}
    for step in range(1, steps + 1):
        rows = [r for r in got["records"] if r["step"] == step and r["samples"]]
        mean = sum(r["loss"] * r["samples"] for r in rows) / sum(r["samples"] for r in rows)
        assert mean == pytest.approx(ref_loss[step], abs=1e-4), f"step {step}"
    assert got["summary"]["steps"] == ref["summary"]["steps"]
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"


def test_tensor_parallel_matches_one_process(tmp_path, single):
    run = train(tmp_path, 2, SAMPLES, strategy="tensor", tp=2, batch_size=GLOBAL_BATCH,
                **TRANSFORMER)  # fmt: skip
    assert_same_training(single, run)
    summary = run[1]["summary"]
    assert summary["tensor_parallel"] == {"tp": 2, "data_parallel": 1}
    assert [r["samples"] > 0 for r in summary["per_rank"]] == [True, False]
    # Each rank holds half of every split matrix: well under the whole model's state.
    whole = single[1]["summary"]["per_rank"][0]["memory"]["param_bytes"]
    for rank in summary["per_rank"]:
        assert rank["memory"]["param_bytes"] < 0.6 * whole
        assert rank["comm_bytes"] > 0  # the all-reduces inside every block


@pytest.mark.parametrize("strategy", ["tensor", "fsdp"])
def test_tensor_parallel_times_data_parallel(tmp_path, single, strategy):
    """4 ranks: 2 groups of tp=2; replicas average (tensor) or shard (fsdp x tensor). The
    transformer's embedding owns a parameter and holds a Conv that owns others: fsdp must
    make them separate units (children first), or the parent takes them all and fails."""
    run = train(tmp_path, 4, SAMPLES, strategy=strategy, tp=2,
                batch_size=GLOBAL_BATCH // 2, **TRANSFORMER)  # fmt: skip
    assert_same_training(single, run)
    summary = run[1]["summary"]
    assert summary["tensor_parallel"] == {"tp": 2, "data_parallel": 2}
    assert summary["global_batch_size"] == GLOBAL_BATCH


def test_tensor_parallel_accumulates_micro_batches(tmp_path, single):
    """--grad-accum under tensor parallelism: 2 micro-batches of 6 on one tp=2 group train as
    one process with 12 (its no_sync was FSDP's, which a DTensor-parallel model lacks)."""
    run = train(tmp_path, 2, SAMPLES, strategy="tensor", tp=2, batch_size=GLOBAL_BATCH // 2,
                grad_accum=2, **TRANSFORMER)  # fmt: skip
    assert_same_training(single, run)


def test_fsdp_times_tensor_clips_by_the_norm_over_both_meshes(tmp_path):
    """fsdp x tensor holds gradients on two meshes (split layers on (dp, tp), the rest on
    dp; so with dp 1 too): clipped hard, it still trains as one process clipped alike."""
    clip = {"clip_grad_norm": 0.2, **TRANSFORMER}
    ref = train(tmp_path / "one", 1, SAMPLES, **clip)
    run = train(tmp_path / "fsdp", 2, SAMPLES, strategy="fsdp", tp=2,
                batch_size=GLOBAL_BATCH, **clip)  # fmt: skip
    assert max(r["grad_norm"] for r in ref[1]["records"]) > 0.2  # the clip was active
    assert_same_training(ref, run)


def transformer(width: int = 32) -> nn.Module:
    return build_model("transformer", (1, 8, 8), 10, width)


def test_tensor_parallel_checks():
    check_tensor_parallel(transformer(), 2, 4)
    with pytest.raises(ValueError, match="tp: 3 does not divide the hidden size"):
        check_tensor_parallel(transformer(), 3, 3)
    with pytest.raises(ValueError, match="tp: 8 does not divide the number of attention heads"):
        check_tensor_parallel(transformer(), 8, 8)
    with pytest.raises(ValueError, match="tp: 2 does not divide the world size 3"):
        check_tensor_parallel(transformer(), 2, 3)
    with pytest.raises(ValueError, match="has no tensor_parallel_plan"):
        check_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), 2, 2)
    with pytest.raises(ValueError, match="tensor parallelism runs under --strategy tensor or fsdp"):
        describe_plan(with_overrides(RunConfig(), {"tp": 2, "nproc_per_node": 2}))
