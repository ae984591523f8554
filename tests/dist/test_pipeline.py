"""Pipeline parallelism: P stages in P processes compute what one process computes, under
both schedules, also as pipelines x data parallel; checkpoints survive a kill. Real
processes, real gloo send/recv between stages."""

from __future__ import annotations

import json

import pytest
from torch import nn

from scaletrain.config import RunConfig, with_overrides
from scaletrain.launch.memory import check_memory_budget
from scaletrain.strategies.pipeline import balanced_cuts, plan_stages
from tests.conftest import assert_no_orphans, run_cli
from tests.dist.test_equivalence import GLOBAL_BATCH, train

# digits through the width-8 CNN: 10 top-level layers; 115 samples = 9 steps of 12 per
# epoch with --drop-last, 18 steps in 2 epochs (10 an epoch without).
SAMPLES = 115


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), 1, SAMPLES, drop_last=True)


def assert_same_training(single, run, steps=10):
    ref_weights, ref = single
    weights, got = run
    assert got["summary"]["steps"] == ref["summary"]["steps"] == 18
    ref_loss = {r["step"]: r["loss"] for r in ref["records"]}
    for step in range(1, steps + 1):
        rows = [r for r in got["records"] if r["step"] == step and r["samples"]]
        mean = sum(r["loss"] * r["samples"] for r in rows) / sum(r["samples"] for r in rows)
        assert mean == pytest.approx(ref_loss[step], abs=1e-4), f"step {step}"
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_one_process(tmp_path, single, schedule):
    run = train(tmp_path, 2, SAMPLES, strategy="pipeline", schedule=schedule,
                microbatches=4, batch_size=GLOBAL_BATCH, drop_last=True)  # fmt: skip
    assert_same_training(single, run)
    summary = run[1]["summary"]
    pipeline = summary["pipeline"]
    assert pipeline["stages"] == 2 and pipeline["schedule"] == schedule
    assert pipeline["bubble_theoretical"] == pytest.approx(1 / 5)
    assert 0 < pipeline["bubble_measured"] < 1
    # Only the last stage reports samples and loss; every sample counts once.
    assert [r["samples"] for r in summary["per_rank"]] == [0, summary["samples"]]
    # Each stage holds only its own layers' state: together, the whole model's.
    whole = single[1]["summary"]["per_rank"][0]["memory"]["param_bytes"]
    parts = [r["memory"]["param_bytes"] for r in summary["per_rank"]]
    assert sum(parts) == whole and max(parts) < whole


def test_pipelines_times_data_parallel(tmp_path, single):
    """4 ranks: 2 pipelines of 2 stages (named split), each on half of every batch."""
    run = train(tmp_path, 4, SAMPLES, strategy="pipeline", stages=2, split_points="3",
                microbatches=2, batch_size=GLOBAL_BATCH // 2, drop_last=True)  # fmt: skip
    assert_same_training(single, run)
    summary = run[1]["summary"]
    assert summary["pipeline"]["data_parallel"] == 2
    assert summary["global_batch_size"] == GLOBAL_BATCH
    # Ranks 1 and 3 are the last stages of the two pipelines.
    assert [r["samples"] > 0 for r in summary["per_rank"]] == [False, True, False, True]


def test_pipeline_checkpoint_restart_gives_identical_weights(tmp_path):
    common = ["--nproc-per-node", "2", "--strategy", "pipeline", "--max-steps", "8",
              "--drop-last", "--microbatches", "2", "--deterministic", "--seed", "5",
              "--num-threads", "1"]  # fmt: skip
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli("run", *common, "--out", str(clean)).returncode == 0
    result = run_cli("run", *common, "--checkpoint-every", "3", "--max-restarts", "1",
                     "--inject", "kill:rank=0:step=5", "--out", str(killed))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summaries = [json.loads((d / "summary.json").read_text()) for d in (clean, killed)]
    assert summaries[1]["recoveries"][0]["step"] == 3
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    assert (killed / "checkpoints" / "step-00000006.dcp").is_dir()
    assert_no_orphans(killed)


def test_balanced_cuts_minimize_the_largest_stage():
    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_cuts([1, 2, 3, 4, 5], 3) == [3, 4]  # 6 | 4 | 5
    assert balanced_cuts([0, 0, 9, 0], 4) == [1, 2, 3]  # every stage gets a layer


def test_plan_stages_and_its_errors():
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 2))
    assert plan_stages(model, 2, "") == [["0", "1"], ["2", "3"]]
    assert plan_stages(model, 2, "3") == [["0", "1", "2"], ["3"]]
    with pytest.raises(ValueError, match="5 stages but the model has only 4 top-level layers"):
        plan_stages(model, 5, "")
    with pytest.raises(ValueError, match="no top-level layer named 9"):
        plan_stages(model, 2, "9")
    with pytest.raises(ValueError, match="3 stages need 2 split points"):
        plan_stages(model, 3, "2")
    with pytest.raises(ValueError, match="must be an nn.Sequential"):
        plan_stages(nn.Linear(2, 2), 2, "")


def test_pipeline_memory_estimate_is_the_largest_stage():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 1000))
    cfg = with_overrides(RunConfig(), {"optimizer": "adam"})
    estimates = check_memory_budget(cfg, model, 2)
    assert estimates["pipeline"] == 4 * 4 * (1000 * 1000 + 1000)  # one Linear + Adam
    assert estimates["ddp"] == 2 * estimates["pipeline"]


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"microbatches": 16}, 11, "stages: 11 stages but the model has only 10 top-level layers"),
        ({"stages": 2}, 3, "do not divide the world size 3"),
        ({"microbatches": 1}, 2, "1f1b needs at least as many microbatches as stages"),
    ],
)
def test_bad_pipeline_shapes_are_refused(overrides, world, message):
    from scaletrain.strategies.pipeline import PipelineStrategy
    from scaletrain.task import build_task

    cfg = with_overrides(RunConfig(), {"strategy": "pipeline", "drop_last": True, **overrides})
    with pytest.raises(ValueError, match=message):
        PipelineStrategy.check_config(cfg, world, build_task(cfg).model)


def test_bad_pipeline_input_fails_before_training(tmp_path):
    out = tmp_path / "run"
    result = run_cli("run", "--strategy", "pipeline", "--nproc-per-node", "2", "--drop-last",
                     "--microbatches", "5", "--out", str(out), timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "microbatches: 5 does not divide the batch size 32" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_pipeline_without_drop_last_pads_the_uneven_last_step(tmp_path, single):
    """Without --drop-last an epoch of 115 ends on a step of 7: 2 pipelines x 2 stages hold
    4 + 3 of them in microbatches of 3, padded with zero-weight stand-ins, and end with one
    process's weights (also over the uneven step); every sample trains once."""
    ref = train(tmp_path / "one", 1, SAMPLES)
    run = train(tmp_path / "pp", 4, SAMPLES, strategy="pipeline", stages=2, microbatches=2,
                batch_size=GLOBAL_BATCH // 2, log_sample_ids=True)  # fmt: skip
    weights, got = run
    assert got["summary"]["steps"] == ref[1]["summary"]["steps"] == 20
    diff = max((weights[k] - ref[0][k]).abs().max().item() for k in ref[0])
    assert diff <= 1e-5, diff
    for epoch in (0, 1):
        ids = [i for r in got["records"] if r["epoch"] == epoch for i in r["sample_ids"]]
        assert sorted(ids) == list(range(SAMPLES)), epoch
    last = [r for r in got["records"] if r["step"] == 10 and r["samples"]]
    assert sorted(r["samples"] for r in last) == [3, 4]
