"""All-reduce probes that calibrate the cost model's link: gloo all-reduces of a few sizes
between W processes, timed on rank 0 (median of repeats after a warm-up).

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT [SIZE ...]

prints, on rank 0, one JSON object {bytes: seconds}. ``probe_local`` runs it on loopback;
``probe_lab`` on the hosts of a NetworkLab (one process per network namespace), so the
shaped link is what gets measured.

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT cpu SLEEP_S [PIECES]

prints instead the CPU seconds one process spends in a small all-reduce that it reaches after
SLEEP_S of sleep and some host work, as a training step reaches its gradient all-reduce after
the device's work, and the CPU of that host work (``probe_host``: the cost model's shared-host
term; the work's CPU grows as more processes share the cores); then the CPU and wall time of
steps that wait for no other process, the host work cut into PIECES between as many sleeps.
The processes do not arrive together, and gloo's threads hand each message over through the
kernel (epoll, futexes): this costs about a millisecond of CPU per all-reduce between 2
processes on this 2-core machine, far more than the bytes do.

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT bytes-cpu SIZE

prints the CPU seconds one process spends in an all-reduce of SIZE bytes (``probe_bytes_cpu``):
gloo's threads and the kernel copying and summing the bytes, which on a host whose cores the
processes outnumber competes with their compute (the cost model's collective_cpu_per_byte).

    python -m scaletrain.analysis.probe RANK WORLD HOST:PORT ps SLEEP_S SERVERS

the same for a bsp parameter server's rounds (``probe_ps``): the CPU a worker spends in a
round's push and pull, and a server per push, over the parameter server's own links.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SIZES = (4_096, 65_536, 1_048_576, 8_388_608)


def _store(rank: int, world: int, endpoint: str) -> Any:
    """The probe's TCPStore (rank 0 serves it)."""
    import datetime

    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=60))  # fmt: skip


def _group(rank: int, world: int, endpoint: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=_store(rank, world, endpoint), rank=rank,
                            world_size=world)  # fmt: skip


def _host_work(pieces: int = 1) -> Callable[[], None]:
    """A step's host work: small ops, the interpreter between them (one thread); with
    ``pieces`` > 1 the function does one of that many equal parts of it."""
    import torch

    torch.set_num_threads(1)
    layer = torch.nn.Linear(32, 32)
    inputs = torch.ones(2, 32)
    ops = max(1, 20 // pieces)

    def work() -> None:
        for _ in range(ops):
            layer(inputs).sum().backward()

    return work


def free_steps(sleep_s: float, pieces: int, repeats: int) -> tuple[float, float]:
    """Steps that wait for no other process, as local SGD's between synchronizations: the
    device's ``sleep_s`` and the step's host work cut into ``pieces`` (the device wakes the
    host that many times a step: a sleeping device's layers each sleep in forward and in
    backward). (median CPU seconds of a step, median wall seconds of a step.) Every wake-up
    on a busy host costs CPU (caches refilled, the scheduler), which one burst of the same
    work does not show."""
    part = _host_work(pieces)
    cpu, wall = [], []
    for _ in range(repeats):
        start, clock = time.process_time(), time.perf_counter()
        for _ in range(pieces):
            time.sleep(sleep_s / pieces)
            part()
        cpu.append(time.process_time() - start)
        wall.append(time.perf_counter() - clock)
    return statistics.median(cpu), statistics.median(wall)


def measure(rank: int, world: int, endpoint: str, sizes: list[int], repeats: int = 15) -> None:
    import torch
    import torch.distributed as dist

    _group(rank, world, endpoint)
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


def measure_bytes_cpu(rank: int, world: int, endpoint: str, size: int, repeats: int = 9) -> None:
    import torch
    import torch.distributed as dist

    _group(rank, world, endpoint)
    tensor = torch.ones(size // 4)
    for _ in range(2):
        dist.all_reduce(tensor)
    cpu = []
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()  # the whole process: gloo's threads and its system calls
        dist.all_reduce(tensor)
        cpu.append(time.process_time() - start)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"cpu_s": statistics.median(cpu)}), flush=True)


