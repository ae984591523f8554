"""A cost model of one training step, calibrated from short measurements: predict step time,
throughput and scaling efficiency for more workers and other links before renting them.

Pure functions. Inputs (``Calibration``): the single-worker step compute time at the
per-worker batch (forward, backward, optimizer, data), the gradient bytes, and the link: a
per-message latency and a bandwidth, fitted from all-reduce probes (analysis/probe.py) as
``t(n bytes) = 2 (W-1) latency + 2 (W-1)/W n / bandwidth``.

Formulas and what they assume:

- **ddp** (ring all-reduce): ``comm = 2 (W-1) lat + 2 (W-1)/W G / bw`` for G gradient bytes;
  ``step = compute + (1 - overlap) comm``, ``overlap`` the share of communication hidden behind
  backward (measured by scaletrain on every run; ~0 for gloo on CPU, where the all-reduce
  needs the cores backward uses).
- **compression** (ratio c, encode+decode e seconds per step): the same with G / c, plus e.
  Compressors that all-gather instead of all-reduce (top-k, sign) send (W-1) G / c: their
  cost grows with W. Over nodes: ``(G-1) (lat + p / intra_bw) + (k-1) (lat + G p / bw)``.
- **local_sgd / diloco** every H steps: ``step = compute + comm / H``.
- **ps** with K server shards: every worker pushes and pulls G per step; its own link carries
  2G, and the busiest server link ``2 W G / K``: ``comm = 2 lat + max(2G, 2WG/K) / bw``.
  Synchronous (bsp) timing; asynchronous modes hide it behind compute only when servers keep
  up (not modelled). **ps:K:1** (a backup of every slice, --ps-replicas 1): a server forwards
  the step's aggregated slice G/K to its backup and waits for the ack before it replies, in
  series: ``+ lat + G/K / bw`` (under asp every push is forwarded: the server links then
  carry twice the bytes).
- **ps co-located[:K]** (BytePS's co-located case: servers on K of the k nodes, one on each
  by default, each holding 1/K of the parameters): within a node as the hierarchical
  all-reduce, then each node pushes its shares and pulls them back, a server's node taking in
  the other k-1 nodes' 1/K: ``2 lat + 2 (k-1)/K M / bw`` (K = k: a ring's bytes, 2 latencies).
  The dedicated servers of ``ps`` are scaletrain's bsp rounds: push, then pull once every push
  is in, so a link carries 2G in sequence (BytePS's pipelined partitions overlap them: M/B).
- **fsdp** (FSDP / ZeRO-3 over all W): parameters all-gathered in forward and again in
  backward, gradients reduce-scattered: ``3 ((W-1) lat + (W-1)/W M / b)``, b the intra-node
  bandwidth when W fits in a node, else the node's link, which a ring spanning nodes crosses
  once each way (1.5x ddp's bytes). **hsdp:S**: the same within shard groups of S, then the
  W/S replicas of each shard all-reduce its M/S gradient, a node's devices at once through
  its link: ``2 (R-1) lat + 2 (R-1)/R min(G, W) M / S / bw``.
- **tp:T:A** (tensor parallel of T devices within a node, A MB of activations all-reduced a
  step: 4 per transformer layer of batch x sequence x hidden x bytes): a group of T computes
  one worker's step in compute/T; ``ring(A, T)`` on the intra-node link, never overlapped;
  then data parallel across the W/T groups on the 1/T of the gradients each device holds.
- **pipeline** (P stages, M microbatches): ``step = compute / P x (M + P - 1) / M`` plus
  ``2 (M + P - 2)`` activation hops of latency; the bubble is (P-1)/(M+P-1).
- **pp:P:M:A** (pipelines across nodes, data parallel over W / P of them; A bytes of
  activations a micro-batch sends across a stage boundary): ``step = (M + P - 1) compute /
  (P M) + 2 (M + P - 2) (lat + A / link) + dp``, the link the intra-node one when the P stages
  fit in a node, else the node's link shared by its devices; dp: each stage's 1/P of the
  gradients all-reduced with the same stage of the other pipelines after the flush.
- **ddp:tree** (NCCL's double binary tree, which it picks for small messages and many
  nodes): across the nodes ``2 ceil(log2 k) lat + 2 M / bw`` instead of the ring's ``2 (k-1)
  lat + 2 (k-1)/k M / bw``: fewer latencies, slightly more bytes.

**Nodes of several devices** (``gpus_per_node`` G > 1, ``intra_bandwidth``: each device's
bandwidth to the others of its node; ``bandwidth`` is then the node's, shared by its G
devices): an all-reduce over W = k nodes x G devices is hierarchical, as NCCL's and Horovod's
are: a reduce-scatter within each node, G concurrent all-reduces of M / G bytes across the k
nodes (together 2 (k-1)/k M through each node's link), an all-gather within each node:
``comm = 2 (G-1) lat + 2 (G-1)/G M / intra_bw + 2 (k-1) lat + 2 (k-1)/k M / bw`` (a world
within one node: the ring on intra_bw alone). One latency for every hop (intra-node hops
are faster: this over-counts latency within a node). Local SGD's and the compressors'
all-reduces use it too; a parameter server's workers share their node's link (each pushes
and pulls through bw / G), its servers have links of their own at bw; a pipeline's stages
talk over bw.

**Checked against published measurements** (``check_published``, published.toml): every
row predicted from its source's hardware and its own one-node figure (a device's compute is
that step less the model's communication within the node), within 15% of the published
throughput.

**Failures** (``plan_failures``): nodes fail independently, each every ``node_mtbf`` on
average, so a job of k nodes every M = node_mtbf / k. Restart from a checkpoint that blocks
delta seconds, taken every tau = sqrt(2 delta M) (Young/Daly, as --checkpoint-every auto),
with R seconds for a failed node's way back: the share of time lost is ``delta / tau + tau /
(2 M) + R / M``. In place (nothing rolls back): every failure pauses the survivors p seconds
and takes a node's G devices out for R: ``(p + R G / W) / M``; it assumes that never every
replica fails at once. Goodput is one minus the share (first order: valid while tau and R
are short against M; never below 0).

Every worker is assumed to have its own compute (a device, or its own cores) and its own
link at ``bandwidth`` (or its node's share of it). ``cores`` (optional) says instead that the
workers share one host of that many cores: compute then slows by the measured
``colocated_slowdown`` (2 workers that never synchronize, against 1 alone) and by ``W x
threads / cores`` when they oversubscribe it, which is what happens on this 2-core machine
beyond 2 workers. Then the ring all-reduce, too, runs on cores that compute needs: its wall
time with a core per process (the link probe) no longer says what it costs, its CPU does
(``collective_cpu_per_byte``, probed with more processes than cores: each of 4 on 2 cores
spent 13 ms of CPU on a 16.8 MB all-reduce here), and the step is at least the cores' share
of every worker's compute and ring CPU. Noise, stragglers and the slowest worker's wait are
not modelled.

**Many processes on few cores, compute elsewhere** (``cores`` and ``cpu_s``: the host CPU one
process spends per step, recorded as ``cpu_s`` in metrics.jsonl; and ``host``, probed with W
processes on the host (analysis/probe.py): the CPU one of them spends in a step's all-reduce,
``collective_cpu_s``, and how much slower the rest of its host work runs than in a process
alone, by which ``cpu_s`` is multiplied). This is the emulation of make scale: 32 processes on
2 cores whose compute is a device (a sleeping one). A synchronous step has two phases that
every process runs at the same moment: the device's work (``compute_s - cpu_s``, no host CPU)
and the host's (the loop, the all-reduce): W processes of ``cpu_s + collective_cpu_s`` each
share the cores, so ``step = compute_s - cpu_s + max(c, W c / cores) + comm``, c = cpu_s +
collective_cpu_s. Steps without a collective (local SGD between synchronizations) let the
processes drift apart, one's host work overlapping another's device work: ``step =
max(compute_s + wait, W cpu_s f / cores)``, where the probe measured free steps (the host's
work cut into as many pieces as the device wakes the host a step): f, their host CPU over a
process alone's (each wake-up on a busy host costs CPU: caches refilled, the scheduler; x2 at
8-32 processes on this 2-core machine, where the same work in one burst costs no more than
alone), and wait, the wall time a step waits for a core beyond alone's. A parameter server's
processes (W workers, K servers) run free the same way, each push costing its worker and its
server ``collective_cpu_s / 2`` (a point-to-point exchange of the all-reduce's size): ``step =
max(compute_s + comm, (W (cpu_s + c') + W c') / cores)``, c' = collective_cpu_s / 2. A bsp
parameter server probed as such (``ps_host``: W workers' and K servers' rounds over its own
links, probe.py's probe_ps) is synchronous instead: every round the devices work, then the
workers' host work and pushes and the servers' handling of every push share the cores:
``step = compute_s - cpu_s + max(w, (W w + W K s) / cores) + comm``, w = cpu_s x slowdown +
a worker's push-and-pull CPU, s = a server's CPU per push. The probe is of the host, not of
the job: W processes that sleep the job's device time, do a step's worth of small ops and
all-reduce a few KB.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from scaletrain.io import read_jsonl

GATHER_COMPRESSORS = ("topk", "sign")


class HostProbe(NamedTuple):
    """The host probed with ``world`` processes (analysis/probe.py's probe_host)."""

    world: int
    collective_cpu_s: float  # CPU one of them spends in a step's all-reduce
    slowdown: float  # its other host work's CPU over the same work's in a process alone
    # Steps that wait for no other process (local SGD between synchronizations), the host
    # work cut into the device's wake-ups: its CPU over alone's (0: as ``slowdown``), and the
    # wall time a step waits for the cores beyond alone's.
    free_slowdown: float = 0.0
    free_wait_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    compute_s: float  # one worker's step without communication, at the per-worker batch
    batch_size: int  # samples per worker per step (its batch times --grad-accum)
    grad_bytes: int  # fp32 gradient bytes per step
    latency_s: float  # per message
    bandwidth_Bps: float  # per link, bytes per second
    overlap: float = 0.0  # share of gradient communication hidden behind backward
    cores: int = 0  # cores the workers share on one host (0: each worker has its own)
    threads_per_worker: int = 1
    # On a shared host: compute of one of several co-located workers over that of a worker
    # alone (memory bandwidth, caches, the other processes), measured by running 2 workers
    # that never synchronize.
    colocated_slowdown: float = 1.0
    # On a shared host whose cores the workers outnumber: the CPU a process spends per byte
    # it sends in a ring all-reduce (2 (W-1) / W of the payload), probed with more
    # processes than cores. The ring then runs on cores that compute needs too, so its CPU,
    # not the wall time it took with a core to itself, is what the step pays. 0: not modelled.
    collective_cpu_per_byte: float = 0.0
    # Many processes on ``cores`` cores whose compute is a device: the host CPU per step of
    # one process alone (the loop and the framework, without communication), and the host
    # probed at several W (HostProbe; a plain tuple of its first 3 or more fields will do).
    # 0 / empty: not modelled.
    cpu_s: float = 0.0
    host: tuple[tuple[Any, ...], ...] = ()
    # A bsp parameter server's rounds probed on the host (probe.py's probe_ps): (W processes,
    # K of them servers, the CPU a worker spends in a round's push and pull, the CPU a server
    # spends per push, the slowdown of a worker's other host work).
    ps_host: tuple[tuple[int, int, float, float, float], ...] = ()
    # Devices per node and each one's bandwidth to its node's others (bytes/s): with more
    # than one, ``bandwidth_Bps`` is a node's link, and all-reduces are hierarchical.
    gpus_per_node: int = 1
    intra_bandwidth_Bps: float = 0.0


@dataclass(frozen=True)
class Prediction:
    method: str
    workers: int
    step_s: float
    compute_s: float
    comm_s: float
    samples_per_s: float
    efficiency: float  # samples/s over (workers x one worker's samples/s without comm)


def fit_link(sizes: list[int], seconds: list[float], workers: int) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) from all-reduce times of several sizes, least squares on
    t = 2 (W-1) lat + 2 (W-1)/W n / bw."""
    n = len(sizes)
    if n < 2 or workers < 2:
        raise ValueError("fit_link: need at least two sizes and two workers")
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    bandwidth = 2 * (workers - 1) / workers / slope if slope > 0 else float("inf")
    return max(intercept, 0.0) / (2 * (workers - 1)), bandwidth


def ring_s(nbytes: float, ranks: int, latency_s: float, bandwidth_Bps: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks``, each with its own link."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth_Bps


def tree_s(nbytes: float, ranks: int, latency_s: float, bandwidth_Bps: float) -> float:
    """NCCL's double binary tree all-reduce of ``nbytes`` over ``ranks``: a reduce up and a
    broadcast down, each ``ceil(log2 n)`` hops deep; two trees carry half the bytes each, and
    every rank sends and receives its half of each twice: ``2 ceil(log2 n) lat + 2 M / bw``
    (against the ring's ``2 (n-1) lat + 2 (n-1)/n M / bw``: fewer latencies, a few more
    bytes)."""
    if ranks <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * latency_s + 2 * nbytes / bandwidth_Bps


def allreduce_s(nbytes: float, workers: int, cal: Calibration, *, tree: bool = False) -> float:
    """Flat ring, or hierarchical over nodes of ``gpus_per_node`` devices (the docstring);
    ``tree``: across the nodes (or the flat workers) a double binary tree instead of a ring."""
    across = tree_s if tree else ring_s
    g = cal.gpus_per_node
    if g <= 1:
        return across(nbytes, workers, cal.latency_s, cal.bandwidth_Bps)
    within = ring_s(nbytes, min(g, workers), cal.latency_s, cal.intra_bandwidth_Bps)
    return within + across(nbytes, nodes(workers, cal), cal.latency_s, cal.bandwidth_Bps)


def nodes(workers: int, cal: Calibration) -> int:
    return -(-workers // max(cal.gpus_per_node, 1))


def worker_link_Bps(cal: Calibration) -> float:
    """A worker's share of its node's link."""
    return cal.bandwidth_Bps / max(cal.gpus_per_node, 1)


def allgather_s(nbytes: float, workers: int, cal: Calibration) -> float:
    """Every worker receives the other W-1 payloads; over nodes, a node's link brings in its
    G devices' share of the other nodes' payloads."""
    if workers <= 1:
        return 0.0
    g = cal.gpus_per_node
    if g <= 1:
        return (workers - 1) * (cal.latency_s + nbytes / cal.bandwidth_Bps)
    within = (min(g, workers) - 1) * (cal.latency_s + nbytes / cal.intra_bandwidth_Bps)
    k = nodes(workers, cal)
    return within + (k - 1) * (cal.latency_s + g * nbytes / cal.bandwidth_Bps)


def shard_collective_s(nbytes: float, ranks: int, cal: Calibration) -> float:
    """One all-gather (or reduce-scatter) of ``nbytes`` in all over ``ranks`` devices, each
    holding 1/ranks of it, as one ring: ``(n-1) lat + (n-1)/n M / b``, b the device's intra
    bandwidth when the ranks fit in one node, else the node's link (a ring that spans
    nodes crosses each node's link once each way; a flat cluster: the device's own link)."""
    if ranks <= 1:
        return 0.0
    within = cal.gpus_per_node > 1 and ranks <= cal.gpus_per_node
    link = cal.intra_bandwidth_Bps if within else cal.bandwidth_Bps
    return (ranks - 1) * (cal.latency_s + nbytes / ranks / link)


def replicas_allreduce_s(nbytes: float, replicas: int, per_node: int, cal: Calibration) -> float:
    """``per_node`` devices of a node each all-reduce their own ``nbytes`` with the same
    device of ``replicas`` other replicas at once (a ring each), all through the node's link
    (a flat cluster: one device, its own link)."""
    if replicas <= 1:
        return 0.0
    share = cal.bandwidth_Bps / max(per_node, 1)
    return ring_s(nbytes, replicas, cal.latency_s, share)


def compute_s(cal: Calibration, workers: int) -> float:
    """One worker's compute; on a shared host (``cores``) slowed by co-location, and by
    oversubscription when the workers' threads outnumber the cores."""
    if not cal.cores or workers <= 1 or host_bound(cal):  # host-bound: the step has the cores
        return cal.compute_s
    oversubscribed = max(1.0, workers * cal.threads_per_worker / cal.cores)
    return cal.compute_s * cal.colocated_slowdown * oversubscribed


