"""Emulated hosts on one machine: network namespaces joined by veth pairs and a bridge, each
link shaped with ``tc ... tbf``, for benchmarks and tests of what crosses a network.

Layout of one lab (N hosts)::

    [host i: netns, eth0 10.200.0.(i+1)/24] --veth--> [switch netns: port s_i -- bridge br0]

Every link is shaped in both directions: the host's eth0 egress (host -> switch) and the
switch port's egress (switch -> host), so a host sends and receives at most ``rate``. The
bridge lives in its own namespace, so a lab touches nothing of the machine's own network and
labs never see each other (each has its own switch). tbf is the shaper because netem, fq and
the like are not in this kernel (checked when the lab was built): bandwidth is emulated,
latency is not.

Cleanup: ``NetworkLab`` is a context manager; leaving it (also on an exception) kills every
process still running inside its namespaces and deletes them, which deletes their links.
Namespace names carry the creating process id; a lab first deletes the namespaces of labs
whose creator has died (a SIGKILLed test run), so nothing piles up across runs.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable_reason()`` says what is missing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "scaletrain"
SUBNET = "10.200.0"
_counter = itertools.count()


class NetLabError(RuntimeError):
    pass


def unavailable_reason() -> str | None:
    """Why labs cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    # Root in a container may still lack CAP_SYS_ADMIN / CAP_NET_ADMIN: try for real.
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetLabError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


