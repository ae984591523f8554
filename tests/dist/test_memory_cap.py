"""--max-memory-per-rank with a model whose parameters and Adam state do not fit one rank: ddp
is refused before any worker starts, naming what would fit; fsdp and pipeline train it on 2
ranks, each rank's measured training state under the cap."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_no_orphans, run_cli, stress_only

# mlp width 256 on 32x32x3 images: 3072x1024 + 1024x1024 + 1024x10 weights, 4.2M parameters,
# 16.8 MB; with gradients and Adam's two buffers 67 MB on one rank.
CAP = 60_000_000
MODEL = ["--dataset", "synthetic", "--num-samples", "256", "--model", "mlp", "--width", "256",
         "--optimizer", "adam", "--lr", "0.001", "--max-memory-per-rank", str(CAP),
         "--nproc-per-node", "2", "--max-steps", "4", "--num-threads", "1"]  # fmt: skip


def test_ddp_over_the_cap_is_refused_naming_what_fits():
    from scaletrain.cli import build_parser
    from scaletrain.config import RunConfig, leaf_fields, with_overrides
    from scaletrain.launch import check_strategy

    args = vars(build_parser().parse_args(["run", *MODEL]))
    cfg = with_overrides(RunConfig(), {k: v for k, v in args.items() if k in leaf_fields()})
    with pytest.raises(ValueError) as error:
        check_strategy(cfg)  # what the launcher runs before any worker starts
    message = str(error.value)
    assert "max_memory_per_rank: ddp needs about 67.3 MB per rank with 2 ranks" in message
    assert "strategies that fit with 2 ranks: pipeline (50.3 MB), fsdp (58.8 MB)" in message


# The pipeline under the cap in every make stress round (make test's budget keeps fsdp's).
@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "fsdp"],
        pytest.param(["--strategy", "pipeline", "--drop-last"], marks=stress_only),
    ],
)
def test_sharded_strategies_train_it_under_the_cap(tmp_path, strategy):
    out = tmp_path / "run"
    result = run_cli("run", *MODEL, *strategy, "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    assert 0 < summary["max_rank_state_bytes"] <= CAP
    assert summary["max_rank_peak_rss_bytes"] > summary["max_rank_state_bytes"]
    assert "memory per rank" in result.stdout
    assert_no_orphans(out)
