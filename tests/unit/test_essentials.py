"""The training essentials' pure parts: the learning-rate schedules, the micro-batch split of
gradient accumulation (its weights add up to one step's sample-weighted mean), and the
checks that refuse an option a strategy cannot honour before any process starts."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import RunConfig, with_overrides
from scaletrain.schedule import lr_factor, scale_lr
from scaletrain.strategies.essentials import micro_batches, slice_batch
from scaletrain.task import Task, build_optimizer


def test_schedules_ramp_then_decay():
    total, warm = 100, 10
    assert [lr_factor("cosine", s, total, warm) for s in range(3)] == [0.1, 0.2, 0.3]
    assert lr_factor("cosine", 9, total, warm) == 1.0
    assert lr_factor("cosine", 10, total, warm) == 1.0  # the decay starts after warmup
    assert math.isclose(lr_factor("cosine", 55, total, warm), 0.5)
    assert lr_factor("cosine", 100, total, warm) == 0.0
    assert math.isclose(lr_factor("linear", 55, total, warm), 0.5)
    assert [lr_factor("step", s, 100) for s in (0, 49, 50, 74, 75, 99)] == [
        1.0, 1.0, 0.1, 0.1, 0.01, 0.01,
    ]  # fmt: skip
    assert all(lr_factor("constant", s, 100) == 1.0 for s in range(100))
    # Past the horizon (an elastic world grew its global batch) the decay stays at its end.
    assert lr_factor("linear", 150, 100) == 0.0
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor("exp", 0, 10)


def test_the_base_rate_is_in_a_fresh_optimizers_state_and_survives_a_keyed_restore():
    """A restore that reads only the keys a fresh optimizer has (a sharded DCP load) must get
    the base rate back: a restored, already scheduled rate must never become the base."""
    cfg = with_overrides(RunConfig(), {"lr": 0.4, "lr_schedule": "cosine"})
    task = Task(model=torch.nn.Linear(2, 1), train_data=[])

    def fresh():
        return build_optimizer(task, task.model.parameters(), cfg)

    trained = fresh()
    scale_lr(trained, 0.25)  # mid-schedule
    saved = trained.state_dict()["param_groups"]
    restored = fresh()
    keys = restored.state_dict()["param_groups"][0].keys()
    assert "initial_lr" in keys  # so a keyed load reads it
    for group in restored.param_groups:  # what the keyed load does
        group.update({k: saved[0][k] for k in keys if k != "params"})
    scale_lr(restored, 0.5)
    assert restored.param_groups[0]["lr"] == 0.2
    # A user's own optimizer gets the same.
    own = Task(model=task.model, train_data=[], build_optimizer=lambda p: torch.optim.SGD(p, 0.3))
    assert build_optimizer(own, own.model.parameters(), cfg).param_groups[0]["initial_lr"] == 0.3


@pytest.mark.parametrize(("num_samples", "parts"), [(7, 3), (2, 4), (12, 4), (1, 1), (0, 3)])
def test_micro_batches_cover_the_share_once_and_weigh_to_one(num_samples, parts):
    n = max(num_samples, 1)  # a rank without samples holds one stand-in
    inputs = {"x": torch.arange(n), "pair": (torch.arange(n) * 2, "label")}
    targets = torch.arange(n) + 100
    micros = list(micro_batches(inputs, targets, num_samples, parts))
    assert len(micros) == min(max(num_samples, 1), parts)
    seen = torch.cat([m[0]["x"] for m in micros])
    assert seen.tolist() == list(range(n))
    assert torch.equal(torch.cat([m[1] for m in micros]), targets)
    assert all(m[0]["pair"][1] == "label" for m in micros)
    weights = [m[2] for m in micros]
    assert math.isclose(sum(weights), 1.0 if num_samples else 0.0)
    # Each weight is the micro-batch's share of the rank's samples: mean losses weighted so
    # add up to the mean over the whole share.
    if num_samples:
        assert weights == [len(m[1]) / num_samples for m in micros]


@pytest.mark.parametrize(("num_samples", "parts"), [(1, 2), (2, 4), (7, 3), (0, 3)])
def test_padded_micro_batches_are_always_parts_and_the_stand_ins_weigh_nothing(num_samples,
                                                                               parts):  # fmt: skip
    """FSDP's count: every rank runs --grad-accum micro-batches whatever its samples."""
    n = max(num_samples, 1)
    inputs, targets = torch.arange(n) * 10, torch.arange(n) + 100

    def as_lists(micros):
        return [(x.tolist(), y.tolist(), weight) for x, y, weight in micros]

    plain = as_lists(micro_batches(inputs, targets, num_samples, parts))
    padded = as_lists(micro_batches(inputs, targets, num_samples, parts, pad=True))
    real = plain if num_samples else []  # a rank without samples has only stand-ins
    assert len(padded) == parts and padded[: len(real)] == real
    assert all(m == ([0], [100], 0.0) for m in padded[len(real) :])


