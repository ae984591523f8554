"""What the launcher checks before any process starts, and the run directory it prepares:
bad input stops here with a ValueError naming the field (exit status 2), before anything is
written."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig, dumps_toml, from_dict, parse_nnodes
from scaletrain.registry import lookup


def check_names(cfg: RunConfig) -> None:
    """Registry names, and the flags the run's mode honours (modes.py), are checked here,
    before any process starts."""
    from scaletrain.compression.spec import parse_compression
    from scaletrain.data.datasets import DATASETS
    from scaletrain.fault.inject import parse_inject
    from scaletrain.launch.modes import check_flags
    from scaletrain.models import MODELS
    from scaletrain.strategies import strategy_class
    from scaletrain.task import OPTIMIZERS

    parse_compression(cfg.comm.compression)
    parse_inject(cfg.fault.inject)
    check_flags(cfg)

    # Only the chosen strategy's module is imported: all of them cost every run ~1.5 s.
    strategy = strategy_class(cfg.train.strategy)
    if cfg.comm.compression != "none" and not strategy.supports_compression:
        from scaletrain.strategies import all_strategies

        with_hooks = ", ".join(
            sorted(n for n, s in all_strategies().items() if s.supports_compression)
        )
        raise ValueError(
            f"compression: --strategy {cfg.train.strategy} does not use gradient hooks; "
            f"--compression applies to: {with_hooks}"
        )
    lookup(OPTIMIZERS, cfg.optim.optimizer, "optimizer")
    if cfg.launch.join_token_file:
        from scaletrain.strategies.param_server.admission import read_token_file

        read_token_file(cfg.launch.join_token_file)
    if cfg.fault.recovery == "inplace" and importlib.util.find_spec("torchft") is None:
        raise ValueError(
            "recovery: inplace needs torchft, which is not installed: pip install 'scaletrain[ft]'"
        )
    if cfg.data.task:
        target = cfg.data.task.rpartition(":")[0]
        if target.endswith(".py") and not Path(target).is_file():
            raise ValueError(f"task: file {target} does not exist")
    else:
        lookup(MODELS, cfg.model.model, "model")
        if cfg.data.data_dir:
            check_shards(Path(cfg.data.data_dir), verify=cfg.data.verify)
        else:
            lookup(DATASETS, cfg.data.dataset, "dataset")


def check_strategy(cfg: RunConfig) -> None:
    """The strategy's own checks (world-size shape, model split) and --max-memory-per-rank,
    for every world size the run may have (each node count of an elastic MIN:MAX)."""
    from scaletrain.strategies import strategy_class

    strategy = strategy_class(cfg.train.strategy)
    lo, hi = parse_nnodes(cfg.launch.nnodes)
    worlds = sorted({cfg.launch.nproc_per_node * n for n in range(lo, hi + 1)})
    model = None
    checks_model = strategy.checks_model(cfg)
    if checks_model or cfg.train.max_memory_per_rank or cfg.train.activation_checkpointing:
        from scaletrain.task import build_task

        task = build_task(cfg)
        model = task.model
        if cfg.train.activation_checkpointing:
            check_checkpoint_modules(cfg, model, task.checkpoint_modules)
    if cfg.parallel.replica_size and cfg.train.strategy != "fsdp":
        raise ValueError(
            f"replica_size: replica groups (HSDP) shard the model under --strategy fsdp, not "
            f"under --strategy {cfg.train.strategy}"
        )
    for world in worlds:
        strategy.check_config(cfg, world, model if checks_model else None)
    from scaletrain.launch.modes import mode_of
    from scaletrain.strategies import stepping_class

    stepping_class(cfg, mode_of(cfg)).check_step_options(cfg)
    if cfg.train.max_memory_per_rank and model is not None:
        from scaletrain.launch.memory import check_memory_budget

        check_memory_budget(cfg, model, worlds[-1])


def check_checkpoint_modules(cfg: RunConfig, model: Any, named: tuple[type, ...]) -> None:
    """--activation-checkpointing needs blocks to recompute: the Task's, or the model's."""
    from scaletrain.models.checkpointing import checkpoint_types

    types = checkpoint_types(model, named)
    what = cfg.data.task or f"model {cfg.model.model!r}"
    if not types:
        raise ValueError(
            f"activation_checkpointing: {what} names no blocks to recompute (its layers are "
            "single operations); name the block types in your Task's checkpoint_modules, or "
            "use --model transformer, whose blocks are checkpointed"
        )
    if not any(isinstance(m, types) for m in model.modules() if m is not model):
        names = ", ".join(t.__name__ for t in types)
        raise ValueError(f"activation_checkpointing: {what} has no module of type {names}")


def check_shards(root: Path, *, verify: bool) -> None:
    """Open every split once here, so a missing, truncated or corrupted shard stops the run
    before anything is written, and the (slow) sha256 check runs once, not once per worker."""
    from scaletrain.data.shards import open_split, read_manifest

    for split in read_manifest(root)["splits"]:
        open_split(root, split, verify=verify)


def prepare_run_dir(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Create the run directory, write config.toml, and start a job run: a new job, or the
    next run of the job the directory holds (launch/jobs.py says when that may be).

    A node other than node 0 may join a job that is already training (--nnodes MIN:MAX),
    in the run directory the nodes share: it refuses only a finished run, and keeps the
    job's config.toml (the one every worker reads) when it holds the same configuration."""
    from scaletrain.config import load_toml
    from scaletrain.launch.jobs import JobComplete, plan_job_run, start_job_run
    from scaletrain.launch.modes import mode_of

    out = Path(cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    joining = cfg.launch.node_rank != 0 and bool(cfg.launch.rdzv_endpoint)
    data = cfg.to_dict()
    data["out"] = str(out)
    resolved = from_dict(data)
    config = out / "config.toml"
    if joining:
        if (out / "summary.json").exists():
            if not config.exists() or load_toml(config).hash() != resolved.hash():
                raise ValueError(
                    f"out: {out} already holds a run that finished with another "
                    "configuration (summary.json exists); pass another --out"
                )
            raise JobComplete(out)
    else:
        job = plan_job_run(resolved, out, mode_of(resolved))
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot create run directory {out}: {e.strerror}") from None
    if joining and config.exists():
        theirs = load_toml(config)
        if theirs.hash() != resolved.hash():
            raise ValueError(
                f"out: {out} holds a job with another configuration (config hash "
                f"{theirs.hash()}, this node's {resolved.hash()}): every node of a job must "
                "be given the same settings"
            )
        return resolved, out
    from scaletrain.io import atomic_write_bytes

    old = load_toml(config) if config.exists() and not joining else None
    # Atomic: a worker of a running job may read it while a node joins. A joining node
    # writes it only where node 0 has not (a run directory that is not shared, which its
    # workers then find out), and node 0 alone records job runs.
    atomic_write_bytes(config, dumps_toml(resolved.to_dict()).encode())
    if not joining:
        start_job_run(out, job, resolved, old)
    return resolved, out
