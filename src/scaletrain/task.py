"""The Python API: a Task bundles a user's own model, data, loss and optimizer.

A user writes a function ``build_task(cfg: RunConfig) -> Task`` in a file or module and passes
``--task path/to/file.py:build_task`` (or ``package.module:build_task``). Every worker process
calls it after its process group is up, so it may look at ``torch.distributed.get_rank()``.
The built-in datasets and models are assembled into a Task the same way, so the trainer only
ever sees Tasks.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from scaletrain.config import RunConfig
from scaletrain.registry import lookup
from scaletrain.schedule import mark_base_lr

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def count_correct(output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """Classification accuracy counts: (correct, total) for logits of shape (N, classes)."""
    return int((output.argmax(dim=-1) == target).sum()), int(target.numel())


@dataclass(kw_only=True)
class Task:
    """What to train. ``loss_fn`` must return the *mean* loss over the batch (torch's default
    reduction): scaletrain reweights per-rank means into the global mean over all samples.
    ``build_optimizer`` defaults to the optimizer named in the config (--optimizer, --lr, ...).
    ``eval_fn`` returns (correct, total) for a test batch; test accuracy is their global ratio.
    ``checkpoint_modules``: the module types --activation-checkpointing recomputes (default:
    the model's own ``activation_checkpoint_modules()``, which the built-in transformer has).
    """

    model: nn.Module
    train_data: Dataset[Any]
    test_data: Dataset[Any] | None = None
    loss_fn: LossFn = field(default=nn.functional.cross_entropy)
    build_optimizer: OptimizerFactory | None = None
    eval_fn: Callable[[Any, Any], tuple[int, int]] | None = count_correct
    checkpoint_modules: tuple[type[nn.Module], ...] = ()


OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter], RunConfig], torch.optim.Optimizer]] = {
    "sgd": lambda p, c: torch.optim.SGD(
        p, lr=c.optim.lr, momentum=c.optim.momentum, weight_decay=c.optim.weight_decay
    ),
    "adam": lambda p, c: torch.optim.Adam(p, lr=c.optim.lr, weight_decay=c.optim.weight_decay),
    "adamw": lambda p, c: torch.optim.AdamW(p, lr=c.optim.lr, weight_decay=c.optim.weight_decay),
}


def build_optimizer(
    task: Task, params: Iterable[nn.Parameter], cfg: RunConfig
) -> torch.optim.Optimizer:
    """The task's optimizer, or the config's, with each group's base learning rate recorded
    in its state (schedule.mark_base_lr) before anything saves or restores it."""
    if task.build_optimizer is not None:
        return mark_base_lr(task.build_optimizer(params))
    return mark_base_lr(lookup(OPTIMIZERS, cfg.optim.optimizer, "optimizer")(params, cfg))


def build_builtin_task(cfg: RunConfig) -> Task:
    from scaletrain.data.datasets import ImageDataset, build_dataset
    from scaletrain.models import build_model

    train: ImageDataset
    test: ImageDataset | None
    if cfg.data.data_dir:
        from scaletrain.data.shards import ShardedDataset, read_manifest

        train = ShardedDataset(cfg.data.data_dir, "train")
        has_test = "test" in read_manifest(Path(cfg.data.data_dir))["splits"]
        test = ShardedDataset(cfg.data.data_dir, "test") if has_test else None
    else:
        options = {"num_samples": cfg.data.num_samples, "image_size": cfg.data.image_size}
        train = build_dataset(cfg.data.dataset, "train", **options)
        test = build_dataset(cfg.data.dataset, "test", **options)
    model = build_model(cfg.model.model, train.input_shape, train.num_classes, cfg.model.width)
    return Task(model=model, train_data=train, test_data=test)


def resolve_task_factory(spec: str) -> Callable[[RunConfig], Task]:
    """'file.py:fn' or 'pkg.module:fn' -> the function. Raises ValueError with the reason."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"task: expected 'file.py:function' or 'module:function', got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"task: file {target} does not exist")
        name = f"scaletrain_user_task_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        # The user's own directory becomes importable, as it would be for `python file.py`.
        sys.path.insert(0, str(path.parent))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"task: cannot import module {target!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"task: {target} has no function {attr!r}")
    return factory  # type: ignore[no-any-return]


def build_task(cfg: RunConfig) -> Task:
    if not cfg.data.task:
        return build_builtin_task(cfg)
    task = resolve_task_factory(cfg.data.task)(cfg)
    if not isinstance(task, Task):
        raise TypeError(
            f"task {cfg.data.task} returned {type(task).__name__}, expected scaletrain.Task"
        )
    return task