def measure_cpu(
    rank: int, world: int, endpoint: str, sleep_s: float, pieces: int = 1, repeats: int = 40
) -> None:
    import torch
    import torch.distributed as dist

    work_once = _host_work()
    _group(rank, world, endpoint)
    tensor = torch.ones(1024)
    for _ in range(3):
        dist.all_reduce(tensor)
    cpu, work = [], []
    for _ in range(repeats):
        time.sleep(sleep_s)
        start = time.process_time()
        work_once()
        middle = time.process_time()
        dist.all_reduce(tensor)
        cpu.append(time.process_time() - middle)
        work.append(middle - start)
    dist.barrier()
    free_cpu, free_wall = free_steps(sleep_s, pieces, repeats)
    # Every rank's free steps, not rank 0's alone: they run at once, and each sees the others.
    frees: list[Any] = [None] * world
    dist.all_gather_object(frees, (free_cpu, free_wall))
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"cpu_s": statistics.mean(cpu), "work_s": statistics.median(work),
                          "free_cpu_s": statistics.median(f[0] for f in frees),
                          "free_step_s": statistics.median(f[1] for f in frees)}),
              flush=True)  # fmt: skip


def measure_ps(
    rank: int, world: int, endpoint: str, sleep_s: float, servers: int, repeats: int = 40
) -> None:
    """A bsp parameter server's rounds between ``servers`` server processes (ranks 0..K-1)
    and the other ranks as workers, over the parameter server's own links (transport.Link:
    a two-rank gloo group per worker-server pair, each wait in a thread of its own): each
    worker sleeps ``sleep_s``, does a step's host work, pushes every server a slice of 4 KB
    and takes its reply; a server replies to a round's pushes once it has all of them. Rank 0
    prints the mean CPU a worker spends in a round's exchange, the median of its host work,
    and the CPU a server spends per push served."""
    import threading

    import torch
    import torch.distributed as dist

    from scaletrain.strategies.param_server import transport as wire

    work_once = _host_work()
    store = _store(rank, world, endpoint)
    workers = list(range(servers, world))
    size, rounds = 1024 // servers, repeats + 3  # 3 rounds of warm-up

    def link(server: int, worker: int) -> wire.Link:
        client = dist.TCPStore(store.host, store.port, is_master=False)
        side = rank == server
        # 300 s: 32 processes importing torch on 2 cores take most of a minute to get here.
        return wire.Link(client, f"probe/s{server}/w{worker}", server_side=side, timeout_s=300.0,
                       peer=(worker if side else server, 0))  # fmt: skip

    if rank < servers:
        param, lock = torch.zeros(size), threading.Lock()
        round_done = threading.Barrier(len(workers) + 1)  # every worker's thread and the clock

        def serve(worker: int) -> None:
            try:
                serve_rounds(worker)
            except BaseException:
                round_done.abort()  # the clock and the other threads fail too, not wait
                raise

        def serve_rounds(worker: int) -> None:
            pair = link(rank, worker)
            round_done.wait()  # connected
            head, grad = torch.zeros(wire.HEADER, dtype=torch.int64), torch.zeros(size)
            for _ in range(rounds):
                pair.recv(head)
                pair.recv(grad, first_tag=1)
                with lock:
                    param.add_(grad, alpha=-0.01)
                round_done.wait()  # bsp: the round's replies go once every push is in
                pair.send(wire.reply_header(version=1), param)
            pair.close()

        threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        round_done.wait()
        start = time.process_time()
        for _ in range(rounds):
            round_done.wait()
        for thread in threads:
            thread.join()
        result = {"server_cpu_s": (time.process_time() - start) / (rounds * len(workers))}
    else:
        pairs = [link(k, rank) for k in range(servers)]
        head, grad = wire.header(kind=1), torch.ones(size)
        replies = [(torch.zeros(wire.HEADER, dtype=torch.int64), torch.zeros(size)) for _ in pairs]

        def exchange() -> None:
            pending = [
                (p, p.isend(head, grad) + p.irecv(*r)) for p, r in zip(pairs, replies, strict=True)
            ]
            for pair, works in pending:
                pair.wait(works)

        for _ in range(3):
            exchange()
        cpu, work = [], []
        for _ in range(repeats):
            time.sleep(sleep_s)
            begin = time.process_time()
            work_once()
            middle = time.process_time()
            exchange()
            cpu.append(time.process_time() - middle)
            work.append(middle - begin)
        for pair in pairs:
            pair.close()
        result = {"cpu_s": statistics.mean(cpu), "work_s": statistics.median(work)}
    store.set(f"probe/result/{rank}", json.dumps(result))
    if rank == 0:
        keys = [f"probe/result/{r}" for r in range(world)]
        store.wait(keys)
        each = [json.loads(store.get(k)) for k in keys]
        print(json.dumps({
            "cpu_s": statistics.mean(e["cpu_s"] for e in each[servers:]),
            "work_s": statistics.median(e["work_s"] for e in each[servers:]),
            "server_cpu_s": statistics.mean(e["server_cpu_s"] for e in each[:servers]),
        }), flush=True)  # fmt: skip
        store.wait([f"probe/done/{r}" for r in range(1, world)])  # keep serving the store
    else:
        store.set(f"probe/done/{rank}", "1")
    # Out at once: tearing down the links' gloo groups at interpreter exit aborted a worker
    # now and then ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


