"""The environment every mode's processes start in: thread counts, gloo's interface, the
mode, where the workers' store listens."""

from __future__ import annotations

import logging
import os
import sys

from scaletrain.config import RunConfig, threads_per_worker


def set_launch_env(cfg: RunConfig, local_only: bool) -> None:
    from scaletrain import env
    from scaletrain.launch.modes import mode_of

    os.environ[env.MODE] = mode_of(cfg)  # the workers' mode (worker.py)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Where the workers' own store listens (runtime.init_distributed); "": MASTER_ADDR.
    os.environ[env.BIND] = cfg.launch.bind
    # As torchrun does: without it each worker's OpenMP pool would size itself to every core.
    threads = threads_per_worker(cfg.train.num_threads, cfg.launch.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if local_only and sys.platform.startswith("linux"):
        # Keep a local job on loopback even when the hostname resolves to another interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif not local_only and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo would take the interface of the hostname; the address the user named wins.
        iface = gloo_interface(cfg)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def gloo_interface(cfg: RunConfig) -> str | None:
    """The interface of --bind (or --local-addr), for gloo when GLOO_SOCKET_IFNAME is unset."""
    from scaletrain.net import interface_of

    addr = cfg.launch.bind if cfg.launch.bind not in ("", "0.0.0.0", "::") else ""
    addr = addr or cfg.launch.local_addr
    return interface_of(addr) if addr and sys.platform.startswith("linux") else None
