"""Loading sharded (DCP) checkpoints: one written before optimizers recorded their base
learning rate still restores, and nothing else that a checkpoint lacks is let through."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from scaletrain.strategies.sharded_load import drop_absent_base_lr, load_sharded

# One process, no process group: DCP says it assumes a single process, which is the case.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def target() -> dict:
    return {
        "model": {"w": torch.zeros(3)},
        "optimizer": {"param_groups": [{"lr": 0.0, "initial_lr": 0.4, "params": ["w"]}]},
    }


def test_a_checkpoint_without_base_rates_restores_and_the_rate_becomes_the_base(tmp_path):
    # As a run with a constant rate saved it before base rates were recorded.
    old = {"model": {"w": torch.ones(3)},
           "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}  # fmt: skip
    dcp.save(old, checkpoint_id=str(tmp_path))
    state = target()
    load_sharded(state, str(tmp_path))
    assert torch.equal(state["model"]["w"], torch.ones(3))
    assert state["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]


def test_a_checkpoint_with_base_rates_restores_them(tmp_path):
    saved = target()
    saved["optimizer"]["param_groups"][0].update(lr=0.05, initial_lr=0.2)
    dcp.save(saved, checkpoint_id=str(tmp_path))
    state = target()
    load_sharded(state, str(tmp_path))
    assert state["optimizer"]["param_groups"][0]["initial_lr"] == 0.2
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.05


def test_any_other_missing_key_still_fails_the_load(tmp_path):
    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path))
    with pytest.raises(CheckpointException, match="Missing key"):
        load_sharded(target(), str(tmp_path))


def test_flattened_names_are_dcps():
    # A flattened optimizer state dict (pipeline stages) names groups by parameter.
    state = {"optimizer": {"param_groups.layer.weight.initial_lr": 0.4,
                           "param_groups.layer.weight.lr": 0.1}}  # fmt: skip
    drop_absent_base_lr(state, {"optimizer.param_groups.layer.weight.lr"})
    assert state == {"optimizer": {"param_groups.layer.weight.lr": 0.1}}
    kept = {"optimizer": {"param_groups": [{"initial_lr": 0.4}]}}
    drop_absent_base_lr(kept, {"optimizer.param_groups.0.initial_lr"})
    assert kept == {"optimizer": {"param_groups": [{"initial_lr": 0.4}]}}
