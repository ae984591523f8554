"""The parameter server's transport choice, measured: a push-and-pull round trip (send a
gradient slice, receive the parameter slice back) between two processes on loopback, over
(a) a two-rank gloo process group with point-to-point send/recv, as transport.py does, and
(b) torch.distributed.rpc (TensorPipe) rpc_sync, the other candidate transport.
Also: whether a process that died can come back. For gloo, a restarted peer builds a new
pair under a new store prefix; for RPC, it calls init_rpc again into the running world.

    python benchmarks/ps_transport.py [--sizes 1000,250000,4000000] [--reps 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from scaletrain.launch import free_port  # noqa: E402
from scaletrain.strategies.param_server.transport import Link  # noqa: E402


def halve(t: torch.Tensor) -> torch.Tensor:
    return t.mul_(0.5)


def gloo_side(rank: int, port: int, sizes: list[int], reps: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    link = Link(store, "bench", server_side=rank == 0, timeout_s=60)
    for n in sizes:
        buf = torch.zeros(n)
        for i in range(reps + 5):
            if i == 5:
                start = time.perf_counter()
            if rank == 0:
                link.recv(buf, first_tag=1)
                link.send(halve(buf), first_tag=1)
            else:
                link.send(buf, first_tag=1)
                link.recv(buf, first_tag=1)
        if rank == 1:
            out[("gloo", n)] = (time.perf_counter() - start) / reps


def rpc_side(rank: int, port: int, sizes: list[int], reps: int, out: dict) -> None:
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 1:
        for n in sizes:
            buf = torch.zeros(n)
            for i in range(reps + 5):
                if i == 5:
                    start = time.perf_counter()
                buf = rpc.rpc_sync("p0", halve, args=(buf,))
            out[("rpc", n)] = (time.perf_counter() - start) / reps
    rpc.shutdown()


def rpc_rejoin(port: int, out: dict) -> None:
    """A second init_rpc of rank 1 into a world whose rank 1 is gone: can it come back?"""
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=5)
    try:
        rpc.init_rpc("p1", rank=1, world_size=2, rpc_backend_options=opts)
        out["rpc_rejoin"] = "rejoined"
    except Exception as e:
        out["rpc_rejoin"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"


def rpc_survivor(port: int, out: dict) -> None:
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=5)
    rpc.init_rpc("p0", rank=0, world_size=2, rpc_backend_options=opts)
    time.sleep(12)
    rpc.shutdown(graceful=False)


def rpc_victim(port: int) -> None:
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=5)
    rpc.init_rpc("p1", rank=1, world_size=2, rpc_backend_options=opts)
    os._exit(1)  # dies without a goodbye, as a killed process does


def pair(target, *args) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        procs = [mp.Process(target=target, args=(r, *args, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,250000,4000000", help="float32 elements")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    results = pair(gloo_side, free_port(), sizes, args.reps)
    results |= pair(rpc_side, free_port(), sizes, args.reps)
    print(f"{'tensor':>10} {'gloo pair ms':>13} {'rpc_sync ms':>12} {'rpc / gloo':>11}")
    for n in sizes:
        g, r = results[("gloo", n)], results[("rpc", n)]
        print(f"{n * 4 / 1e6:8.3f}MB {g * 1e3:13.2f} {r * 1e3:12.2f} {r / g:11.2f}")
    # Rejoin: rank 1 dies; a new rank 1 tries to join the world rank 0 still holds.
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        survivor = mp.Process(target=rpc_survivor, args=(port, out))
        survivor.start()
        victim = mp.Process(target=rpc_victim, args=(port,))
        victim.start()
        victim.join(60)
        again = mp.Process(target=rpc_rejoin, args=(port, out))
        again.start()
        again.join(30)
        if again.is_alive():
            again.kill()
            out["rpc_rejoin"] = "hung for 30 s"
        survivor.kill()
        print(f"rpc: a restarted rank 1 calling init_rpc again: {out.get('rpc_rejoin')}")
    print("gloo: a restarted worker builds a new pair (tests/dist/test_param_server.py)")


if __name__ == "__main__":
    mp.set_start_method("spawn")
    main()