def _command(rank: int, world: int, endpoint: str, args: tuple[Any, ...]) -> list[str]:
    return [sys.executable, "-m", "scaletrain.analysis.probe", str(rank), str(world), endpoint,
            *map(str, args)]  # fmt: skip


def _output(procs: list[subprocess.Popen[str]]) -> dict[str, float]:
    """Rank 0's JSON line. Every process's pipes are read at once: 32 processes' warnings
    fill a pipe, and a rank blocked writing one held rank 0, which waits for every rank."""
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            outputs = list(pool.map(lambda p: p.communicate(timeout=300), procs))
    finally:
        for p in procs:
            p.kill()  # none left behind by a timeout
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if failed:
        rank, code = failed[0]
        raise RuntimeError(f"probe failed: rank {rank} exited {code}: {outputs[rank][1][-2000:]}")
    result: dict[str, float] = json.loads(outputs[0][0].strip().splitlines()[-1])
    return result


def _collect(procs: list[subprocess.Popen[str]]) -> dict[int, float]:
    return {int(k): v for k, v in _output(procs).items()}


def _forked_rank(rank: int, world: int, endpoint: str, args: tuple[Any, ...], out: str) -> None:
    """A probe process forked by the fork server, as scaletrain's workers are: in a session
    of its own, its output (rank 0's JSON line, any rank's error) to the file ``out``."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    from scaletrain.runtime import unblock_group_signals

    unblock_group_signals()
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with open(out, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    try:
        _main([str(rank), str(world), endpoint, *map(str, args)])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def _local(world: int, args: tuple[Any, ...]) -> dict[str, float]:
    """Rank 0's result of the probe ``args`` over ``world`` processes on this host, forked
    from the fork server as the workers whose steps the probe stands for are: processes
    started afresh (torch imported in each) spent up to 2x the CPU on the same host work at
    16 and 32 processes on 2 cores, where the forked workers spent what one alone did."""
    import tempfile

    from scaletrain.launch import free_port
    from scaletrain.launch.forkserver import ForkedProcess

    endpoint = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="scaletrain-probe-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.out") for r in range(world)]
        procs = [ForkedProcess(_forked_rank, r, world, endpoint, args, outs[r])
                 for r in range(world)]  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            for proc in procs:
                proc.wait(max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()  # none left behind by a timeout
                    proc.wait()
        texts = [Path(path).read_text() if os.path.exists(path) else "" for path in outs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if failed:
        rank, code = failed[0]
        raise RuntimeError(f"probe failed: rank {rank} exited {code}: {texts[rank][-2000:]}")
    lines = [line for line in texts[0].splitlines() if line.startswith("{")]
    result: dict[str, float] = json.loads(lines[-1])
    return result


def probe_local(world: int = 2, sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    return {int(k): v for k, v in _local(world, sizes).items()}


def probe_bytes_cpu(world: int, nbytes: int) -> float:
    """CPU seconds one of ``world`` processes on this host spends per byte it sends in a ring
    all-reduce of ``nbytes`` (2 (W-1) / W of them): the cost model's collective_cpu_per_byte."""
    cpu = _local(world, ("bytes-cpu", nbytes))["cpu_s"]
    return float(cpu / (2 * (world - 1) / world * nbytes))


