"""All-reduce probes that calibrate the cost model's link: gloo all-reduces of a few sizes
between W processes, timed on rank 0 (median of repeats after a warm-up).

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT [SIZE ...]

prints, on rank 0, one JSON object {bytes: seconds}. ``probe_local`` runs it on loopback;
``probe_lab`` on the hosts of a NetworkLab (one process per network namespace), so the
shaped link is what gets measured.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SIZES = (4_096, 65_536, 1_048_576, 8_388_608)


def measure(rank: int, world: int, endpoint: str, sizes: list[int], repeats: int = 15) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for size in sizes:
        tensor = torch.ones(size // 4)
        for _ in range(3):  # warm-up: connections, buffers
            dist.all_reduce(tensor)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        results[size] = statistics.median(times)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results), flush=True)


def _command(rank: int, world: int, endpoint: str, sizes: tuple[int, ...]) -> list[str]:
    return [sys.executable, "-m", "scaletrain.analysis.probe", str(rank), str(world), endpoint,
            *map(str, sizes)]  # fmt: skip


def _collect(procs: list[subprocess.Popen[str]]) -> dict[int, float]:
    outputs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"all-reduce probe failed: {outputs[0][1][-2000:]}")
    return {int(k): v for k, v in json.loads(outputs[0][0].strip().splitlines()[-1]).items()}


def probe_local(world: int = 2, sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    from scaletrain.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(_command(r, world, endpoint, sizes), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]  # fmt: skip
    return _collect(procs)


def probe_lab(lab: Any, sizes: tuple[int, ...] = SIZES, port: int = 29600) -> dict[int, float]:
    """The probe across a NetworkLab's hosts (one process each)."""
    endpoint = f"{lab.hosts[0].ip}:{port}"
    procs = []
    for host in lab.hosts:
        env = dict(os.environ, GLOO_SOCKET_IFNAME=host.ifname, OMP_NUM_THREADS="1")
        procs.append(lab.popen(host.index, _command(host.index, lab.num_hosts, endpoint, sizes),
                               env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE))  # fmt: skip
    return _collect(procs)


if __name__ == "__main__":
    measure(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
            [int(s) for s in sys.argv[4:]] or list(SIZES))  # fmt: skip