def oversubscribed_step(cal: Calibration, workers: int, step: float, nbytes: float) -> float:
    """``step``, or the cores' share of every worker's compute and all-reduce CPU (of
    ``nbytes`` a step) when the workers outnumber the cores and that is longer."""
    share = workers * cal.threads_per_worker / cal.cores if cal.cores else 0.0
    if share <= 1 or not cal.collective_cpu_per_byte:
        return step
    ring_cpu = cal.collective_cpu_per_byte * 2 * (workers - 1) / workers * nbytes
    return max(step, compute_s(cal, workers) + share * ring_cpu)


def host_bound(cal: Calibration) -> bool:
    """The shared-host term applies: processes share ``cores`` and their host CPU is known."""
    return bool(cal.cores and cal.cpu_s)


def _probed(cal: Calibration, processes: int) -> HostProbe:
    """The probe at the W nearest ``processes`` (slowdowns at least 1)."""
    if processes <= 1 or not cal.host:
        return HostProbe(processes, 0.0, 1.0, 1.0, 0.0)
    p = HostProbe(*min(cal.host, key=lambda p: abs(p[0] - processes)))
    slowdown = max(p.slowdown, 1.0)
    free = max(p.free_slowdown, 1.0) if p.free_slowdown else slowdown
    return p._replace(slowdown=slowdown, free_slowdown=free)