def parse_rate(rate: str) -> int:
    """'100mbit' -> bits per second (tc's units: kbit, mbit, gbit, bit)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ValueError(f"bandwidth: expected e.g. 100mbit or 1gbit, got {rate!r}")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def tbf_args(rate: str) -> list[str]:
    """tbf with a bucket of 10 ms of traffic (at least 64 KiB: one GSO segment must fit, or
    tbf drops it) and a queue of 50 ms."""
    bits = parse_rate(rate)
    burst = max(64 * 1024, bits // 8 // 100)
    return ["tbf", "rate", str(bits), "burst", str(burst), "latency", "50ms"]


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ip: str
    ifname: str = "eth0"


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _kill_all(netns: str) -> list[int]:
    """SIGKILL every process inside ``netns``; their pids."""
    pids = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30
    ).stdout.split()
    killed = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
    return killed


def _kill_and_delete(netns: str) -> None:
    _kill_all(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def sweep_stale() -> None:
    """Delete namespaces left by labs whose creating process is gone."""
    for netns in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-\w+", netns)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _kill_and_delete(netns)


class NetworkLab:
    def __init__(self, num_hosts: int, *, rate: str | None = None) -> None:
        if num_hosts < 1 or num_hosts > 250:
            raise ValueError(f"num_hosts: need 1..250, got {num_hosts}")
        if rate is not None:
            parse_rate(rate)
        self.num_hosts = num_hosts
        self.rate = rate
        self.name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.name}-sw"
        self.hosts = [Host(i, f"{self.name}-h{i}", f"{SUBNET}.{i + 1}") for i in range(num_hosts)]
        self._created: list[str] = []
        # (host, process) of everything popen started: killed by handle too, since a process
        # may not have entered its namespace yet (``ip netns exec`` still starting), where
        # ``ip netns pids`` cannot see it and deleting the namespace makes it fail instead.
        self._started: list[tuple[int, subprocess.Popen[Any]]] = []

    def __enter__(self) -> NetworkLab:
        reason = unavailable_reason()
        if reason:
            raise NetLabError(reason)
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, netns: str) -> None:
        _run("ip", "netns", "add", netns)
        self._created.append(netns)
        _run("ip", "-n", netns, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch
        self._add_netns(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in self.hosts:
            port = f"s{host.index}"
            self._add_netns(host.netns)
            _run("ip", "-n", host.netns, "link", "add", host.ifname, "type", "veth",
                 "peer", "name", port, "netns", sw)  # fmt: skip
            _run("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.ifname)
            _run("ip", "-n", host.netns, "link", "set", host.ifname, "up")
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            if self.rate:
                shape = tbf_args(self.rate)
                _run("tc", "-n", host.netns, "qdisc", "add", "dev", host.ifname, "root", *shape)
                _run("tc", "-n", sw, "qdisc", "add", "dev", port, "root", *shape)

    def _kill(self, hosts: list[int]) -> list[int]:
        """SIGKILL at once what popen started on ``hosts`` and every process inside their
        namespaces, then reap what popen started; the pids killed."""
        procs = [proc for h, proc in self._started if h in hosts and proc.poll() is None]
        for proc in procs:
            proc.kill()
        killed = [proc.pid for proc in procs]
        for host in hosts:
            killed += _kill_all(self.hosts[host].netns)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        return sorted(set(killed))

    def close(self) -> None:
        """Kill what runs inside and delete every namespace (and with them every link)."""
        self._kill([host.index for host in self.hosts])
        self._started.clear()
        for netns in reversed(self._created):
            _kill_and_delete(netns)
        self._created.clear()

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` to run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: int, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._started.append((host, proc))
        return proc

    def run(self, host: int, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.command(host, argv), **kwargs)

    def launch_scaletrain(
        self,
        args: list[str],
        out_root: Path,
        *,
        nproc_per_node: int = 1,
        port: int = 29500,
        nnodes: str = "",
        shared_out: bool = False,
        env: dict[str, str] | None = None,
        hosts: list[int] | None = None,
        output: Path | None = None,
    ) -> list[subprocess.Popen[str]]:
        """Start ``scaletrain run ARGS`` on every host as one job: host 0 hosts the c10d
        rendezvous, every node binds gloo to its eth0 and writes to out_root/node<i>, or with
        ``shared_out`` all to out_root (a file system every host shares, as restart recovery
        across nodes needs). ``nnodes``: --nnodes (default: the number of hosts); ``env``: added
        to every node's environment; ``hosts``: start only these (a later call with the others
        makes them join the job); ``output``: each node's stdout and stderr go to files there
        (host<i>.out, host<i>.err) instead of pipes the caller must drain."""
        import sys

        procs = []
        for host in (self.hosts[i] for i in hosts) if hosts is not None else self.hosts:
            out = out_root if shared_out else out_root / f"node{host.index}"
            argv = [
                sys.executable, "-m", "scaletrain", "run", *args,
                "--nnodes", nnodes or str(self.num_hosts), "--node-rank", str(host.index),
                "--nproc-per-node", str(nproc_per_node),
                "--rdzv-endpoint", f"{self.hosts[0].ip}:{port}", "--rdzv-id", self.name,
                "--local-addr", host.ip, "--out", str(out),
            ]  # fmt: skip
            streams: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
            if output is not None:
                output.mkdir(parents=True, exist_ok=True)
                streams = {name: (output / f"host{host.index}.{name[3:]}").open("w")
                           for name in ("stdout", "stderr")}  # fmt: skip
            procs.append(
                self.popen(
                    host.index,
                    argv,
                    env={**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": host.ifname},
                    text=True,
                    stdin=subprocess.DEVNULL,
                    **streams,
                )  # fmt: skip
            )
            if output is not None:  # the child holds its own copies
                for stream in streams.values():
                    stream.close()
        return procs

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process of host ``host`` at once, as when the machine dies; its
        cable stays up, so the peers' connections break (the kernel resets them)."""
        return self._kill([host])

    def link_down(self, host: int) -> None:
        """Cut host ``host``'s cable (its switch port goes down)."""
        _run("ip", "-n", self.switch, "link", "set", f"s{host}", "down")

    def link_up(self, host: int) -> None:
        """Plug host ``host``'s cable back in."""
        _run("ip", "-n", self.switch, "link", "set", f"s{host}", "up")

    def wait_ready(self, timeout_s: float = 5.0) -> None:
        """Wait until the bridge forwards (its ports leave the listening state)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = _run("ip", "-n", self.switch, "-br", "link", "show", "master", "br0")
            if states and all(" UP " in f" {line} " for line in states.splitlines()):
                return
            time.sleep(0.05)