def test_slice_batch_leaves_non_tensors():
    assert slice_batch([torch.arange(5), 3, None], 1, 3)[1:] == [3, None]


def cfg(**overrides):
    return with_overrides(RunConfig(), overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "fsdp", "precision": "fp16-mixed", "nproc_per_node": 2},
         "fp16-mixed needs a loss scaler whose overflow check every rank agrees on; under "
         "--strategy fsdp"),
        ({"strategy": "local_sgd", "precision": "fp16-mixed", "nproc_per_node": 2},
         "under --strategy local_sgd"),
        ({"strategy": "pipeline", "grad_accum": 2, "nproc_per_node": 2, "drop_last": True,
          "model": "mlp"},
         "grad_accum: under --strategy pipeline the schedule already accumulates"),
        ({"strategy": "pipeline", "compile": True, "nproc_per_node": 2, "model": "mlp"},
         "compile: under --strategy pipeline the stages run layers cut out of the model"),
        ({"strategy": "tensor", "compile": True, "nproc_per_node": 2, "tp": 2,
          "model": "transformer"},
         "compile: under --strategy tensor compiling DTensor-parallel layers"),
        ({"strategy": "fsdp", "compile": True, "nproc_per_node": 2, "tp": 2,
          "model": "transformer"},
         "compile: under --strategy fsdp --tp 2 the layers are DTensor-parallel"),
        ({"strategy": "ps", "clip_grad_norm": 1.0, "nproc_per_node": 4, "num_servers": 2},
         "clip_grad_norm: under --consistency bsp the servers clip the step's aggregated"),
        ({"activation_checkpointing": True, "model": "cnn"},
         "activation_checkpointing: model 'cnn' names no blocks to recompute"),
        ({"precision": "fp8"}, "precision: must be one of 32, bf16-mixed, fp16-mixed"),
        ({"grad_accum": 0}, "grad_accum: must be >= 1"),
        ({"lr_schedule": "exp"}, "lr_schedule: must be one of constant, cosine, linear, step"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm: must be >= 0"),
    ],
)  # fmt: skip
def test_options_a_strategy_cannot_honour_are_refused_naming_it(overrides, message):
    from scaletrain.launch import describe_plan

    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        describe_plan(cfg(**overrides))


def test_options_every_strategy_honours_pass_the_checks():
    from scaletrain.launch import describe_plan

    describe_plan(cfg(strategy="ddp", precision="fp16-mixed", grad_accum=3, clip_grad_norm=1.0,
                      lr_schedule="cosine", warmup_steps=5, eval_every=10))  # fmt: skip
    describe_plan(cfg(strategy="fsdp", precision="bf16-mixed", nproc_per_node=2,
                      model="transformer", activation_checkpointing=True))  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "scope"),
    [
        ({}, "global"), ({"strategy": "fsdp"}, "global"), ({"strategy": "pipeline"}, "global"),
        ({"recovery": "inplace"}, "global"), ({"strategy": "ps"}, "global"),
        ({"strategy": "local_sgd"}, "replica"), ({"strategy": "diloco"}, "replica"),
        ({"strategy": "ps", "consistency": "asp"}, "push"),
        ({"strategy": "ps", "consistency": "ssp", "staleness": 1}, "push"),
    ],
)  # fmt: skip
def test_what_clipping_bounds_is_named_per_mode(overrides, scope):
    """--clip-grad-norm means one thing per mode, and the help and summary.json name it."""
    from scaletrain.config import clip_scope, leaf_fields

    assert clip_scope(cfg(clip_grad_norm=1.0, **overrides)).startswith(scope + ":")
    help_text = leaf_fields()["clip_grad_norm"][1].metadata["help"]
    assert all(word in help_text for word in ("local_sgd", "each replica", "each push's"))


def test_a_decay_of_one_step_is_done_after_that_step():
    """The decay spans total - warmup steps (at least one): with one, the step after the
    warm-up is at its end."""
    assert [lr_factor("linear", s, 4, 3) for s in (3, 4)] == [1.0, 0.0]
    assert [lr_factor("linear", s, 3, 3) for s in (3, 4)] == [1.0, 0.0]  # none left: span 1
