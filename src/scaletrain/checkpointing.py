"""The loop's checkpoints (the restart mode's, GroupWorld.checkpointing; in place, one
replica's: ReplicaCheckpointing, FleetWorld.checkpointing): after every N-th
applied step (--checkpoint-every N), at the interval that loses least (--checkpoint-every
auto with --mtbf-s: fault/interval.py, from the measured save cost and step time, agreed
over the ranks), and when asked: at a preemption and after the last step.

Rank 0 writes the checkpoint (or, for sharded state, every rank its shards through DCP);
every rank writes its own RNG states and per-rank strategy state beside it. After a synchronous
save (and, for a periodic one, the step's record) the ranks settle: none starts the next step
before all of it is on disk. summary.json's
``checkpointing`` says what was chosen and what it cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from scaletrain.fault.checkpoint import (
    AsyncCheckpointer,
    prune_rng_files,
    publish_dir,
    rng_path,
    save_checkpoint,
    save_rank_state,
    snapshot,
)
from scaletrain.fault.interval import interval_steps, optimal_interval_s, predicted_overhead
from scaletrain.fault.recovery import Progress, checkpoint_state, rng_state
from scaletrain.loop import Loop

if TYPE_CHECKING:
    from scaletrain.strategies.inplace import InplaceStrategy

# Under auto, the first save comes after this many steps (its cost is measured there).
AUTO_FIRST_STEPS = 10


class NoCheckpoints:
    """Where the loop keeps no checkpoints of its own."""

    def describe(self) -> dict[str, Any]:
        return {"mode": "none"}

    def maybe_save(self) -> float:
        return 0.0

    def save(self, *, background: bool = False) -> float:
        return 0.0

    def wait(self) -> float:
        return 0.0

    def settle(self) -> None:
        return None

    def resumed_from(self, step: int) -> None:
        """The loop began from the checkpoint of ``step``."""


class Checkpointing(NoCheckpoints):
    """Saves after every N-th applied step, or at the interval auto chose, and when asked
    (``save``: synchronous unless ``background``)."""

    def __init__(self, trainer: Loop) -> None:
        self.trainer = trainer
        fault = trainer.cfg.fault
        self.every, self.auto, self.mtbf_s = (
            fault.checkpoint_interval,
            fault.checkpoint_auto,
            fault.mtbf_s,
        )
        self.writer = AsyncCheckpointer() if fault.checkpoint_async else None
        self.saved_step = -1
        # auto: the step of the next save. Set at the first step this process trains: the
        # loop builds its checkpointer before it resumes, when the progress is still 0.
        self.next_step: int | None = None
        self.costs: list[float] = []  # seconds each periodic save blocked this rank
        self.step_times: list[float] = []  # seconds between steps, saves left out
        self._last: float | None = None
        self._blocked = 0.0
        self._unsettled = False  # a synchronous save whose ranks have not agreed yet (settle)
        self.wrote = True  # whether the last save wrote here (writes_this_step)
        self.plan: dict[str, Any] = {}

    def maybe_save(self) -> float:
        """After every applied step: save if one is due; the seconds this rank was blocked."""
        now = time.perf_counter()
        if self._last is not None:
            self.step_times.append(now - self._last - self._blocked)
        self._blocked = 0.0
        step = self.trainer.progress.step
        if self.next_step is None:  # the first step of this process (after any resume)
            self.next_step = step - 1 + AUTO_FIRST_STEPS
        due = step >= self.next_step if self.auto else bool(self.every) and step % self.every == 0
        if due:
            self._blocked = self.save(background=self.writer is not None, periodic=True)
            if self.wrote:
                self.costs.append(self._blocked)
            if self.auto:
                self._plan_next()
        self._last = time.perf_counter()
        return self._blocked

    def _plan_next(self) -> None:
        """The next save's step, from the costs measured so far: the same on every rank (the
        larger of the ranks' medians), so all save at the same steps."""
        t = self.trainer
        if not self.step_times or not self.costs:  # measure some first
            self.next_step = t.progress.step + AUTO_FIRST_STEPS
            return
        measured = torch.tensor(
            [statistics.median(self.costs), statistics.median(self.step_times[-50:])],
            dtype=torch.float64,
        )
        cost_s, step_s = (float(x) for x in self.agreed_max(measured))
        steps = interval_steps(cost_s, step_s, self.mtbf_s)
        self.next_step = t.progress.step + steps
        self.plan = {"cost_s": cost_s, "step_s": step_s, "interval_steps": steps}

    def agreed_max(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of every rank's ``values`` (a collective of the group)."""
        if self.trainer.ctx.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values

    def describe(self) -> dict[str, Any]:
        """summary.json's ``checkpointing``: the interval and what it costs."""
        cost_s = statistics.median(self.costs) if self.costs else None
        step_s = statistics.median(self.step_times) if self.step_times else None
        if self.auto and self.plan:  # what the last interval was chosen from
            cost_s, step_s = self.plan["cost_s"], self.plan["step_s"]
        steps = self.plan.get("interval_steps") if self.auto else (self.every or None)
        out: dict[str, Any] = {
            "mode": "auto" if self.auto else ("every" if self.every else "none"),
            "interval_steps": steps,
            "saves": len(self.costs),
            "cost_s": cost_s,
            "step_s": step_s,
            "mtbf_s": self.mtbf_s or None,
        }
        if steps and step_s and cost_s is not None and self.mtbf_s:
            interval_s = steps * step_s
            out["interval_s"] = interval_s
            out["predicted_overhead"] = predicted_overhead(cost_s, interval_s, self.mtbf_s)
            out["optimal_interval_s"] = optimal_interval_s(cost_s, self.mtbf_s)
        return out

    def resumed_from(self, step: int) -> None:
        """That checkpoint is on disk: a save of the same step (the final one, when the job
        had nothing left to train) is not due, and in place could not be made (no quorum
        formed to say which replica writes it)."""
        self.saved_step = step

    def save(self, *, background: bool = False, periodic: bool = False) -> float:
        """Save the state after the current step (every rank calls it); the seconds blocked.
        ``periodic``: maybe_save's, whose step record is still to be written: the loop calls
        settle after writing it (otherwise save settles before it returns)."""
        t = self.trainer
        if self.saved_step == t.progress.step:
            # Saved already, maybe in the background: a synchronous save (a preemption's)
            # returns only once it is on disk, or the process could end before its write.
            return 0.0 if background else self.wait()
        self.saved_step = t.progress.step
        self.wrote = self.writes_this_step()
        if not self.wrote:
            return 0.0
        # A synchronous save waits for a background write in flight: they land in order.
        blocked = 0.0 if background else self.wait()
        started = time.perf_counter()
        write = self.prepare(background=background)
        if background and self.writer is not None:
            self.writer.submit(write)
        else:
            write()
            self._unsettled = True
            if not periodic:
                self.settle()
        return blocked + time.perf_counter() - started

    def writes_this_step(self) -> bool:
        """Whether this process writes the current step's checkpoint (here every rank writes
        its part of it)."""
        return True

    def prepare(self, *, background: bool) -> Callable[[], None]:
        """Gather what the current step's checkpoint holds (the collective part, sharded state,
        now) and return what writes it to disk (now, or in the background: then from copies)."""
        t = self.trainer
        step, rank, main = t.progress.step, t.ctx.rank, t.ctx.is_main
        strategy = t.strategy
        collective = strategy.collective_state_dict  # sharded state: every rank saves
        t.watchdog.enter(step, "writing a checkpoint", "sharded save" if collective else "")
        directory, keep = t.run_dir / "checkpoints", t.cfg.fault.keep_checkpoints
        rng = rng_state()
        own = {"rng": rng, "strategy": strategy.rank_state_dict()}
        shards = None
        if collective:  # every rank writes its shards (synchronously: it is a collective)
            name = f"step-{step:08d}.dcp"
            tmp = directory / f".{name}.attempt{t.ctx.restart_count}.tmp"
            strategy.save_sharded(tmp)
            if main:
                shards = {"dir": name, "sha256": publish_dir(tmp, directory / name)}
        state = None
        if main:
            training = t.training_state(sharded=collective)
            state = checkpoint_state(training, t.progress, t.cfg.hash(), [rng], t.ctx.world_size,
                                     math_hash=t.cfg.math_hash())  # fmt: skip
        if background:
            own, state = snapshot(own), snapshot(state)

        def write() -> None:
            own_path = rng_path(directory, step, rank)
            save_rank_state(own_path, own)
            for fault in t.faults:
                fault.after_rank_state(step, rank, own_path, t.ctx.restart_count)
            if main and state is not None:
                path = save_checkpoint(directory, step, state, keep, shards=shards)
                prune_rng_files(directory)
                for fault in t.faults:
                    fault.after_checkpoint(step, path, t.ctx.restart_count)

        return write

    def settle(self) -> None:
        """After a synchronous save, once this rank has written the step's record: wait until
        every rank has, rank 0's checkpoint included, so no rank starts the next step before.
        Otherwise a rank with only its small RNG file to write could go on and die while
        rank 0 still wrote, and the agent stopped rank 0 before the checkpoint every survivor
        had passed was there (the restart went back one checkpoint further). After the record,
        not before: a world that breaks here resumes from this checkpoint, and the step's
        records (its sample ids) must exist. One all-reduce of one number per save."""
        t = self.trainer
        if self._unsettled and t.ctx.world_size > 1:
            t.watchdog.enter(t.progress.step, "checkpoint written: waiting for every rank",
                             "all-reduce")  # fmt: skip
            dist.all_reduce(torch.zeros(1, device=t.ctx.device))
        self._unsettled = False

    def wait(self) -> float:
        """Block until a background write is on disk; the seconds that took."""
        if self.writer is None:
            return 0.0
        started = time.perf_counter()
        self.writer.wait()
        return time.perf_counter() - started


class ReplicaCheckpointing(Checkpointing):
    """In-place recovery's checkpoints (FleetWorld.checkpointing): the state every replica
    holds alike (after a committed step; local SGD's, the last synchronization's: the
    strategy's ``consistent_state``) is written once, by the replica of quorum rank 0, and the
    others go on without waiting (there is no group to settle over). They are for losing
    every replica at once: a replica that dies alone heals from a live peer, and the job reads
    a checkpoint only when the same command starts it again (FleetWorld.resume). The writer's
    RNG states go into the checkpoint; what differs between replicas (local SGD's optimizer
    states: ``replica_state``) each replica writes beside it, and one whose file is missing
    continues from the writer's. Under ``auto`` each replica plans from its own
    measurements (the writer's are those of the saves).

    A replica of several processes (in-place HSDP's group: ``replica_group``) writes it as
    a group: each rank its shards in the file of its rank in the group (so rank i of any
    group reads shard i back), and the group's rank 0 the shared part, which it publishes
    only once every shard file is on disk (``await_shards``: through the group's store, not
    a collective, so that a background write does not run one beside training's). A shard
    file missing at resume makes the checkpoint unusable (it names the group's size), and
    the group's ranks agree on the checkpoint, the interval and the step they leave at."""

    written_step = -1  # the step of the last state written (local SGD's can repeat)

    def writes_this_step(self) -> bool:
        t = self.trainer
        strategy = cast("InplaceStrategy", t.strategy)
        self._main = strategy.eval_part()[0] == 0  # quorum rank 0 of this step
        self._state = strategy.consistent_state()
        self._own = strategy.replica_state(self._state)
        if not self._main and self._own is None:
            return False
        step = int(self._state["progress"]["step"])  # 0: a local-SGD job before any round
        return step > 0 and step != self.written_step

    def prepare(self, *, background: bool) -> Callable[[], None]:
        t, held, own, main = self.trainer, self._state, self._own, self._main
        group = t.strategy.replica_group()
        progress = Progress(**held["progress"])
        step = self.written_step = progress.step
        t.watchdog.enter(step, "writing a checkpoint", "")
        directory, keep = t.run_dir / "checkpoints", t.cfg.fault.keep_checkpoints
        training = {key: held[key] for key in ("strategy", "sampler", "essentials")}
        own_rank, required = t.ctx.rank, 0  # 0: a replica's own file may be missing
        if group is not None:  # the shards are in the group's files; each one required
            training["strategy"] = {"shards": group.size}
            own_rank, required = group.rank, group.size
        rng = held.get("rng") or rng_state()
        state = checkpoint_state(training, progress, t.cfg.hash(), [rng], required,
                                 math_hash=t.cfg.math_hash())  # fmt: skip
        if background:  # ``own`` is a copy already (replica_state's)
            state = snapshot(state)

        def write() -> None:
            if own is not None:
                save_rank_state(rng_path(directory, step, own_rank), own)
                if group is not None:
                    group.shard_written(step)
            if main:
                if group is not None:
                    group.await_shards(step)
                path = save_checkpoint(directory, step, state, keep)
                prune_rng_files(directory)
                for fault in t.faults:
                    fault.after_checkpoint(step, path, t.ctx.restart_count)

        return write

    def agreed_max(self, values: torch.Tensor) -> torch.Tensor:
        """Each replica plans its own; the ranks of a replica group together."""
        group = self.trainer.strategy.replica_group()
        return values if group is None else group.max(values)

    def settle(self) -> None:
        return None
