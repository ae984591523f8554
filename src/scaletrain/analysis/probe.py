"""All-reduce probes that calibrate the cost model's link: gloo all-reduces of a few sizes
between W processes, timed on rank 0 (median of repeats after a warm-up).

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT [SIZE ...]

prints, on rank 0, one JSON object {bytes: seconds}. ``probe_local`` runs it on loopback;
``probe_lab`` on the hosts of a NetworkLab (one process per network namespace), so the
shaped link is what gets measured.

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT cpu SLEEP_S

prints instead the CPU seconds one process spends in a small all-reduce that it reaches after
SLEEP_S of sleep and some host work, as a training step reaches its gradient all-reduce after
the device's work, and the CPU of that host work (``probe_host``: the cost model's shared-host
term; the work's CPU grows as more processes share the cores). The processes do not arrive
together, and gloo's threads hand each message over through the kernel (epoll, futexes): this
costs about a millisecond of CPU per all-reduce between 2 processes on this 2-core machine, far
more than the bytes do.
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


def measure_cpu(rank: int, world: int, endpoint: str, sleep_s: float, repeats: int = 40) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    tensor = torch.ones(1024)
    layer = torch.nn.Linear(32, 32)
    inputs = torch.ones(2, 32)
    for _ in range(3):
        dist.all_reduce(tensor)
    cpu, work = [], []
    for _ in range(repeats):
        time.sleep(sleep_s)
        start = time.process_time()
        for _ in range(20):  # a step's host work: small ops, the interpreter between them
            layer(inputs).sum().backward()
        middle = time.process_time()
        dist.all_reduce(tensor)
        cpu.append(time.process_time() - middle)
        work.append(middle - start)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"cpu_s": statistics.mean(cpu), "work_s": statistics.median(work)}),
              flush=True)  # fmt: skip


def _command(rank: int, world: int, endpoint: str, args: tuple[Any, ...]) -> list[str]:
    return [sys.executable, "-m", "scaletrain.analysis.probe", str(rank), str(world), endpoint,
            *map(str, args)]  # fmt: skip


def _output(procs: list[subprocess.Popen[str]]) -> dict[str, float]:
    outputs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"all-reduce probe failed: {outputs[0][1][-2000:]}")
    result: dict[str, float] = json.loads(outputs[0][0].strip().splitlines()[-1])
    return result


def _collect(procs: list[subprocess.Popen[str]]) -> dict[int, float]:
    return {int(k): v for k, v in _output(procs).items()}


def _local(world: int, args: tuple[Any, ...]) -> list[subprocess.Popen[str]]:
    from scaletrain.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return [subprocess.Popen(_command(r, world, endpoint, args), env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(world)]  # fmt: skip


def probe_local(world: int = 2, sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    return _collect(_local(world, sizes))


def probe_host(sleep_s: float, worlds: list[int]) -> tuple[tuple[int, float, float], ...]:
    """For each W of ``worlds``: (W, the CPU seconds one of W processes on this host spends in
    a small all-reduce that it reaches after ``sleep_s`` and a step's worth of host work, the
    CPU of that work over the same work's in one process alone): the cost model's
    ``Calibration.host``."""
    # One process alone, three times (its figure varies by a third from one start to the next).
    alone = statistics.median(_output(_local(1, ("cpu", sleep_s)))["work_s"] for _ in range(3))
    out = []
    for world in worlds:
        probed = _output(_local(world, ("cpu", sleep_s)))
        out.append((world, probed["cpu_s"], probed["work_s"] / alone))
    return tuple(out)


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
    if sys.argv[4:5] == ["cpu"]:
        measure_cpu(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[5]))
    else:
        measure(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                [int(s) for s in sys.argv[4:]] or list(SIZES))  # fmt: skip