def host_cpu(cal: Calibration, processes: int) -> float:
    """One of ``processes`` processes' host CPU per step without communication."""
    return cal.cpu_s * _probed(cal, processes).slowdown


def collective_cpu(cal: Calibration, processes: int) -> float:
    """CPU one of ``processes`` processes spends in a step's all-reduce."""
    return _probed(cal, processes).collective_cpu_s


def synchronous_step(cal: Calibration, workers: int, comm: float) -> float:
    """Every process computes on its device, then all run their host work together."""
    cpu = host_cpu(cal, workers) + collective_cpu(cal, workers)
    return cal.compute_s - cal.cpu_s + max(cpu, workers * cpu / cal.cores) + comm


def free_step(cal: Calibration, processes: int, cpu: float, longest: float) -> float:
    """Processes that do not wait for each other: each step is its own ``longest`` path, or
    the host's cores, shared by every process's ``cpu``, whichever is slower."""
    return max(longest, processes * cpu / cal.cores)


def _prediction(method: str, workers: int, cal: Calibration, compute: float,
                comm_total: float, step: float) -> Prediction:  # fmt: skip
    rate = workers * cal.batch_size / step
    ideal = workers * cal.batch_size / cal.compute_s
    return Prediction(method, workers, step, compute, comm_total, rate, rate / ideal)


