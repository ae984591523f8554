"""What the training loop does around its steps that depends on how the job's processes
belong together, plugged into the loop (trainer.py) instead of branched on. A world reads
only what loop.Loop shows of the trainer.

- ``GroupWorld`` (the restart mode, every strategy but ps): the processes form one
  torch.distributed world that torch's elastic agent restarts as a whole. At start every rank
  resumes from the newest valid checkpoint (fault/recovery.py); a watchdog beats in the
  group's store; at the end the ranks' totals are gathered and rank 0 writes summary.json and
  checkpoints/final.pt.
- ``FleetWorld`` (in-place recovery, parameter-server workers): each process is restarted on
  its own by a launcher that watches them (launch/fleet.py); there is no group to resume in
  or to gather over. A restarted replica heals from a live peer instead (its strategy's plan
  does), a parameter-server worker keeps no state; at the end each process writes its totals
  to logs/final/rank<R>.json and the launcher builds summary.json from those with the same
  aggregator (metrics/summary.summarize). In place with --checkpoint-every, one replica
  writes each checkpoint and a job run's first start reads the newest (the job lost every
  replica: killed, or preempted).

The world also says what checkpoints the loop (checkpointing.py) and whether a preemption was
asked for.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.checkpointing import NoCheckpoints
from scaletrain.fault.checkpoint import (
    read_index,
    remove_unfinished,
)
from scaletrain.fault.preempt import preempt_path
from scaletrain.fault.recoveries import run_recoveries
from scaletrain.fault.recovery import Progress, resume
from scaletrain.fault.watchdog import NullWatchdog, SelfWatchdog, Watchdog
from scaletrain.io import atomic_torch_save, atomic_write_json
from scaletrain.loop import Loop
from scaletrain.metrics.summary import RankTotals, SummaryParts, params_sha256, write_summary

log = logging.getLogger("scaletrain.lifecycle")


class Preempted(Exception):
    """The job was asked to stop (a preemption); this process's state is checkpointed."""


def save_final_model(run_dir: Path, model: torch.nn.Module) -> float:
    """checkpoints/final.pt: the plain weights; returns the seconds it took."""
    started = time.perf_counter()
    atomic_torch_save(
        run_dir / "checkpoints" / "final.pt",
        {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}},
    )
    return time.perf_counter() - started


@dataclass(frozen=True, kw_only=True)
class FinishReport:
    """What the loop hands its world at the end, besides the per-rank totals."""

    checkpoint_s: float  # seconds this process blocked on checkpoints
    checkpointing: dict[str, Any]  # the checkpoints' own account (Checkpointing.describe)
    steps_per_epoch: int | None


class World(ABC):
    @abstractmethod
    def watchdog(self, loop: Loop) -> NullWatchdog:
        """What notices a hang (and ends this process) while the loop runs."""

    def checkpointing(self, loop: Loop) -> NoCheckpoints:
        """What saves the training state (a fleet's processes resume no checkpoint of the
        loop's: torchft heals from a peer, ps servers keep their own)."""
        return NoCheckpoints()

    @abstractmethod
    def resume(self, loop: Loop) -> Progress | None:
        """Where this process starts: a checkpoint's progress, or None (from the start)."""

    @abstractmethod
    def finish(self, loop: Loop, final: RankTotals, report: FinishReport) -> dict[str, Any] | None:
        """Report this process's ``final`` totals; summary.json where this process writes it."""

    def preempted(self, loop: Loop) -> bool:
        """Whether the launcher asked the job to stop (SIGTERM, SIGUSR1: launch/preempt.py):
        True on every rank alike, at the same step. Default: never (a fleet's launcher
        stops its processes itself)."""
        return False

    def gather(self, loop: Loop, value: float) -> list[float]:
        """Every rank's ``value`` (--balance speed's rates): a group's only."""
        raise NotImplementedError("only the restart mode's world gathers")

    @abstractmethod
    def eval_part(self, loop: Loop) -> tuple[int, int] | None:
        """The slice of the test split this process scores during training (None: none)."""

    @abstractmethod
    def sum_counts(self, loop: Loop, counts: tuple[float, ...]) -> tuple[float, ...]:
        """The evaluation's counts over every part (a collective where there is a group)."""