def probe_host(sleep_s: float, worlds: list[int], pieces: int = 1) -> tuple[Any, ...]:
    """For each W of ``worlds``, the cost model's ``HostProbe``: W processes on this host
    that sleep ``sleep_s`` a step, do a step's host work and all-reduce a small tensor (the
    CPU one of them spends in the all-reduce, the CPU of its host work over the same work's
    in one process alone), then run steps that wait for no other, the host work cut into
    ``pieces`` between as many sleeps (the device's wake-ups of the host in a step): their
    CPU over alone's, and the wall time they wait for the cores beyond alone's."""
    from scaletrain.analysis.costmodel import HostProbe

    # One process alone, three times (its figure varies by a third from one start to the next).
    alones = [_local(1, ("cpu", sleep_s, pieces)) for _ in range(3)]
    work, free_cpu, free_step = (statistics.median(a[k] for a in alones)
                                 for k in ("work_s", "free_cpu_s", "free_step_s"))  # fmt: skip
    out = []
    for world in worlds:
        # Each W three times too: one probe's all-reduce CPU at W=16 came out 3.3 ms in one
        # make scale and 4.8 ms in the next (3.2 and 5.2 at W=8 and 32 in both), and the
        # prediction of ddp at 16 moved by a fifth with it.
        runs = [_local(world, ("cpu", sleep_s, pieces)) for _ in range(3)]
        probed = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out.append(HostProbe(world, probed["cpu_s"], probed["work_s"] / work,
                             probed["free_cpu_s"] / free_cpu,
                             max(0.0, probed["free_step_s"] - free_step)))  # fmt: skip
    return tuple(out)


def probe_ps(
    sleep_s: float, worlds: list[tuple[int, int]]
) -> tuple[tuple[int, int, float, float, float], ...]:
    """For each (W processes, K of them servers) of ``worlds``, a bsp parameter server's
    rounds on this host (``measure_ps``): (W, K, the CPU a worker spends in a round's
    exchange, the CPU a server spends per push, the workers' host work over the same work's
    in one process alone): the cost model's ``Calibration.ps_host``."""
    alone = statistics.median(_local(1, ("cpu", sleep_s))["work_s"] for _ in range(3))
    out = []
    for world, servers in worlds:
        # Three times and the medians, as probe_host does: one probe at W=32 left ps's
        # prediction at 0.78 of the measured step in a make scale that met every other floor.
        runs = [_local(world, ("ps", sleep_s, servers)) for _ in range(3)]
        probed = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out.append((world, servers, probed["cpu_s"], probed["server_cpu_s"],
                    probed["work_s"] / alone))  # fmt: skip
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


def _main(argv: list[str]) -> None:
    """RANK WORLD HOST:PORT, then the probe's arguments (the module's docstring)."""
    rank, world, endpoint, rest = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    if rest[:1] == ["ps"]:
        measure_ps(rank, world, endpoint, float(rest[1]), int(rest[2]))
    elif rest[:1] == ["bytes-cpu"]:
        measure_bytes_cpu(rank, world, endpoint, int(rest[1]))
    elif rest[:1] == ["cpu"]:
        measure_cpu(rank, world, endpoint, float(rest[1]), int(rest[2]) if rest[2:] else 1)
    else:
        measure(rank, world, endpoint, [int(s) for s in rest] or list(SIZES))


if __name__ == "__main__":
    _main(sys.argv[1:])
