"""THE training loop, for every mode: plan -> step -> commit -> record -> finish.

It never asks which strategy or mode it runs. What differs is plugged in:

- the *plan* of each step's samples (``strategy.build_plan``: the sampler's plan over the
  data-parallel ranks; in-place recovery's plan re-dealt over each step's quorum; the
  parameter server's leases; data/plans.py);
- the *step* (a ``Strategy``: DDP with comm hooks, FSDP2, pipeline, tensor parallel, local
  SGD, DiLoCo, torchft's quorum and all-reduce, a parameter-server push and pull);
- the *world* (lifecycle.py): whether the processes form one torch.distributed group that
  resumes from checkpoints and gathers its totals to rank 0 (the restart mode), or are
  supervised one by one by the launcher, which aggregates their final totals (in-place
  recovery, parameter-server workers).

Per step it measures data time itself and takes compute/comm/wait from the strategy's
StepResult. Only a step the strategy reports applied (``committed``) advances the plan,
the progress and the checkpoints; its record goes to metrics.jsonl and TensorBoard. After the
last step the strategy finishes (a last synchronization), every process that holds the
final model scores its part of the test split, and the world reports the totals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig
from scaletrain.data.balance import RateMeter, next_shares
from scaletrain.data.plans import RunEnded, StepPlan
from scaletrain.fault.inject import parse_inject
from scaletrain.fault.recoveries import mark_resumed, note_recovery
from scaletrain.fault.recovery import Progress
from scaletrain.lifecycle import FinishReport, FleetWorld, GroupWorld, Preempted, World
from scaletrain.metrics import phases
from scaletrain.metrics.evaluation import score
from scaletrain.metrics.sinks import StepSinks
from scaletrain.metrics.summary import RankTotals, params_sha256, peak_rss_bytes
from scaletrain.metrics.timers import overlap_ratio
from scaletrain.models.checkpointing import apply_activation_checkpointing, checkpoint_types
from scaletrain.runtime import DistContext
from scaletrain.schedule import lr_factor
from scaletrain.strategies import Batch, StepResult, build_strategy
from scaletrain.task import Task, build_optimizer

log = logging.getLogger("scaletrain.trainer")


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, task: Task, run_dir: Path) -> None:
        self.cfg, self.ctx, self.task, self.run_dir = cfg, ctx, task, run_dir
        self.strategy = build_strategy(cfg, ctx)
        if cfg.train.activation_checkpointing:  # before any strategy wraps the model
            types = checkpoint_types(task.model, task.checkpoint_modules)
            log.info("activation checkpointing: %d blocks",
                     apply_activation_checkpointing(task.model, types))  # fmt: skip
        if cfg.train.compile:
            self.strategy.compile_model(task.model)
        self.strategy.setup(
            task.model.to(ctx.device),
            lambda params: build_optimizer(task, params, cfg),
            task.loss_fn,
        )
        self.plan = self.strategy.build_plan(task.train_data)
        # A replica that heals copies this state from a live peer (in-place recovery).
        self.strategy.bind_state(self.heal_state, self.load_heal_state)
        self.world: World = GroupWorld() if ctx.shared_world else FleetWorld()
        self.progress = Progress()
        self.totals = RankTotals(rank=ctx.rank, attempt=ctx.attempt, device=ctx.device.type)
        self.faults = parse_inject(cfg.fault.inject)
        self.checkpoint_s = 0.0
        self.checkpoints = self.world.checkpointing(self)
        self.watchdog = self.world.watchdog(self)
        self.resuming = False
        # In place, a replica's first step (its warm-up: tens of milliseconds) is not metered:
        # it hid a replica 4x slower when a short run had one rate window (the rates ride one
        # step late there). In one group (restart mode) it is: there it is the same on every
        # rank and damps the first window, and left out, a noisy first window of tiny steps
        # twice starved a healthy rank for good (test_balance.py, fresh clones): when a step
        # is mostly fixed per-step cost, a rank's rate follows its share, so a share lowered
        # by noise lowers the rate that decides it.
        self.rates = (RateMeter(skip_first=not ctx.shared_world)
                      if cfg.train.balance == "speed" else None)  # fmt: skip
        self.smoothed_rates: list[float] | None = None

    # -- the training state: what a checkpoint holds and a healing replica copies ---------
    def training_state(self, *, sharded: bool = False) -> dict[str, Any]:
        """The strategy's state (a marker when it is sharded: every rank saves its shards
        with DCP beside the checkpoint) and the plan's."""
        strategy = {"sharded": True} if sharded else self.strategy.state_dict()
        return {
            "strategy": strategy,
            "sampler": self.plan.state_dict(),
            "essentials": self.strategy.essentials_state_dict(),  # fp16's loss scale
        }

    def restore_checkpoint(self, state: dict[str, Any], rank_part: dict[str, Any] | None) -> None:
        self.strategy.load_state_dict(state["strategy"])
        if rank_part is not None:
            self.strategy.load_rank_state_dict(rank_part)
        self.plan.load_state_dict(state["sampler"])
        self.strategy.load_essentials_state_dict(state.get("essentials", {}))

    def heal_state(self) -> dict[str, Any]:
        return {**self.training_state(), "progress": asdict(self.progress)}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """In place: the plan that asked for the quorum holds this progress."""
        self.restore_checkpoint(state, None)
        vars(self.progress).update(vars(Progress(**state["progress"])))
        log.info("healed from a peer at step %d", self.progress.step)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        resumed = self.world.resume(self)
        self.progress = resumed or self.progress
        self.resuming = resumed is not None
        if resumed is not None:
            self.checkpoints.resumed_from(resumed.step)
        self.watchdog.start()
        log.info(
            "training to step %d on %s with %s, world size %d",
            self.plan.total_steps(self.progress), self.ctx.device, self.ctx.backend,
            self.ctx.world_size,
        )  # fmt: skip
        sink = StepSinks(self.run_dir, self.ctx.rank)
        self.start = time.perf_counter()
        try:
            while self._step(sink):
                pass
        except (RunEnded, Preempted) as e:
            log.info("%s", e)
            self.watchdog.stop()
            self.strategy.close()
            return None
        finally:
            sink.close()
        if self.cfg.fault.checkpoints_on:  # the end too: a longer run can go on from it
            self.watchdog.enter(self.progress.step, "writing the last checkpoint", "save")
            self.checkpoint_s += self.checkpoints.save()
        self.checkpoint_s += self.checkpoints.wait()
        self.strategy.finish()
        wall_s = time.perf_counter() - self.start
        step = self.progress.step
        self.watchdog.enter(step, "evaluation", self.strategy.collective_of_model)
        self.evaluate()
        self.watchdog.enter(step, "end of training", "gather of per-rank totals")
        report = FinishReport(checkpoint_s=self.checkpoint_s,
                              checkpointing=self.checkpoints.describe(),
                              steps_per_epoch=self.plan.steps_per_epoch())  # fmt: skip
        summary = self.world.finish(self, self._final(wall_s), report)
        self.watchdog.stop()
        self.strategy.close()
        return summary

    def _step(self, sink: StepSinks) -> bool:
        """One step: False once the plan has none left."""
        # One-shot faults fire in this node's first attempt (its agent's restart count).
        step, rank, restarts = self.progress.step + 1, self.ctx.rank, self.ctx.restart_count
        self.watchdog.enter(step, "starting the step")
        for fault in self.faults:
            fault.before_step(step, rank, restarts)
        t0, cpu0 = time.perf_counter(), time.process_time()
        phases.mark("first_step")  # once: the first step this process begins
        self.watchdog.enter(step, "planning the step", self.strategy.plan_collective)
        plan = self.plan.next_step(self.progress)
        if plan is None:
            return False
        self.watchdog.enter(step, "loading data")
        t1 = time.perf_counter()
        inputs, targets = self.plan.load(plan)
        data_s = time.perf_counter() - t1
        lr = self._set_lr()
        self.watchdog.enter(step, "train step", self.strategy.collective)
        result = self.strategy.train_step(
            Batch(inputs=inputs, targets=targets, num_samples=plan.num_samples,
                  global_samples=plan.global_samples)
        )  # fmt: skip
        self.watchdog.enter(step, "after the train step")
        # A slow-rank fault stretches this rank's step as slower hardware would.
        slowed_s = sum(f.after_step(step, rank, restarts, result.compute_s) for f in self.faults)
        if not result.committed:  # nothing applied: the plan deals these samples again
            log.warning("step %d not applied (a peer failed); dealing it again", plan.step)
            return True
        self.plan.commit(plan)
        self.progress.step += 1
        self.progress.epoch = plan.epoch
        self.progress.samples_trained += plan.global_samples
        checkpoint_s = self.checkpoints.maybe_save()
        self.checkpoint_s += checkpoint_s
        record = self._record(plan, result, (t0, cpu0), data_s, slowed_s, checkpoint_s)
        if lr is not None:
            record["lr"] = lr
        every = self.cfg.train.eval_every
        if every and self.progress.step % every == 0:
            record |= self.evaluate_now()
        if self.rates is not None:
            self._balance(plan, data_s + result.compute_s + slowed_s)
        sink.write(record)
        self.checkpoints.settle()  # a save of this step is on every rank's disk (and record)
        self.totals.add(record)
        if self.resuming:  # the first step after a restart: recovery complete
            self.resuming = False
            mark_resumed(self.progress.recoveries[-1])
            if self.ctx.is_main:
                note_recovery(self.run_dir, self.progress.recoveries[-1])
        if self.world.preempted(self):
            self.watchdog.enter(self.progress.step, "preempted: checkpointing", "save")
            self.checkpoints.save()
            raise Preempted(
                f"preempted after step {self.progress.step}: its checkpoint is written; the "
                "same command continues the job"
            )
        return True

    def _record(
        self,
        plan: StepPlan,
        result: StepResult,
        started: tuple[float, float],
        data_s: float,
        slowed_s: float,
        checkpoint_s: float,
    ) -> dict[str, Any]:
        """The step's line of metrics.jsonl: the contract's keys, then the plan's and the
        strategy's extras. One rank per data-parallel replica reports samples and loss.
        ``started``: the step's wall clock and this process's CPU clock when it began."""
        t0, cpu0 = started
        samples = plan.num_samples if result.samples is None else result.samples
        samples = samples if self.strategy.reports_samples else 0
        compute_s, wait_s = result.compute_s + slowed_s, result.wait_s + plan.wait_s
        overlap = result.overlap
        if overlap is None:
            blocked = result.compute_s + result.wait_s
            overlap = overlap_ratio(result.compute_s, result.comm_s, blocked)
        record = {
            "step": plan.step,
            "epoch": plan.epoch,
            "rank": self.ctx.rank,
            "attempt": self.ctx.attempt,
            "job_run": self.ctx.job_run,
            "samples": samples,
            "global_samples": plan.global_samples,
            # A rank that only held a zero-weight stand-in sample has no loss of its own.
            "loss": result.loss.item() if samples else None,
            "step_s": time.perf_counter() - t0,
            # CPU this process spent in the step (every thread): on hosts whose processes
            # outnumber the cores, this is what the cost model's shared-host term needs.
            "cpu_s": time.process_time() - cpu0,
            "compute_s": compute_s,
            "comm_s": result.comm_s,
            "wait_s": wait_s,
            "data_s": data_s,
            "checkpoint_s": checkpoint_s,
            "overlap": overlap,
            "comm_bytes": result.comm_bytes,
            "dense_bytes": (
                result.comm_bytes if result.dense_bytes is None else result.dense_bytes
            ),
            "time_s": time.perf_counter() - self.start,
            "unix_time": time.time(),
            "total_steps": self.plan.total_steps(self.progress),
            **plan.extras,
            **result.extras,
        }
        if self.cfg.fault.log_sample_ids:
            record["sample_ids"] = plan.indices if samples else []
        return record

    def _balance(self, plan: StepPlan, busy_s: float) -> None:
        """--balance speed: this rank's busy time (loading, computing, not waiting); every
        --balance-every steps the ranks' rates are gathered and the split re-planned."""
        assert self.rates is not None
        self.rates.add(plan.num_samples, busy_s)
        if self.progress.step % self.cfg.train.balance_every:
            return
        rate = self.rates.take()
        if self.plan.offer_rate(rate):
            return  # the plan shares the rates itself (in place: on the step's all-reduce)
        self.watchdog.enter(self.progress.step, "balancing", "all-gather of rates")
        rates = self.world.gather(self, rate)
        shares, self.smoothed_rates = next_shares(self.plan.shares(), rates, self.smoothed_rates)
        if shares is not None:
            log.info("balance: shares %s from rates %s", [round(x, 3) for x in shares],
                     [round(r) for r in rates])  # fmt: skip
            self.plan.set_shares(shares)

    def _set_lr(self) -> float | None:
        """The schedule's learning rate for this update (None where this process steps no
        optimizer: a parameter-server worker; its servers follow the schedule themselves)."""
        if not self.strategy.optimizers():
            return None
        optim = self.cfg.optim
        factor = 1.0
        if optim.lr_schedule != "constant" or optim.warmup_steps:
            total = self.plan.total_steps(self.progress)
            factor = lr_factor(optim.lr_schedule, self.progress.step, total, optim.warmup_steps)
            self.strategy.set_lr(factor)
        return optim.lr * factor

    def evaluate_now(self) -> dict[str, Any]:
        """--eval-every: test accuracy and loss of the weights as they are now, over the
        whole test split (the world adds up the parts: every rank a slice in a group, the
        first replica or worker all of it in a fleet), for this step's record."""
        test, eval_fn = self.task.test_data, self.task.eval_fn
        if test is None or eval_fn is None:
            return {}
        step = self.progress.step
        self.watchdog.enter(step, "evaluation", self.strategy.collective_of_model)
        model = self.strategy.eval_model()  # every rank: a sharded model gathers here
        part = self.world.eval_part(self)
        counts = (0.0, 0.0, 0.0)
        if part is not None:
            counts = score(model, test, eval_fn, self.ctx.device, part,
                           on_batch=lambda: self.watchdog.enter(step, "evaluation"),
                           loss_fn=self.task.loss_fn)  # fmt: skip
        correct, total, loss_sum = self.world.sum_counts(self, counts)
        if total <= 0:
            return {}
        return {"test_accuracy": correct / total, "test_loss": loss_sum / total}

    # -- the finish -------------------------------------------------------------------------
    def evaluate(self) -> None:
        """Score this process's part of the test split (strategy.eval_part(): every rank a
        balanced slice); the counts go into its final totals and are summed over all parts
        where summary.json is written."""
        test, eval_fn = self.task.test_data, self.task.eval_fn
        if test is None or eval_fn is None or not self.strategy.holds_final_model:
            return
        step = self.progress.step
        self.totals.test_correct, self.totals.test_total, _ = score(
            self.strategy.model,
            test,
            eval_fn,
            self.ctx.device,
            self.strategy.eval_part(),
            on_batch=lambda: self.watchdog.enter(step, "evaluation"),
        )

    def _final(self, wall_s: float) -> RankTotals:
        totals = self.totals
        totals.memory = self.strategy.memory_bytes()
        totals.peak_rss_bytes = peak_rss_bytes()
        totals.open_fds = phases.open_fds()
        totals.phases = phases.marks()
        if self.strategy.holds_replica:
            totals.params_sha256 = params_sha256(self.strategy.model)
        totals.step, totals.samples_trained = self.progress.step, self.progress.samples_trained
        totals.wall_s = wall_s
        totals.steps_per_epoch = self.plan.steps_per_epoch()
        if self.cfg.train.compile:  # what torch.compile captured (0: it fell back to eager)
            from torch._dynamo.utils import counters

            totals.compiled_graphs = int(counters["stats"]["unique_graphs"])
        return totals
