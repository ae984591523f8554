"""Scoring a model on (a part of) the test split: the one evaluation every mode uses.

Each process that holds the final model scores a balanced slice of the test split (the
training loop, trainer.py); where the final model is assembled elsewhere (the parameter
server's launcher), the whole split. The counts, not the ratios, are reported, so the parts
add up to the accuracy over the whole split wherever summary.json is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Subset

from scaletrain.data.loading import make_loader, to_device
from scaletrain.data.partition import rank_slice


@torch.no_grad()
def score(
    model: torch.nn.Module,
    test: Any,
    eval_fn: Callable[[Any, Any], tuple[float, float]],
    device: torch.device,
    part: tuple[int, int] = (0, 1),
    on_batch: Callable[[], None] = lambda: None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> tuple[float, float, float]:
    """(correct, total, loss summed over samples) over slice ``part`` = (index, parts) of
    ``test`` (the loss 0 without ``loss_fn``, which returns a batch's mean). ``on_batch`` runs
    before each batch (the loop marks progress there: a long evaluation is not a hang)."""
    was_training = model.training
    model.eval()
    index, parts = part
    lo, hi = rank_slice(0, len(test), parts, index)
    loader = make_loader(Subset(test, range(lo, hi)), cuda=device.type == "cuda", batch_size=512)
    correct = total = loss_sum = 0.0
    for inputs, targets in loader:
        on_batch()
        targets = to_device(targets, device)
        output = model(to_device(inputs, device))
        c, t = eval_fn(output, targets)
        correct, total = correct + float(c), total + float(t)
        if loss_fn is not None:
            loss_sum += float(loss_fn(output, targets)) * float(t)
    model.train(was_training)
    return correct, total, loss_sum
