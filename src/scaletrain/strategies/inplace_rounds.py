"""Local SGD and DiLoCo with in-place recovery (``--recovery inplace --strategy local_sgd`` or
``diloco``): the replicas train rounds of up to --sync-every local steps, and the quorum forms
at each synchronization, as torchft's LocalSGD and DiLoCo managers do; a replica lost between
two synchronizations costs only its own work since the first of them.

A round. At a synchronization, its quorum's participants (n, each with its quorum rank) deal
the next round: up to --sync-every steps of ``batch_size x n`` samples each, taken first from
the redo list (below), then from the epoch's order at the cursor. A round never crosses an
epoch: the epoch's last round is shorter, and the next epoch starts only when the redo list is
empty. Round rank k trains its part of each step (split_counts) with its own optimizer and
counts its samples. Every participant deals the same round from the same state (the plan's
state is the sampler's cursor, the redo list, the round and the members of the last
synchronization), and the cursor moves past the round when it is dealt.

A synchronization. Each participant hands one all-reduce (torchft's, over the quorum) its
sample-weighted replica (local SGD: ``n_k theta_k``; DiLoCo: ``n_k (theta_global -
theta_k)``, the pseudo-gradient; float buffers plainly), its count ``n_k``, a mark at its
round rank, its replica id at its quorum rank, and whether it has seen a preemption request
(if one has, all leave after the next round's first step: may_leave). When every
participant commits (``should_commit``), each replaces its replica by the weighted mean
(DiLoCo: the outer Nesterov step on theta_global with the mean pseudo-gradient, then theta_k
= theta_global). A failed all-reduce (a peer died in it) forms a new quorum and tries again
with the same payload. The round ranks nobody marked belong to replicas that died (or fell
behind) during the round: their samples go onto the redo list, which the next round deals
first, so every sample is trained once per epoch. The next step's record names the lost work
(``lost``: [[replica, round], ...]); ``without_lost_work`` leaves those records out of a
count.

Healing and checkpoints. A replica that starts, or fell behind, joins at the next
synchronization: torchft heals it from a peer with the state the peers held just after their
last synchronization (the snapshot: model, optimizers, plan, progress; taken after every
synchronization), it deals the round the peers are finishing (as not one of its members),
hands the synchronization nothing, and leaves it with the same replica, plan and progress as
they. The snapshot is also what a checkpoint holds (the replica of quorum rank 0 writes the
newest snapshot when one is due: between synchronizations the replicas differ, and their
work since the last one is not in any checkpoint) and what --eval-every scores between
synchronizations (the model the replicas last agreed on).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import nn

from scaletrain.data.partition import split_counts
from scaletrain.data.plans import RunEnded, StepPlan
from scaletrain.fault.preempt import preempt_path
from scaletrain.fault.recovery import rng_state
from scaletrain.strategies.base import Batch, LossFn, OptimizerFactory, StepResult
from scaletrain.strategies.inplace import (
    InplaceStrategy,
    QuorumPlan,
    tensor_bytes,
)
from scaletrain.strategies.local_sgd import float_buffers, local_step


def without_lost_work(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records whose work is in the model: those of a replica's round that a
    synchronization found lost (the ``lost`` pairs of later records) left out."""
    lost = {(replica, rnd) for r in records for replica, rnd in r.get("lost", [])}
    return [r for r in records if (r["rank"], r.get("round")) not in lost]


