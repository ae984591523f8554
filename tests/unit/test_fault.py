from __future__ import annotations

import pytest
import torch

from scaletrain.fault.checkpoint import load_latest, read_index, save_checkpoint
from scaletrain.fault.inject import Kill, KillNode, parse_inject


def test_checkpoints_keep_the_newest_and_skip_damaged_ones(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((3,), float(step))}, keep=3)
    assert [e["step"] for e in read_index(tmp_path)] == [2, 3, 4]
    assert not (tmp_path / "step-00000001.pt").exists()
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 4 and skipped == []
    newest = tmp_path / "step-00000004.pt"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "step-00000003.pt").unlink()
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    assert len(skipped) == 2 and "sha256 differs" in skipped[0] and "unreadable" in skipped[1]
    assert load_latest(tmp_path / "none") == (None, [])


def test_parse_inject():
    assert parse_inject("") == []
    assert parse_inject("kill:rank=1:step=7, killnode:rank=2:step=3") == [
        Kill(rank=1, step=7),
        KillNode(rank=2, step=3),
    ]
    with pytest.raises(ValueError, match="unknown fault 'explode'; known: kill, killnode"):
        parse_inject("explode:rank=1")
    with pytest.raises(ValueError, match="expected kill:rank=R:step=S"):
        parse_inject("kill:rank=one:step=2")
    with pytest.raises(ValueError, match="needs rank >= 0 and step >= 1"):
        parse_inject("kill:rank=0:step=0")
