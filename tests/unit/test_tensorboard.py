"""Our hand-written TensorBoard event files, read back with tensorboard's own reader."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scaletrain.metrics.sinks import StepSinks
from scaletrain.metrics.tensorboard import EventWriter, crc32c


def test_crc32c_known_answers():
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, 32 bytes of zeros


def test_tensorboard_reads_our_scalars(tmp_path):
    writer = EventWriter(tmp_path)
    for step in range(1, 6):
        writer.scalars(step, {"train/loss": 1.0 / step, "time/step_s": 0.25}, 1000.0 + step)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "time/step_s"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2])
    assert loss[0].wall_time == 1001.0


def test_step_sinks_write_jsonl_and_events(tmp_path):
    sinks = StepSinks(tmp_path, rank=3)
    record = {"step": 7, "loss": None, "step_s": 0.5, "global_samples": 64, "comm_s": 0.1,
              "unix_time": 5.0}  # fmt: skip
    sinks.write(record)
    sinks.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    acc = EventAccumulator(str(tmp_path / "events" / "rank3"))
    acc.Reload()
    # A rank without a loss (a pipeline's first stage) writes no loss point.
    assert set(acc.Tags()["scalars"]) == {"time/step_s", "time/comm_s", "train/samples_per_s"}
    assert acc.Scalars("train/samples_per_s")[0].value == 128.0