class InplaceRoundsStrategy(InplaceStrategy):
    supports_fp16 = False  # each replica steps alone (as local_sgd and diloco refuse it)
    collective = "none (a local step between synchronizations)"
    plan_collective = "torchft quorum and parameter averaging (a synchronization)"
    plan: RoundPlan

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        super().setup(model, build_optimizer, loss_fn)
        self.outer: torch.optim.Optimizer | None = None
        self.global_params: list[torch.Tensor] = []
        if self.cfg.train.strategy == "diloco":
            comm = self.cfg.comm
            self.global_params = [p.detach().clone() for p in model.parameters()]
            self.outer = torch.optim.SGD(self.global_params, lr=comm.outer_lr,
                                         momentum=comm.outer_momentum,
                                         nesterov=comm.outer_momentum > 0)  # fmt: skip
        self.samples_since_sync = 0
        self.snapshot: dict[str, Any] | None = None
        self.own_part: dict[str, Any] | None = None
        # The last synchronization's all-reduce (seconds, bytes sent, bytes dense): the next
        # step reports it.
        self.sync_cost: tuple[float, int, int] | None = None

    def build_plan(self, dataset: Any) -> RoundPlan:
        self.plan = RoundPlan(self, dataset)
        return self.plan

    def after_heal(self, state: dict[str, Any]) -> None:
        """A peer's state is the snapshot of its last synchronization (``consistent_state``):
        the peers dealt a round after it (a job run's first quorum copies the start state,
        torchft's initial sync: none, and this replica takes its own optimizer back)."""
        self.plan.deal_on_heal = bool(state.get("round_follows"))
        if not self.plan.deal_on_heal and self.own_part is not None:
            self.load_rank_state_dict(self.own_part)

    def take_snapshot(self) -> None:
        """After a synchronization, before the next round is dealt (the plan calls it); with
        this replica's random streams, which a checkpoint of it holds."""
        self.snapshot = {**copy.deepcopy(self._live_state()), "rng": rng_state(),
                         "round_follows": True}  # fmt: skip
        self.own_part = None  # the job run's first synchronization is over

    def consistent_state(self) -> dict[str, Any]:
        return self.snapshot if self.snapshot is not None else super().consistent_state()

    def replica_state(self, held: dict[str, Any]) -> dict[str, Any] | None:
        """Each replica's optimizer state is its own (local SGD averages the models only),
        and so are its random streams. ``held`` is a snapshot: a checkpoint is due only
        after a step, and every step follows a synchronization."""
        return {"rng": held["rng"], "strategy": {"optimizer": held["strategy"]["optimizer"]}}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """This replica's own part of the checkpoint a job run starts from: kept until the
        run's first synchronization, whose quorum copies the primary replica's state to
        every other (torchft's initial sync: for models initialized apart)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.own_part = state

    # -- the state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.outer is not None:
            state["global_params"] = [p.clone() for p in self.global_params]
            state["outer_optimizer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.outer is not None:
            with torch.no_grad():
                for p, saved in zip(self.global_params, state["global_params"], strict=True):
                    p.copy_(saved)
            self.outer.load_state_dict(state["outer_optimizer"])
        self.samples_since_sync = 0

    def memory_bytes(self) -> dict[str, int]:
        """A replica's, DiLoCo's theta_global and outer momentum with the optimizer's, and
        the snapshot of the last synchronization (a copy of all of it)."""
        out = super().memory_bytes()
        if self.outer is not None:
            out["optimizer_bytes"] += tensor_bytes(self.global_params)
            out["optimizer_bytes"] += tensor_bytes(list(self.outer.state_dict()["state"].values()))
        out["snapshot_bytes"] = tensor_bytes(self.snapshot) if self.snapshot is not None else 0
        return out

    # -- a local step -------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        loss, extras = local_step(self, batch)
        compute_s = time.perf_counter() - start
        comm_s, sent, dense = self.sync_cost or (0.0, 0, 0)
        self.sync_cost = None
        return StepResult(
            loss=loss,
            compute_s=compute_s,
            comm_s=comm_s,
            wait_s=comm_s,  # the synchronization before this step blocked
            comm_bytes=sent,
            dense_bytes=dense,
            overlap=0.0,
            extras=extras,
        )

    # -- a synchronization --------------------------------------------------------------------
    def _replica_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [p for p in self.module.parameters()], float_buffers(self.module)

    def sync_payload(self, member: bool) -> tuple[torch.Tensor, float]:
        """What this replica hands the synchronization: its replica (DiLoCo: its
        pseudo-gradient) and float buffers, each times its samples since the last one (0
        when it trained no part of the round), flat; and that weight."""
        params, buffers = self._replica_tensors()
        weight = float(self.samples_since_sync) if member else 0.0
        if self.outer is None:
            parts = [p.detach() for p in params]
        else:
            parts = [g - p.detach() for g, p in zip(self.global_params, params, strict=True)]
        flat = torch.cat([t.reshape(-1).float() for t in [*parts, *buffers]])
        return flat * weight, weight

    def apply_average(self, sums: torch.Tensor, total: float) -> None:
        """The committed synchronization: every participant the same replica again."""
        self.samples_since_sync = 0
        if total <= 0:  # nobody trained since the last one (a job run's first, a join)
            return
        mean = sums / total
        params, buffers = self._replica_tensors()
        replica = params if self.outer is None else self.global_params
        pieces, offset = [], 0
        for t in [*replica, *buffers]:
            pieces.append(mean[offset : offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        with torch.no_grad():
            if self.outer is None:
                for t, value in zip([*params, *buffers], pieces, strict=True):
                    t.copy_(value)
                return
            for g, delta in zip(self.global_params, pieces, strict=False):
                g.grad = delta  # the mean pseudo-gradient
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for g, p in zip(self.global_params, params, strict=True):
                p.copy_(g)
            for t, value in zip(buffers, pieces[len(params) :], strict=True):
                t.copy_(value)

    def may_leave(self) -> bool:
        """Only after a round's first step, and only when the synchronization before it
        found that some participant had seen the request (``leave_agreed``): they all leave
        there, with that synchronization's state (the one step trained after it is lost).
        A replica's own look at the request would not do: one 4x slower ends the round's
        first step after the request came and the others ended it before, and would leave a
        round ahead of them. Leaving mid-round, a replica's round would be lost and redone
        by the others."""
        return self.plan.next == 1 and self.plan.leave_agreed

    def eval_model(self) -> nn.Module:
        """Between synchronizations the replicas differ: the model they last agreed on (the
        snapshot's). Right after one (and at the end), the replica itself."""
        if self.plan.in_sync() or self.snapshot is None:
            return self.module
        model = copy.deepcopy(self.module)
        model.load_state_dict(self.snapshot["strategy"]["model"])
        return model

    def summary_info(self) -> dict[str, Any]:
        return {"recovery": "inplace", "rounds": self.plan.rounds}


class RoundPlan(QuorumPlan):
    """The rounds of local SGD in place (the module's docstring): dealt at each
    synchronization over its quorum, the redo list first."""

    strategy: InplaceRoundsStrategy

    def __init__(self, strategy: InplaceRoundsStrategy, dataset: Any) -> None:
        super().__init__(strategy, dataset)
        self.sync_every = self.cfg.comm.sync_every
        self.rounds = 0  # rounds dealt so far (a round's id: the same on every member)
        self.redo: list[int] = []
        self.round: dict[str, Any] | None = None  # the round being trained
        self.round_rank: int | None = None  # this replica's in it (None: not a member)
        self.next = 0  # steps of the round this replica trained
        # The last synchronization's quorum: its size and replica ids by quorum rank.
        self.members: list[int] = []
        self.deal_on_heal = False
        self.leave_agreed = False  # the last synchronization: a participant saw a preemption

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """At a synchronization (the snapshot) and so in every checkpoint: no round open."""
        return {**super().state_dict(), "rounds": self.rounds, "redo": list(self.redo),
                "members": list(self.members)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds = int(state.get("rounds", 0))
        self.redo = [int(i) for i in state.get("redo", [])]
        self.members = [int(i) for i in state.get("members", [])]
        self.round, self.round_rank, self.next = None, None, 0

    def in_sync(self) -> bool:
        return self.round is None or self.next == 0

    def remaining(self) -> int:
        """Steps of the epoch still to train (the round's, the redo list's, the cursor's)."""
        per_step = self.cfg.train.batch_size * max(len(self.members), 1)
        left = len(self.round["steps"]) - self.next if self.round else 0
        return left + math.ceil(len(self.redo) / per_step) + len(self.sampler)

    def commit(self, plan: StepPlan) -> None:
        self.next += 1

    # -- a step ----------------------------------------------------------------------------
    def next_step(self, progress: Any) -> StepPlan | None:
        member = self.round is not None and self.round_rank is not None
        if member and self.next < len(self.round["steps"]):  # type: ignore[index]
            return self._step_plan(progress, {})  # the round goes on: no quorum
        self._before_quorum()
        extras = self._synchronize(progress)
        self.strategy.take_snapshot()
        if not self._deal(progress, member=True):
            return None  # every sample of the run is trained (or --max-steps reached)
        return self._step_plan(progress, extras)

    def _step_plan(self, progress: Any, extras: dict[str, Any]) -> StepPlan:
        assert self.round is not None and self.round_rank is not None
        ids = self.round["steps"][self.next]
        counts = split_counts(len(ids), self.round["n"])
        lo = sum(counts[: self.round_rank])
        mine = ids[lo : lo + counts[self.round_rank]]
        return StepPlan(
            step=progress.step + 1,
            epoch=self.round["epoch"],
            indices=mine or [ids[0]],  # a stand-in sample, weighted zero
            num_samples=len(mine),
            global_samples=len(ids),
            wait_s=extras.get("quorum_s", 0.0),
            extras={"round": self.round["id"], "participants": self.round["n"], **extras},
        )

    def _deal(self, progress: Any, *, member: bool) -> bool:
        """The next round over the last synchronization's members; False when the run has
        no sample (or step) left."""
        n = len(self.members)
        rank = self.strategy.membership()[1] if member else None  # its quorum rank: round rank
        limit = self.sync_every
        if self.cfg.train.max_steps:
            limit = min(limit, self.cfg.train.max_steps - progress.step)
        sampler = self.sampler
        sampler.resize(n, 0)  # the step's size (the split is the round's own)
        while not self.redo and not len(sampler):  # the epoch is done: the next one
            if sampler.epoch + 1 >= self.cfg.train.epochs:
                return False
            sampler.set_epoch(sampler.epoch + 1)
        if limit <= 0:
            return False
        need = self.cfg.train.batch_size * n
        order = sampler.order()
        steps: list[list[int]] = []
        while len(steps) < limit:
            take, self.redo = self.redo[:need], self.redo[need:]
            bounds = sampler.next_bounds() if len(take) < need else None
            if bounds is not None:
                lo, hi = bounds[0], min(bounds[1], bounds[0] + need - len(take))
                take += [int(i) for i in order[lo:hi]]
                sampler.commit(hi - lo)
            if not take:
                break
            steps.append(take)
        self.rounds += 1
        self.round = {
            "id": self.rounds,
            "n": n,
            "holders": list(self.members),
            "epoch": sampler.epoch,
            "steps": steps,
            "end": {
                "step": progress.step + len(steps),
                "epoch": sampler.epoch,
                "samples_trained": progress.samples_trained + sum(len(s) for s in steps),
            },
        }
        self.round_rank, self.next = rank, 0
        return True

    def _synchronize(self, progress: Any) -> dict[str, Any]:
        """The quorum and the all-reduce that close the round (or open a job run, or let a
        replica join); tried again over a new quorum until every participant commits."""
        strategy, world = self.strategy, self.world
        quorum_s = comm_s = 0.0
        attempts = 0
        while True:
            attempts += 1
            t0 = time.perf_counter()
            strategy.manager.start_quorum()  # heals this replica first if it is behind
            quorum_s += time.perf_counter() - t0
            if self._run_ended():
                raise RunEnded("the other replicas finished the run while this one healed")
            strategy.check_state_held()
            if self.deal_on_heal:  # healed: the round the peers are finishing, dealt as
                self.deal_on_heal = False  # they did (not as one of its members)
                self._deal(progress, member=False)
            n, rank = strategy.membership()
            member = self.round is not None and self.round_rank is not None
            payload, weight = strategy.sync_payload(member)
            slots = torch.zeros(2 + 2 * world, dtype=payload.dtype)
            slots[0] = weight
            slots[-1] = float(preempt_path(strategy.run_dir).exists())
            if member:
                assert self.round_rank is not None
                slots[1 + self.round_rank] = 1.0
            slots[1 + world + rank] = strategy.ctx.rank + 1
            flat = torch.cat([payload, slots])
            t1 = time.perf_counter()
            strategy.manager.allreduce(flat).wait()  # the mean over the n participants
            if strategy.manager.errored() is not None:
                strategy.drop_group()
            committed = strategy.manager.should_commit()
            comm_s += time.perf_counter() - t1
            if committed:
                break
        flat *= n  # the sums
        sums, slots = flat[: payload.numel()], flat[payload.numel() :]
        total = float(slots[0])
        strategy.apply_average(sums, total)
        sent = flat.numel() * flat.element_size()
        strategy.sync_cost = (comm_s, 2 * (n - 1) * sent // n, 2 * (n - 1) * sent // n)
        extras: dict[str, Any] = {"quorum_s": quorum_s, "participants": n, "synced": total > 0}
        if attempts > 1:
            extras["sync_attempts"] = attempts
        extras |= strategy.heal_extras()
        lost = self._close_round(progress, [float(x) for x in slots[1 : 1 + world]])
        if lost:
            extras["lost"] = lost
        self.members = [round(float(x)) - 1 for x in slots[1 + world : 1 + world + n]]
        self.leave_agreed = float(slots[-1]) > 0.5
        return extras

    def _close_round(self, progress: Any, marks: list[float]) -> list[list[int]]:
        """The round ends: the work of the round ranks nobody marked is lost and their samples
        go onto the redo list; every participant's progress is the round's end. Returns the
        lost work as [replica, round] pairs."""
        if self.round is None:
            return []
        r = self.round
        lost: list[list[int]] = []
        lost_samples = 0
        for k in range(r["n"]):
            if marks[k] > 0.5:
                continue
            lost.append([r["holders"][k], r["id"]])
            for ids in r["steps"]:
                counts = split_counts(len(ids), r["n"])
                lo = sum(counts[:k])
                part = ids[lo : lo + counts[k]]
                self.redo += part
                lost_samples += len(part)
        end = dict(r["end"])
        end["samples_trained"] -= lost_samples
        vars(progress).update(end)
        self.round, self.round_rank, self.next = None, None, 0
        return lost