def predict_ddp(cal: Calibration, workers: int, *, ratio: float = 1.0, encode_s: float = 0.0,
                compressor: str = "none", tree: bool = False) -> Prediction:  # fmt: skip
    compute = compute_s(cal, workers)
    payload = cal.grad_bytes / ratio
    if compressor in GATHER_COMPRESSORS:
        comm = allgather_s(payload, workers, cal)
    else:
        comm = allreduce_s(payload, workers, cal, tree=tree)
    encode = encode_s if workers > 1 else 0.0
    step = compute + encode + (1 - cal.overlap) * comm
    if compressor == "none" and host_bound(cal):
        step = synchronous_step(cal, workers, (1 - cal.overlap) * comm)
    elif compressor == "none":
        step = oversubscribed_step(cal, workers, step, payload)
    name = "ddp" if compressor == "none" else f"ddp+{compressor}"
    return _prediction(name + (" tree" if tree else ""), workers, cal, compute, comm + encode, step)


def predict_local_sgd(cal: Calibration, workers: int, sync_every: int) -> Prediction:
    compute = compute_s(cal, workers)
    comm = allreduce_s(cal.grad_bytes, workers, cal) / sync_every
    if host_bound(cal):  # H-1 steps run free, the H-th synchronizes
        probed = _probed(cal, workers)
        free = free_step(cal, workers, cal.cpu_s * probed.free_slowdown,
                         cal.compute_s + probed.free_wait_s)  # fmt: skip
        synced = synchronous_step(cal, workers, comm * sync_every)
        step = ((sync_every - 1) * free + synced) / sync_every
    else:
        step = oversubscribed_step(cal, workers, compute + comm, cal.grad_bytes / sync_every)
    return _prediction(f"local_sgd H={sync_every}", workers, cal, compute, comm, step)


def predict_ps(cal: Calibration, workers: int, servers: int, replicas: int = 0) -> Prediction:
    compute = compute_s(cal, workers)
    g = cal.grad_bytes
    worker_link = 2 * g / worker_link_Bps(cal)
    comm = 2 * cal.latency_s + max(worker_link, 2 * workers * g / servers / cal.bandwidth_Bps)
    # The backup's round trip, between the step's last push and the replies.
    comm += replicas * (cal.latency_s + g / servers / cal.bandwidth_Bps)
    step = compute + comm
    if host_bound(cal) and cal.ps_host:  # bsp rounds on the shared cores
        step = bsp_round(cal, workers, servers, comm)
    elif host_bound(cal):
        processes = workers + servers
        push = collective_cpu(cal, processes) / 2
        step = free_step(cal, workers, host_cpu(cal, processes) + 2 * push, cal.compute_s + comm)
    name = f"ps K={servers}" + (f" R={replicas}" if replicas else "")
    return _prediction(name, workers, cal, compute, comm, step)


