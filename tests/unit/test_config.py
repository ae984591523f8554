from __future__ import annotations

import pytest

from scaletrain.config import (
    LaunchSection,
    OptimSection,
    RunConfig,
    TrainSection,
    dumps_toml,
    from_dict,
    load_toml,
    parse_nnodes,
    with_overrides,
)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: LaunchSection(nproc_per_node=0), "nproc_per_node"),
        (lambda: LaunchSection(nnodes="0"), "nnodes"),
        (lambda: LaunchSection(nnodes="3:2"), "nnodes"),
        (lambda: LaunchSection(nnodes="a"), "nnodes"),
        (lambda: LaunchSection(nnodes="2"), "rdzv_endpoint"),
        (lambda: LaunchSection(rdzv_endpoint="nohost"), "rdzv_endpoint"),
        (lambda: LaunchSection(timeout_s=0), "timeout_s"),
        (lambda: TrainSection(batch_size=0), "batch_size"),
        (lambda: TrainSection(epochs=0), "epochs"),
        (lambda: TrainSection(device="tpu"), "device"),
        (lambda: OptimSection(lr=-0.1), "lr"),
        (lambda: OptimSection(lr=0), "lr"),
        (lambda: OptimSection(momentum=1.0), "momentum"),
    ],
)
def test_invalid_fields_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_parse_nnodes():
    assert parse_nnodes("1") == (1, 1)
    assert parse_nnodes("1:4") == (1, 4)


def test_toml_round_trip():
    cfg = with_overrides(
        RunConfig(), {"lr": 0.2, "nproc_per_node": 3, "task": "a.py:f", "deterministic": True}
    )
    again = from_dict(__import__("tomllib").loads(dumps_toml(cfg.to_dict())))
    assert again == cfg


def test_unknown_keys_and_types_are_errors():
    with pytest.raises(ValueError, match="unknown key 'lrr' in \\[optim\\]; valid: optimizer, lr"):
        from_dict({"optim": {"lrr": 1.0}})
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        from_dict({"bogus": {}})
    with pytest.raises(ValueError, match="train.epochs: expected int"):
        from_dict({"train": {"epochs": "3"}})
    assert from_dict({"optim": {"lr": 1}}).optim.lr == 1.0  # ints are fine for floats


def test_load_toml_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read config file"):
        load_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 2")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(bad)
    invalid = tmp_path / "invalid.toml"
    invalid.write_text("[optim]\nlr = -1.0\n")
    with pytest.raises(ValueError, match="invalid.toml: lr: must be > 0"):
        load_toml(invalid)


def test_hash_ignores_output_directory():
    a = with_overrides(RunConfig(), {"out": "/tmp/a"})
    b = with_overrides(RunConfig(), {"out": "/tmp/b"})
    c = with_overrides(RunConfig(), {"out": "/tmp/a", "seed": 1})
    assert a.hash() == b.hash() != c.hash()


@pytest.mark.parametrize("command", ["run", "demo", "bench", "predict", "plan", "report"])
def test_every_command_prints_its_help(command, capsys):
    """--help lists every flag with its help text (one with a literal % once crashed it)."""
    from scaletrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if command == "run":
        assert "at 50%" in " ".join(out.split()) and "--balance-every" in out
