"""The DDP communication hooks: plain all-reduce, and any Compressor, both timed.

DDP calls a hook once per gradient bucket, in the same bucket order on every rank, from the
autograd thread, and overlaps the returned future with the rest of backward. Rules kept here:

- Every collective is issued from the hook itself, never from a completion callback: gloo
  matches collectives by the order each rank issues them, and callbacks of different buckets
  complete in different orders on different ranks (the bug in torch's own PowerSGD hook with
  several buckets on gloo: it crashes or hangs there with torch 2.13).
- So a multi-round compressor runs all rounds but the last blocking; the last round, like the
  one round of the others, stays asynchronous and overlaps with backward.
- Callbacks only decode locally and record the collective's time and bytes (metrics/timers),
  after ``fut.value()``: a failed collective (a dead peer) must fail the step, not hand DDP
  a half-reduced buffer.
- ``ordered`` (--deterministic): sums are taken in rank order from an all-gather instead of
  by all-reduce. A ring all-reduce adds each element in an order set by the chunk it falls
  in, so with 3 or more ranks its bits depend on the bucket layout, and DDP's first iteration
  uses one bucket before rebuilding them: the first step after a restart summed in another
  order than the uninterrupted run's step, and the weights drifted apart in the last bits.
  The all-gather sends (W-1)/W of the gradient per rank more than a ring; with 2 ranks the
  sum is commutative and the all-reduce is kept.
"""

# No `from __future__ import annotations`: DDP inspects the hook's `bucket` annotation at run
# time and rejects a string.
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.compression.base import Compressor, nbytes
from scaletrain.metrics.timers import CommTimer, sent_bytes


@dataclass
class HookState:
    timer: CommTimer
    world_size: int
    compressor: Compressor | None = None
    group: Any = None  # the process group; None: the default one
    ordered: bool = False  # rank-ordered sums, bitwise independent of bucketing (see above)

    @property
    def gathers(self) -> bool:
        return self.ordered and self.world_size > 2


def _sum_launch(
    state: HookState, tensor: torch.Tensor
) -> tuple[Any, Callable[[], torch.Tensor], str]:
    """Start the sum of ``tensor`` over the ranks: (work, a function giving the sum once the
    work completed, the collective's name for byte accounting)."""
    if not state.gathers:
        work = dist.all_reduce(tensor, group=state.group, async_op=True)
        return work, lambda: tensor, "all_reduce"
    rows = tensor.new_empty(state.world_size * tensor.numel())
    work = dist.all_gather_into_tensor(rows, tensor.reshape(-1), group=state.group, async_op=True)

    def ordered_sum() -> torch.Tensor:
        flat = tensor.view(-1)
        parts = rows.view(state.world_size, -1)
        flat.copy_(parts[0])
        for row in parts[1:]:  # rank 0 + rank 1 + ...: one order, whatever the layout
            flat.add_(row)
        return tensor

    return work, ordered_sum, "all_gather"


def timed_allreduce_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default (divide by W, sum), timed from launch to completion."""
    buffer = bucket.buffer()
    start = state.timer.now()
    buffer.div_(state.world_size)
    work, reduced, collective = _sum_launch(state, buffer)
    sent = sent_bytes(collective, nbytes(buffer), state.world_size)

    def finished(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed collective (a dead peer): never return a stale buffer
        reduced()
        state.timer.record(start, state.timer.now(), sent)
        return buffer

    return work.get_future().then(finished)  # type: ignore[union-attr]


def _launch(state: HookState, payload: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
    """Start the compressor's collective on ``payload``; (work, a function giving the result
    once the work completed)."""
    assert state.compressor is not None
    if state.compressor.collective == "all_reduce":
        work, reduced, _ = _sum_launch(state, payload)
        return work, reduced
    # gloo wants a flat output; decompress sees one row per rank.
    out = payload.new_empty(state.world_size * payload.numel())
    work = dist.all_gather_into_tensor(out, payload, group=state.group, async_op=True)
    return work, lambda: out.view(state.world_size, *payload.shape)


def _collective(state: HookState) -> str:
    assert state.compressor is not None
    return "all_gather" if state.gathers else state.compressor.collective


def forget_if_not_finite(compressor: Compressor, key: Any, decoded: torch.Tensor) -> None:
    """After an overflowed step (fp16: the loss scaler will skip it), the compressor's memory
    of the bucket is dropped. ``decoded`` is the same on every rank, so all drop it alike."""
    if not torch.isfinite(decoded).all():
        compressor.forget(key)


def compressed_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    compressor = state.compressor
    assert compressor is not None
    grad = bucket.buffer()
    params = bucket.parameters()
    key = tuple(p.data_ptr() for p in params)  # stable per bucket layout (see compression/base)
    shapes = [p.shape for p in params]
    dense = sent_bytes("all_reduce", nbytes(grad), state.world_size)
    dense_share = dense // compressor.rounds  # attribute the dense cost once per bucket
    start = state.timer.now()
    payload = compressor.compress(key, grad, shapes)
    for _ in range(compressor.rounds - 1):
        work, result = _launch(state, payload)
        waited = state.timer.now()
        work.wait()
        end = state.timer.now()
        state.timer.blocked(end - waited)
        sent = sent_bytes(_collective(state), nbytes(payload), state.world_size)
        state.timer.record(start, end, sent, dense_share)
        payload = compressor.next_round(key, result())
        start = state.timer.now()
    work, result = _launch(state, payload)
    sent = sent_bytes(_collective(state), nbytes(payload), state.world_size)

    def finished(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed collective
        compressor.decompress(key, result(), grad)
        forget_if_not_finite(compressor, key, grad)
        state.timer.record(
            start, state.timer.now(), sent, dense - dense_share * (compressor.rounds - 1)
        )
        return grad

    return work.get_future().then(finished)
