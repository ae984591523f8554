"""The worker-process side of ``--strategy ps``: become a server or a worker, as the launcher
(supervisor.py) said in the environment."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from scaletrain.config import RunConfig
from scaletrain.strategies.param_server.admission import TOKEN_ENV
from scaletrain.strategies.param_server.supervisor import ROLE_ENV, STORE_ENV


def connect_store(cfg: RunConfig) -> object:
    from torch.distributed import TCPStore

    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return TCPStore(host, int(port), is_master=False,
                    timeout=datetime.timedelta(seconds=cfg.launch.timeout_s))  # fmt: skip


def run_process(cfg: RunConfig, run_dir: Path) -> None:
    from scaletrain.runtime import pick_device
    from scaletrain.task import build_optimizer, build_task

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    num_workers = world - cfg.ps.num_servers
    task = build_task(cfg)
    store = connect_store(cfg)
    if os.environ[ROLE_ENV] == "server":
        from scaletrain.strategies.param_server.server import ShardServer

        ShardServer(
            cfg,
            model=task.model,
            build_optimizer=lambda params: build_optimizer(task, params, cfg),
            num_train=len(task.train_data),  # type: ignore[arg-type]
            shard_sizes=getattr(task.train_data, "shard_sizes", None),
            index=rank - num_workers,
            num_workers=num_workers,
            attempt=attempt,
            store=store,
            new_store=lambda: connect_store(cfg),
            run_dir=run_dir,
            token=os.environ[TOKEN_ENV],
        ).serve()
        return
    from scaletrain.strategies.param_server.client import PSWorker

    PSWorker(
        cfg,
        task,
        run_dir,
        worker=rank,
        num_workers=num_workers,
        attempt=attempt,
        store=store,
        new_store=lambda: connect_store(cfg),
        device=pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0"))),
        token=os.environ[TOKEN_ENV],
    ).fit()