class GroupWorld(World):
    def __init__(self) -> None:
        self._checked = False  # whether this process has checked for a preemption yet

    def checkpointing(self, loop: Loop) -> NoCheckpoints:
        from scaletrain.checkpointing import Checkpointing

        return Checkpointing(loop)

    def watchdog(self, loop: Loop) -> NullWatchdog:
        ctx, cfg = loop.ctx, loop.cfg
        return Watchdog(
            rank=ctx.rank,
            world_size=ctx.world_size,
            attempt=ctx.attempt,
            timeout_s=cfg.hang_timeout_s,
            run_dir=loop.run_dir,
        )

    def _all_agree(self, loop: Loop, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], device=loop.ctx.device)
        if loop.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    def eval_part(self, loop: Loop) -> tuple[int, int] | None:
        return loop.strategy.eval_part()

    def preempted(self, loop: Loop) -> bool:
        """Every --preempt-check-every steps the ranks agree (one all-reduce of a flag: some
        rank sees logs/preempt.json, which the launcher writes when it is signalled), so all
        stop after the same step; in between a request waits, which costs no collective.
        Also after the first step of every attempt: a request that came while the workers
        started (or rendezvoused again) stops them after one step, not up to N."""
        every = loop.cfg.fault.preempt_check_every
        first, self._checked = not self._checked, True
        if loop.progress.step % every and not first:
            return False
        asked = preempt_path(loop.run_dir).exists()
        return not self._all_agree(loop, not asked)

    def gather(self, loop: Loop, value: float) -> list[float]:
        """Every rank's ``value``, in rank order (a collective)."""
        mine = torch.tensor([value], dtype=torch.float64, device=loop.ctx.device)
        if loop.ctx.world_size == 1:
            return [value]
        out = [torch.zeros_like(mine) for _ in range(loop.ctx.world_size)]
        dist.all_gather(out, mine)
        return [float(t) for t in out]

    def sum_counts(self, loop: Loop, counts: tuple[float, ...]) -> tuple[float, ...]:
        summed = torch.tensor(counts, dtype=torch.float64, device=loop.ctx.device)
        if loop.ctx.world_size > 1:
            dist.all_reduce(summed)
        return tuple(float(c) for c in summed)

    def check_same_checkpoints(self, loop: Loop) -> None:
        """Every rank must resume from the same checkpoint. Across nodes that needs --out on
        a file system they all share; otherwise node 0 alone would find its checkpoints and
        the ranks would train from different states (or wait in different collectives).
        The same collective checks that every rank labels its records with the same attempt."""
        ctx = loop.ctx
        if ctx.world_size == 1:
            return
        directory = loop.run_dir / "checkpoints"
        index = read_index(directory)
        newest = index[-1]["step"] if index else -1
        bounds = torch.tensor([newest, -newest, ctx.attempt, -ctx.attempt], device=ctx.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if int(bounds[2]) != -int(bounds[3]):  # every record of this world is labelled by it
            raise RuntimeError(
                f"internal failure: rank {ctx.rank} is in attempt {ctx.attempt}, another rank "
                f"in attempt {int(bounds[2])}: the nodes' agents disagree on the rendezvous "
                "round"
            )
        if int(bounds[0]) != -int(bounds[1]):
            raise ValueError(
                f"rank {ctx.rank} sees checkpoints up to step {newest} in {directory}, while "
                f"the ranks' newest range from step {-int(bounds[1])} to {int(bounds[0])} (-1: "
                "none): every node must use the same --out on a shared file system (NFS, "
                "Lustre, a ReadWriteMany volume) to resume across nodes"
            )

    def resume(self, loop: Loop) -> Progress | None:
        self.check_same_checkpoints(loop)
        resumed = resume(
            loop.run_dir / "checkpoints",
            loop.restore_checkpoint,
            data_world_size=loop.strategy.data_world_size,
            rank=loop.ctx.rank,
            math_hash=loop.cfg.math_hash(),
            attempt=loop.ctx.attempt,
            metrics=loop.run_dir / "metrics.jsonl",
            job_run=loop.ctx.job_run,
            attempt_base=loop.ctx.attempt_base,
            all_agree=lambda ok: self._all_agree(loop, ok),
        )
        if loop.ctx.is_main:  # no rank can save before step 1, which needs rank 0
            remove_unfinished(loop.run_dir / "checkpoints")
        return resumed

    def finish(self, loop: Loop, final: RankTotals, report: FinishReport) -> dict[str, Any] | None:
        ctx = loop.ctx
        # To rank 0 only: every rank receiving every rank's totals (all_gather_object) moved
        # W^2 objects, and the finish grew faster than the world (make scale, 8 -> 32).
        gathered: list[RankTotals | None] = [None] * ctx.world_size
        dist.gather_object(final, gathered if ctx.is_main else None, dst=0)
        if not ctx.is_main:
            return None
        model = loop.strategy.model
        checkpoint_s = report.checkpoint_s + save_final_model(loop.run_dir, model)
        progress = loop.progress
        return write_summary(loop.cfg, loop.run_dir, SummaryParts(
            finals=[r for r in gathered if r is not None],
            steps=progress.step,
            samples=progress.samples_trained,
            # Also the restarts whose world failed again before it could checkpoint them.
            recoveries=run_recoveries(loop.run_dir, progress.recoveries),
            checkpoint_s=checkpoint_s,
            params_hash=params_sha256(model),
            wall_s=final.wall_s,
            data_world_size=loop.strategy.data_world_size,
            steps_per_epoch=report.steps_per_epoch,
            backend=ctx.backend,
            extras={"checkpointing": report.checkpointing, **loop.strategy.summary_info()},
        ))  # fmt: skip


class FleetWorld(World):
    def watchdog(self, loop: Loop) -> NullWatchdog:
        """Each process watches itself: a stuck replica ends, is restarted and heals; a stuck
        parameter-server worker ends, is restarted, and the servers deal its leases to the
        others (they drop a silent one from a bsp barrier on their own too)."""
        return SelfWatchdog(rank=loop.ctx.rank, timeout_s=loop.cfg.hang_timeout_s)

    def checkpointing(self, loop: Loop) -> NoCheckpoints:
        """In place, with --checkpoint-every: one replica writes each (ReplicaCheckpointing);
        a parameter server's workers keep none (the servers checkpoint their partitions)."""
        if self._in_place(loop) and loop.cfg.fault.checkpoints_on:
            from scaletrain.checkpointing import ReplicaCheckpointing

            return ReplicaCheckpointing(loop)
        return NoCheckpoints()

    def _in_place(self, loop: Loop) -> bool:
        return loop.cfg.fault.recovery == "inplace" and loop.cfg.train.strategy != "ps"

    def resume(self, loop: Loop) -> Progress | None:
        """In place, a replica's first start in a job run reads the newest checkpoint, if the
        job has one: the same command after every replica was lost (the job killed or
        preempted) continues from it. Every replica reads the same one, so the first quorum
        finds them at the same step. A replica restarted during the run reads none: it heals
        from a live peer (torchft), which is ahead of any checkpoint."""
        ctx = loop.ctx
        if not self._in_place(loop) or ctx.attempt != 0:
            return None
        # A replica group's ranks read the shard files of their rank in the group, and take
        # a checkpoint only when every one of them can (ReplicaCheckpointing).
        group = loop.strategy.replica_group()
        resumed = resume(
            loop.run_dir / "checkpoints",
            loop.restore_checkpoint,
            data_world_size=ctx.world_size,
            rank=ctx.rank,
            own_rank=ctx.rank if group is None else group.rank,
            math_hash=loop.cfg.math_hash(),
            attempt=0,
            metrics=loop.run_dir / "metrics.jsonl",
            job_run=ctx.job_run,
            all_agree=(lambda ok: ok) if group is None else group.agree,
        )
        if resumed is not None:
            loop.strategy.resumed_at(resumed.step)
        return resumed

    def preempted(self, loop: Loop) -> bool:
        """In place with checkpoints: the launcher asked (fleet_stopper). Each replica looks
        after each of its steps; those that look after the same step leave together, one
        that saw it a step later trains that step without them and leaves after it, so the
        last step's quorum rank 0 always leaves at it and checkpoints it. Local SGD and
        DiLoCo leave only together, as their synchronization agreed (may_leave). A
        parameter server's worker leaves after its step, when it sees the request."""
        if loop.strategy.leaves_when_asked:
            return preempt_path(loop.run_dir).exists()
        if not (self._in_place(loop) and loop.cfg.fault.checkpoints_on):
            return False
        if not loop.strategy.may_leave():
            return False
        asked = preempt_path(loop.run_dir).exists()
        # The ranks of a replica group leave together (one that left alone would leave its
        # mates in the step's collectives): when any of them saw the request.
        group = loop.strategy.replica_group()
        return asked if group is None else not group.agree(not asked)

    def eval_part(self, loop: Loop) -> tuple[int, int] | None:
        """No group to add parts over: the first process (quorum rank 0 of a torchft step,
        worker 0 of a parameter server) scores the whole split, the others none."""
        return (0, 1) if loop.strategy.eval_part()[0] == 0 else None

    def sum_counts(self, loop: Loop, counts: tuple[float, ...]) -> tuple[float, ...]:
        return counts

    def finish(self, loop: Loop, final: RankTotals, report: FinishReport) -> dict[str, Any] | None:
        strategy = loop.strategy
        if strategy.holds_final_model and strategy.eval_part()[0] == 0:
            save_final_model(loop.run_dir, strategy.model)
        final.checkpointing, final.checkpoint_s = report.checkpointing, report.checkpoint_s
        atomic_write_json(final_path(loop.run_dir, loop.ctx.rank), asdict(final))
        return None


def final_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / "final" / f"rank{rank}.json"


def read_finals(run_dir: Path) -> list[RankTotals]:
    """The final totals the processes of a fleet wrote (FleetWorld.finish), by rank."""
    finals = [
        RankTotals(**json.loads(path.read_text()))
        for path in (run_dir / "logs" / "final").glob("rank*.json")
    ]
    return sorted(finals, key=lambda f: f.rank)