def bsp_round(cal: Calibration, workers: int, servers: int, comm: float) -> float:
    """A bsp round on a shared host: the devices' work, then every worker's host work and
    push at once while the servers serve every push (each worker pushes to every server), all
    on the same cores; the round ends with the last reply."""
    _, _, exchange, per_push, slowdown = min(
        cal.ps_host, key=lambda p: abs(p[0] - p[1] - workers) + abs(p[1] - servers)
    )
    worker = cal.cpu_s * max(slowdown, 1.0) + exchange
    total = workers * worker + workers * servers * per_push
    return cal.compute_s - cal.cpu_s + max(worker, total / cal.cores) + comm


def predict_fsdp(cal: Calibration, workers: int, shard: int = 0) -> Prediction:
    """FSDP / ZeRO-3 over ``shard`` devices (0: all ``workers``): every step all-gathers the
    parameters in forward and again in backward, and reduce-scatters the gradients, each a
    ring over the shard group; with ``shard`` < ``workers`` (HSDP) the W / shard replicas of
    each shard then all-reduce its gradient, every device of a node at once through the
    node's link. Parameters and gradients the same size (``grad_bytes``); ``overlap`` the
    share hidden behind compute (prefetched all-gathers, reduce-scatters behind backward).
    Fewer workers than ``shard``: one group of them all."""
    s = workers if shard <= 0 else min(shard, workers)
    if workers % s:
        raise ValueError(f"predict: hsdp's shard group ({s}) must divide the workers ({workers})")
    m = cal.grad_bytes
    sharded = 3 * shard_collective_s(m, s, cal)
    per_node = min(max(cal.gpus_per_node, 1), workers)
    replicated = replicas_allreduce_s(m / s, workers // s, per_node, cal)
    comm = sharded + replicated
    compute = compute_s(cal, workers)
    step = compute + (1 - cal.overlap) * comm
    name = "fsdp" if shard <= 0 else f"hsdp S={shard}"
    return _prediction(name, workers, cal, compute, comm, step)


def predict_tensor(cal: Calibration, workers: int, degree: int, activation_bytes: float
                   ) -> Prediction:  # fmt: skip
    """Tensor parallel (Megatron) of ``degree`` devices within a node, data parallel across
    the W / degree groups: a group computes one worker's step (the per-worker batch) in
    1/degree of the time; every step all-reduces ``activation_bytes`` (forward and backward
    together: 4 per transformer layer of batch x sequence x hidden x bytes) over the group on
    the intra-node links, on the critical path (no overlap); then each device all-reduces
    its 1/degree of the gradients with the same device of the other groups (fewer workers
    than ``degree``: one group of them all)."""
    name, degree = f"tp T={degree}", min(degree, workers)
    if degree < 1 or workers % degree:
        raise ValueError(f"predict: tp's degree ({degree}) must divide the workers ({workers})")
    if cal.gpus_per_node > 1 and degree > cal.gpus_per_node:
        raise ValueError(
            f"predict: tp:{degree} spans nodes of {cal.gpus_per_node} devices; tensor "
            "parallelism stays within a node"
        )
    within = cal.intra_bandwidth_Bps if cal.gpus_per_node > 1 else cal.bandwidth_Bps
    tp_comm = ring_s(activation_bytes, degree, cal.latency_s, within)
    groups = workers // degree
    per_node = min(max(cal.gpus_per_node, 1), workers)
    dp_comm = replicas_allreduce_s(cal.grad_bytes / degree, groups, per_node, cal)
    compute = compute_s(cal, workers) / degree
    step = compute + tp_comm + (1 - cal.overlap) * dp_comm
    rate = groups * cal.batch_size / step
    ideal = workers * cal.batch_size / cal.compute_s
    return Prediction(name, workers, step, compute, tp_comm + dp_comm, rate,
                      rate / ideal)  # fmt: skip


def predict_colocated_ps(cal: Calibration, workers: int, servers: int = 0) -> Prediction:
    """A parameter server co-located with the workers, on ``servers`` of the k nodes (0: one
    on every node), each holding 1/K of the parameters (BytePS's co-located case, and
    TensorFlow's distributed_replicated): within a node the devices reduce and then
    broadcast as the hierarchical all-reduce does; a node pushes its sum's shares to the K
    servers and pulls them back, and a server's node takes in the other k-1 nodes' pushes
    of its 1/K: ``2 lat + 2 (k-1)/K M / bw``; with K = k, a ring's bytes with 2 latencies."""
    g = max(cal.gpus_per_node, 1)
    k = nodes(workers, cal)
    shards = k if servers <= 0 else min(servers, k)
    m = cal.grad_bytes
    within = ring_s(m, min(g, workers), cal.latency_s, cal.intra_bandwidth_Bps) if g > 1 else 0
    across = 2 * cal.latency_s + 2 * (k - 1) / shards * m / cal.bandwidth_Bps if k > 1 else 0.0
    comm = within + across
    compute = compute_s(cal, workers)
    step = compute + (1 - cal.overlap) * comm
    name = "ps co-located" if servers <= 0 else f"ps co-located K={servers}"
    return _prediction(name, workers, cal, compute, comm, step)


def predict_pipeline(cal: Calibration, stages: int, microbatches: int) -> Prediction:
    """One pipeline of ``stages`` workers on the per-worker batch of one: the step's compute
    is shared by the stages, stretched by the bubble."""
    per_stage = compute_s(cal, stages) / stages
    m, p = microbatches, stages
    hops = 2 * (m + p - 2) * cal.latency_s if p > 1 else 0.0
    step = per_stage * (m + p - 1) / m + hops
    rate = cal.batch_size / step
    ideal = stages * cal.batch_size / cal.compute_s
    return Prediction(f"pipeline M={m}", stages, step, per_stage * (m + p - 1) / m, hops, rate,
                      rate / ideal)  # fmt: skip


def predict_pipeline_dp(cal: Calibration, workers: int, stages: int, microbatches: int,
                        activation_bytes: float) -> Prediction:  # fmt: skip
    """Pipelines of ``stages`` across nodes, data parallel over the W / P of them. A pipeline
    computes one worker's step (the per-worker batch) in ``microbatches`` M: each of the
    ``M + P - 1`` slots of its schedule is a micro-batch's forward and backward on one stage,
    ``compute / (P M)``, and a hop each way to the next stage of ``lat + A / link`` (A the
    activation bytes one micro-batch sends across a stage boundary; its gradient comes back
    the same size), not overlapped: ``step = (M + P - 1) compute / (P M) + 2 (M + P - 2) hop``.
    The link: the intra-node one when the stages fit in a node; else the stages are nodes
    apart and the node's link is shared by its devices, all sending at once. After the flush
    each stage all-reduces its 1/P of the gradients with the same stage of the other
    pipelines (``replicas_allreduce_s``)."""
    m, p = microbatches, stages
    if p < 1 or m < 1 or workers % p:
        raise ValueError(
            f"predict: pp's stages ({p}) must divide the workers ({workers}), with M >= 1"
        )
    per_node = min(max(cal.gpus_per_node, 1), workers)
    within = cal.gpus_per_node > 1 and p <= cal.gpus_per_node
    link = cal.intra_bandwidth_Bps if within else cal.bandwidth_Bps / per_node
    hop = cal.latency_s + activation_bytes / link
    compute = compute_s(cal, workers) / p
    pipe_comm = 2 * (m + p - 2) * hop if p > 1 else 0.0
    pipelines = workers // p
    dp_comm = replicas_allreduce_s(cal.grad_bytes / p, pipelines, per_node, cal)
    step = compute * (m + p - 1) / m + pipe_comm + dp_comm
    rate = pipelines * cal.batch_size / step
    ideal = workers * cal.batch_size / cal.compute_s
    return Prediction(f"pp P={p} M={m}", workers, step, compute, pipe_comm + dp_comm, rate,
                      rate / ideal)  # fmt: skip


def bubble(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def calibrate_run(run_dir: Path, warmup: int = 3) -> dict[str, float]:
    """From a finished 1-worker run of the job: its step time without communication (median
    of rank 0's compute + data per step after ``warmup`` steps), the samples a worker trains
    per step (its batch times --grad-accum: one step is that many micro-batches and one
    synchronization), the gradient bytes (= parameter bytes, fp32) and the measured overlap."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl")
               if r["rank"] == 0 and r["step"] > warmup]  # fmt: skip
    if not records:
        raise ValueError(f"calibrate: {run_dir} has no steps after the first {warmup}")
    steady = [r for r in records if not r.get("checkpoint_s")] or records
    grad_bytes = summary["per_rank"][0].get("memory", {}).get("param_bytes")
    if not grad_bytes:
        raise ValueError(f"calibrate: {run_dir}'s summary.json does not say the model's size")
    return {
        "compute_s": statistics.median(r["compute_s"] + r["data_s"] for r in records),
        # Host CPU per step (records before it was recorded: 0, not modelled). The mean, not
        # the median: the host has to supply all of it. Steps that saved a checkpoint are
        # left out: their CPU is the save's (4-6 ms a save here), and what the model predicts
        # is the step without checkpoint writes.
        "cpu_s": statistics.mean(r.get("cpu_s", 0.0) for r in steady),
        "batch_size": summary["batch_size_per_worker"] * summary.get("grad_accum", 1),
        "grad_bytes": grad_bytes,
        "overlap": summary.get("overlap") or 0.0,
    }


def measured_checkpoint_s(run_dir: Path) -> float | None:
    """The mean time a checkpoint blocked rank 0's step in a finished run (None: it saved
    none)."""
    saves = [r["checkpoint_s"] for r in read_jsonl(run_dir / "metrics.jsonl")
             if r["rank"] == 0 and r.get("checkpoint_s")]  # fmt: skip
    return statistics.mean(saves) if saves else None


def predict_method(cal: Calibration, method: str, workers: int) -> Prediction:
    """``ddp``, ``ddp:tree`` (a double binary tree across nodes), ``local_sgd:H``, ``ps:K``,
    ``ps-colocated[:K]``, ``fsdp``, ``hsdp:S`` (shard groups of S), ``tp:T:ACTIVATION_MB``
    (tensor parallel of T, that many MB of activations all-reduced a step),
    ``compressed:RATIO[:ENCODE_MS]`` (an all-reduce compressor such as PowerSGD),
    ``pipeline:P:M`` (workers ignored: one pipeline of P), ``pp:P:M:ACTIVATION_MB``
    (pipelines of P stages across nodes, data parallel over W / P; MB a micro-batch sends
    across a stage boundary)."""
    name, *args = method.split(":")
    if method == "ddp:tree":
        return predict_ddp(cal, workers, tree=True)
    try:
        numbers = [float(a) for a in args]
        if name == "ddp" and not numbers:
            return predict_ddp(cal, workers)
        if name == "local_sgd" and len(numbers) == 1:
            return predict_local_sgd(cal, workers, int(numbers[0]))
        if name == "ps" and len(numbers) == 1:
            return predict_ps(cal, workers, int(numbers[0]))
        if name == "ps" and len(numbers) == 2 and numbers[1] in (0, 1) and numbers[0] >= 2:
            return predict_ps(cal, workers, int(numbers[0]), int(numbers[1]))
        if name == "compressed" and len(numbers) in (1, 2):
            encode = numbers[1] / 1e3 if len(numbers) == 2 else 0.0
            return replace(predict_ddp(cal, workers, ratio=numbers[0], encode_s=encode,
                                       compressor="x"), method=method)  # fmt: skip
        if name == "pipeline" and len(numbers) == 2:
            return predict_pipeline(cal, int(numbers[0]), int(numbers[1]))
        if name == "pp" and len(numbers) == 3:
            return predict_pipeline_dp(cal, workers, int(numbers[0]), int(numbers[1]),
                                       numbers[2] * 1e6)  # fmt: skip
        if name == "fsdp" and not numbers:
            return predict_fsdp(cal, workers)
        if name == "hsdp" and len(numbers) == 1 and numbers[0] >= 1:
            return predict_fsdp(cal, workers, int(numbers[0]))
        if name == "tp" and len(numbers) == 2 and numbers[0] >= 1:
            return predict_tensor(cal, workers, int(numbers[0]), numbers[1] * 1e6)
        if name == "ps-colocated" and len(numbers) <= 1:
            return predict_colocated_ps(cal, workers, int(numbers[0]) if numbers else 0)
    except ValueError as e:
        if str(e).startswith("predict:"):
            raise
    raise ValueError(
        f"predict: cannot read method {method!r}; use ddp, ddp:tree, local_sgd:H, ps:K[:R], "
        "ps-colocated[:K], fsdp, hsdp:S (shard group), tp:T:ACTIVATION_MB, "
        "compressed:RATIO[:ENCODE_MS], pipeline:P:M or pp:P:M:ACTIVATION_MB"
    )


# Failures in the plan: goodput against the job's size.

# Published: jobs of 1,024 GPUs on Meta's research clusters failed every 7.9 h on average
# (Kokolis et al. 2024, "Revisiting Reliability in Large-Scale Machine Learning Research
# Clusters"): about 8,100 h per GPU. Llama 3's pre-training (Meta 2024, "The Llama 3 Herd of
# Models": 419 unexpected interruptions in 54 days on 16,384 GPUs) is about 50,700 h per GPU.
# The default takes the first, the more frequent.
DEVICE_MTBF_H = 7.9 * 1024


@dataclass(frozen=True)
class FailurePlan:
    """What failures cost a job of ``workers`` devices, nodes of ``gpus_per_node``, each
    node failing independently every ``node_mtbf_s`` on average (so the job every
    node_mtbf_s / nodes). Restart from a checkpoint: checkpoints every Young/Daly interval
    (fault/interval.py, as --checkpoint-every auto) at ``checkpoint_s`` each; a failure
    loses half an interval of work on average and ``restart_s`` of everyone's time.
    In place: no rollback; each failure pauses the survivors ``pause_s`` and takes the
    node's devices out for ``restart_s`` (until they are back and healed)."""

    workers: int
    nodes: int
    job_mtbf_s: float
    checkpoint_interval_s: float
    goodput_restart: float  # share of the time spent on useful steps
    goodput_inplace: float
    lost_h_per_day_restart: float
    lost_h_per_day_inplace: float


def plan_failures(workers: int, gpus_per_node: int, node_mtbf_s: float, checkpoint_s: float,
                  restart_s: float, pause_s: float) -> FailurePlan:  # fmt: skip
    from scaletrain.fault.interval import optimal_interval_s, predicted_overhead

    n = -(-workers // max(gpus_per_node, 1))
    mtbf = node_mtbf_s / n
    interval = optimal_interval_s(checkpoint_s, mtbf)
    restart = predicted_overhead(checkpoint_s, interval, mtbf) + restart_s / mtbf
    # A node's devices are out for restart_s: the job runs on the others meanwhile.
    inplace = (pause_s + restart_s * min(gpus_per_node, workers) / workers) / mtbf
    good_restart, good_inplace = max(0.0, 1 - restart), max(0.0, 1 - inplace)
    return FailurePlan(workers, n, mtbf, interval, good_restart, good_inplace,
                       24 * (1 - good_restart), 24 * (1 - good_inplace))  # fmt: skip


# Units of a description (scaletrain predict without a run).

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str, what: str = "count") -> int:
    """'25.6M' -> 25_600_000; '7B', '1.5T', '350k', '1e8', '1_000_000' as written."""
    match = re.fullmatch(r"([0-9_]*\.?[0-9_]+(?:e[+-]?\d+)?)\s*([kmbgt]?)", text.strip().lower())
    if not match:
        raise ValueError(f"{what}: expected a number such as 25.6M, 7B or 1e8, got {text!r}")
    value = float(match.group(1).replace("_", "")) * _COUNT_SUFFIX[match.group(2)]
    if value < 1:
        raise ValueError(f"{what}: must be at least 1, got {text!r}")
    return round(value)


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """Bytes per second from bits ('10gbit', '100Gb/s', '400Gbps') or bytes ('900GB/s',
    '25GBps', '1.5TB/s'): a lower-case b (or 'bit') counts bits, an upper-case B bytes."""
    match = re.fullmatch(
        r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([kKmMgGtT]?)(bit|b|B)(?:/s|ps)?", text.strip()
    )
    if not match:
        raise ValueError(
            f"{what}: expected bits (10gbit, 100Gb/s) or bytes (900GB/s), got {text!r}"
        )
    value = float(match.group(1)) * _PREFIX[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{what}: must be above 0, got {text!r}")
    return value if match.group(3) == "B" else value / 8


@dataclass(frozen=True)
class Cluster:
    """A named cluster (clusters.toml): what one node is and how nodes are linked."""

    name: str
    description: str
    gpus_per_node: int
    intra_bandwidth_Bps: float  # each device to the others of its node, one direction
    bandwidth_Bps: float  # a node's link to the others, one direction
    latency_us: float
    sources: tuple[str, ...]


def load_clusters(extra: Path | None = None) -> dict[str, Cluster]:
    """The presets shipped in clusters.toml, with ``extra``'s (a TOML file of the same
    form) added over them: a table per cluster, its keys those of ``Cluster``, bandwidths
    as text ('450GB/s', '3200gbit')."""
    text = resources.files("scaletrain.analysis").joinpath("clusters.toml").read_text()
    tables = dict(tomllib.loads(text))
    if extra is not None:
        try:
            tables |= tomllib.loads(extra.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--cluster-file {extra}: {e}") from None
    return {name: _cluster(name, table) for name, table in tables.items()}


def _cluster(name: str, table: Any) -> Cluster:
    keys = {"description", "gpus_per_node", "intra_bandwidth", "bandwidth", "latency_us",
            "sources"}  # fmt: skip
    if not isinstance(table, dict) or set(table) != keys:
        raise ValueError(f"cluster {name!r}: expected the keys {sorted(keys)}")
    return Cluster(
        name=name, description=str(table["description"]),
        gpus_per_node=int(table["gpus_per_node"]),
        intra_bandwidth_Bps=parse_bandwidth(str(table["intra_bandwidth"]),
                                            f"{name}.intra_bandwidth"),
        bandwidth_Bps=parse_bandwidth(str(table["bandwidth"]), f"{name}.bandwidth"),
        latency_us=float(table["latency_us"]), sources=tuple(map(str, table["sources"])),
    )  # fmt: skip


# Checked against published measurements (published.toml).


@dataclass(frozen=True)
class PublishedCheck:
    source: str
    model: str
    gpus: int
    published: float  # samples/s of the job (or of one device: per_gpu)
    predicted: float
    unit: str
    miss: str = ""  # why the model misses this row, where published.toml says it does

    @property
    def within(self) -> bool:
        """Within 15% of the published rate (the floor every row not marked a miss meets)."""
        return abs(self.ratio - 1) <= 0.15

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def check_published(path: Path | None = None) -> list[PublishedCheck]:
    """Every row of published.toml (or ``path``, a file of the same form) predicted from its
    source's hardware and its own base figure (one node, or the fewest devices the source
    ran): a device's compute is that figure's step less the model's communication at the
    base; the step at ``gpus`` devices is that compute plus the model's communication there."""
    text = path.read_text() if path else (
        resources.files("scaletrain.analysis").joinpath("published.toml").read_text())  # fmt: skip
    out = []
    for name, source in tomllib.loads(text).items():
        for row in source["rows"]:
            cal = Calibration(
                compute_s=1.0, batch_size=int(row["batch"]),
                grad_bytes=round(float(row["params"]) * float(source["bytes_per_param"])),
                latency_s=float(source["latency_us"]) * 1e-6,
                bandwidth_Bps=parse_bandwidth(str(source["bandwidth"]), f"{name}.bandwidth"),
                gpus_per_node=int(source["gpus_per_node"]),
                intra_bandwidth_Bps=parse_bandwidth(str(source["intra_bandwidth"]),
                                                    f"{name}.intra_bandwidth"),
            )  # fmt: skip
            base, per_gpu = int(row["base_gpus"]), bool(source["per_gpu"])
            device_rate = float(row["base_rate"]) / (1 if per_gpu else base)
            base_step = cal.batch_size / device_rate  # every device's step at the base
            within = predict_method(cal, source["method"], base).step_s - cal.compute_s
            cal = replace(cal, compute_s=base_step - within)
            for gpus, rate, servers in row["points"]:
                method = source["method"] + (f":{servers}" if servers else "")
                step = predict_method(cal, method, int(gpus)).step_s
                predicted = cal.batch_size / step * (1 if per_gpu else int(gpus))
                unit = "per GPU" if per_gpu else "in all"
                out.append(PublishedCheck(name, str(row["model"]), int(gpus), float(rate),
                                          predicted, unit, str(row.get("miss", ""))))  # fmt: skip
    return out
