"""A parameter-server process: the launcher (launch/ps.py) starts the servers with
``$SCALETRAIN_PS_ROLE=server``; the workers run the training loop like every other mode."""

from __future__ import annotations

import os
from pathlib import Path

from scaletrain import env
from scaletrain.config import RunConfig


def is_server() -> bool:
    return os.environ.get(env.PS_ROLE) == "server"


def serve(cfg: RunConfig, run_dir: Path) -> None:
    from scaletrain.strategies.param_server.server import ShardServer
    from scaletrain.strategies.param_server.worker import connect_store
    from scaletrain.task import build_optimizer, build_task

    rank, world = env.get_int(env.RANK), env.get_int(env.WORLD_SIZE)
    num_workers = world - cfg.ps.num_servers
    task = build_task(cfg)
    ShardServer(
        cfg,
        model=task.model,
        build_optimizer=lambda params: build_optimizer(task, params, cfg),
        num_train=len(task.train_data),  # type: ignore[arg-type]
        shard_sizes=getattr(task.train_data, "shard_sizes", None),
        index=rank - num_workers,
        num_workers=num_workers,
        attempt=env.get_int(env.RESTART_COUNT),
        store=connect_store(cfg),
        new_store=lambda: connect_store(cfg),
        run_dir=run_dir,
        token=os.environ[env.JOIN_TOKEN],
    ).serve()
