"""THE training loop: data -> strategy.train_step -> metrics -> (checkpoint) -> summary.

It never asks which strategy is active. Per step it measures data time itself and takes
compute/comm/wait from the strategy's StepResult; after the last step it evaluates on the
test split (every rank a balanced slice, counts summed), gathers per-rank totals to rank 0,
and rank 0 writes summary.json and checkpoints/final.pt. With --checkpoint-every N, rank 0
saves a checkpoint after every N-th applied step, and a restarted worker group resumes from
the newest valid one (fault/recovery.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset

from scaletrain import __version__
from scaletrain.config import RunConfig
from scaletrain.data.datasets import ImageDataset, collate_batch
from scaletrain.data.partition import rank_slice, split_counts
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.fault.checkpoint import (
    AsyncCheckpointer,
    atomic_torch_save,
    atomic_write_json,
    prune_rng_files,
    publish_dir,
    read_index,
    remove_unfinished,
    rng_path,
    save_checkpoint,
    save_rank_state,
    snapshot,
)
from scaletrain.fault.inject import parse_inject
from scaletrain.fault.recovery import (
    Progress,
    checkpoint_state,
    mark_resumed,
    note_recovery,
    resume,
    rng_state,
    run_recoveries,
)
from scaletrain.fault.watchdog import Watchdog
from scaletrain.metrics.sinks import StepSinks
from scaletrain.metrics.summary import RankTotals, build_summary, params_sha256, peak_rss_bytes
from scaletrain.metrics.timers import overlap_ratio
from scaletrain.runtime import DistContext
from scaletrain.strategies import Batch, build_strategy
from scaletrain.task import Task, build_optimizer

log = logging.getLogger("scaletrain.trainer")


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def make_loader(dataset: Dataset[Any], *, cuda: bool, **kwargs: Any) -> DataLoader[Any]:
    # Built-in datasets return whole batches from __getitems__; user datasets get torch's collate.
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    if isinstance(base, ImageDataset):
        kwargs["collate_fn"] = collate_batch
    # Its own generator: iter(DataLoader) draws a base seed, which would otherwise come from
    # the global RNG, so a run resumed mid-epoch (one extra iter) would shift every random
    # stream (dropout masks) against the uninterrupted run.
    return DataLoader(dataset, pin_memory=cuda, generator=torch.Generator(), **kwargs)


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, task: Task, run_dir: Path) -> None:
        self.cfg, self.ctx, self.task, self.run_dir = cfg, ctx, task, run_dir
        self.strategy = build_strategy(cfg.train.strategy, ctx, cfg)
        self.strategy.setup(
            task.model.to(ctx.device),
            lambda params: build_optimizer(task, params, cfg),
            task.loss_fn,
        )
        # Data-parallel position: pipeline stages and tensor-parallel peers share a batch.
        self.data_rank = self.strategy.data_rank
        self.data_world_size = self.strategy.data_world_size
        self.sampler = GlobalBatchSampler(
            len(task.train_data),  # type: ignore[arg-type]
            world_size=self.data_world_size,
            rank=self.data_rank,
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            drop_last=cfg.train.drop_last,
            shard_sizes=getattr(task.train_data, "shard_sizes", None),
        )
        self.loader = make_loader(
            task.train_data, cuda=ctx.device.type == "cuda", batch_sampler=self.sampler
        )
        self.totals = RankTotals(rank=ctx.rank)
        self.progress = Progress()
        self.faults = parse_inject(cfg.fault.inject)
        self.checkpoint_s = 0.0
        self.checkpointer = AsyncCheckpointer() if cfg.fault.checkpoint_async else None
        self.watchdog = Watchdog(
            rank=ctx.rank,
            world_size=ctx.world_size,
            attempt=ctx.attempt,
            timeout_s=cfg.fault.hang_timeout_s or cfg.launch.timeout_s / 2,
            run_dir=run_dir,
        )

    def check_same_checkpoints(self) -> None:
        """Every rank must resume from the same checkpoint. Across nodes that needs --out on
        a file system they all share; otherwise node 0 alone would find its checkpoints and
        the ranks would train from different states (or wait in different collectives).
        The same collective checks that every rank labels its records with the same attempt."""
        if self.ctx.world_size == 1:
            return
        index = read_index(self.run_dir / "checkpoints")
        newest = index[-1]["step"] if index else -1
        attempt = self.ctx.attempt
        bounds = torch.tensor([newest, -newest, attempt, -attempt], device=self.ctx.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if int(bounds[2]) != -int(bounds[3]):  # every record of this world is labelled by it
            raise RuntimeError(
                f"internal failure: rank {self.ctx.rank} is in attempt {attempt}, another rank "
                f"in attempt {int(bounds[2])}: the nodes' agents disagree on the rendezvous "
                "round"
            )
        if int(bounds[0]) != -int(bounds[1]):
            raise ValueError(
                f"rank {self.ctx.rank} sees checkpoints up to step {newest} in "
                f"{self.run_dir / 'checkpoints'} (-1: none), another rank up to step "
                f"{int(bounds[0])}: every node must use the same --out on a shared file system "
                "(NFS, Lustre, a ReadWriteMany volume) to resume across nodes"
            )

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    def fit(self) -> dict[str, Any] | None:
        self.check_same_checkpoints()
        resumed = resume(
            self.run_dir / "checkpoints",
            self.strategy,
            self.sampler,
            rank=self.ctx.rank,
            config_hash=self.cfg.hash(),
            attempt=self.ctx.attempt,
            metrics=self.run_dir / "metrics.jsonl",
            all_agree=self._all_agree,
        )
        self.progress = resumed or self.progress
        self.resuming = resumed is not None
        if self.ctx.is_main:  # no rank can save before step 1, which needs rank 0
            remove_unfinished(self.run_dir / "checkpoints")
        self.total_steps = self._total_steps()
        self.watchdog.start()
        log.info(
            "training to step %d on %s with %s, world size %d",
            self.total_steps, self.ctx.device, self.ctx.backend, self.ctx.world_size,
        )  # fmt: skip
        sink = StepSinks(self.run_dir, self.ctx.rank)
        start = time.perf_counter()
        try:
            for epoch in range(self.progress.epoch, self.cfg.train.epochs):
                self.progress.epoch = epoch
                self.sampler.set_epoch(epoch)
                self._run_epoch(start, sink)
                if self.progress.step >= self.total_steps:
                    break
        finally:
            sink.close()
        if self.checkpointer is not None:
            started = time.perf_counter()
            self.checkpointer.wait()
            self.checkpoint_s += time.perf_counter() - started
        self.strategy.finish()
        wall_s = time.perf_counter() - start
        self.watchdog.enter(self.progress.step, "evaluation", "evaluation all-reduce")
        accuracy = self.evaluate()
        self.watchdog.enter(self.progress.step, "end of training", "gather of per-rank totals")
        summary = self._finish(wall_s, accuracy)
        self.watchdog.stop()
        return summary

    def _total_steps(self) -> int:
        """Steps this run ends at: the rest of the current epoch under this world size, then
        whole epochs, capped by --max-steps. The sampler is already at progress.epoch: both
        start at 0, and a checkpoint restores them together."""
        later = self.cfg.train.epochs - self.progress.epoch - 1
        steps = self.progress.step + len(self.sampler) + later * self.sampler.steps_per_epoch()
        return min(steps, self.cfg.train.max_steps) if self.cfg.train.max_steps else steps

    def _run_epoch(self, start: float, sink: StepSinks) -> None:
        bounds = self.sampler.bounds()
        order = self.sampler.order() if self.cfg.fault.log_sample_ids else None
        batches = iter(self.loader)
        for step_start, step_end in bounds:
            if self.progress.step >= self.total_steps:
                break
            # One-shot faults fire in this node's first attempt (its agent's restart count).
            step, restarts = self.progress.step + 1, self.ctx.restart_count
            self.watchdog.enter(step, "starting the step")
            for fault in self.faults:
                fault.before_step(step, self.ctx.rank, restarts)
            self.watchdog.enter(step, "loading data")
            t0 = time.perf_counter()
            inputs, targets = to_device(next(batches), self.ctx.device)
            data_s = time.perf_counter() - t0
            global_samples = step_end - step_start
            share = split_counts(global_samples, self.data_world_size)[self.data_rank]
            self.watchdog.enter(step, "train step", self.strategy.collective)
            result = self.strategy.train_step(
                Batch(
                    inputs=inputs,
                    targets=targets,
                    num_samples=share,
                    global_samples=global_samples,
                )
            )
            self.watchdog.enter(step, "after the train step")
            # A slow-rank fault stretches this rank's step as slower hardware would.
            slowed_s = sum(f.after_step(step, self.ctx.rank, restarts, result.compute_s)
                           for f in self.faults)  # fmt: skip
            # The step is applied: only now do its samples count as consumed.
            self.sampler.commit(global_samples)
            self.progress.step += 1
            self.progress.samples_trained += global_samples
            checkpoint_s = self._maybe_checkpoint()
            # One rank per data-parallel replica reports its samples and loss.
            samples = share if self.strategy.reports_samples else 0
            record = {
                "step": self.progress.step,
                "epoch": self.progress.epoch,
                "rank": self.ctx.rank,
                "attempt": self.ctx.attempt,
                "samples": samples,
                "global_samples": global_samples,
                # A rank that only held a zero-weight stand-in sample has no loss of its own.
                "loss": result.loss.item() if samples else None,
                "step_s": time.perf_counter() - t0,
                "compute_s": result.compute_s + slowed_s,
                "comm_s": result.comm_s,
                "wait_s": result.wait_s,
                "data_s": data_s,
                "checkpoint_s": checkpoint_s,
                "overlap": overlap_ratio(
                    result.compute_s, result.comm_s, result.compute_s + result.wait_s
                ),
                "comm_bytes": result.comm_bytes,
                "dense_bytes": (
                    result.comm_bytes if result.dense_bytes is None else result.dense_bytes
                ),
                "time_s": time.perf_counter() - start,
                "unix_time": time.time(),
                "total_steps": self.total_steps,
                **result.extras,
            }
            if order is not None:
                lo, hi = rank_slice(step_start, step_end, self.data_world_size, self.data_rank)
                record["sample_ids"] = order[lo:hi].tolist() if samples else []
            sink.write(record)
            self.totals.add(record)
            if self.resuming:  # the first step after a restart: recovery complete
                self.resuming = False
                mark_resumed(self.progress)
                if self.ctx.is_main:
                    note_recovery(self.run_dir, self.progress.recoveries[-1])

    def _maybe_checkpoint(self) -> float:
        """Save if this step is due; returns the seconds this rank's step was blocked. Rank 0
        writes the checkpoint; every rank writes its own RNG states beside it."""
        every = self.cfg.fault.checkpoint_every
        if not every or self.progress.step % every:
            return 0.0
        step, rank, main = self.progress.step, self.ctx.rank, self.ctx.is_main
        collective = self.strategy.collective_state_dict  # sharded state: every rank saves
        self.watchdog.enter(step, "writing a checkpoint", "sharded save" if collective else "")
        started = time.perf_counter()
        directory, keep = self.run_dir / "checkpoints", self.cfg.fault.keep_checkpoints
        rng = rng_state()
        own = {"rng": rng, "strategy": self.strategy.rank_state_dict()}
        shards = None
        if collective:  # every rank writes its shards (synchronously: it is a collective)
            name = f"step-{step:08d}.dcp"
            tmp = directory / f".{name}.attempt{self.ctx.restart_count}.tmp"
            self.strategy.save_sharded(tmp)
            if main:
                shards = {"dir": name, "sha256": publish_dir(tmp, directory / name)}
        state = None
        if main:
            state = checkpoint_state(
                self.strategy, self.sampler, self.progress, self.cfg.hash(), [rng],
                strategy_state={"sharded": True} if collective else None,
            )  # fmt: skip
        if self.checkpointer is not None:
            own, state = snapshot(own), snapshot(state)

        def write() -> None:
            own_path = rng_path(directory, step, rank)
            save_rank_state(own_path, own)
            for fault in self.faults:
                fault.after_rank_state(step, rank, own_path, self.ctx.restart_count)
            if main and state is not None:
                path = save_checkpoint(directory, step, state, keep, shards=shards)
                prune_rng_files(directory)
                for fault in self.faults:
                    fault.after_checkpoint(step, path, self.ctx.restart_count)

        if self.checkpointer is not None:
            self.checkpointer.submit(write)
        else:
            write()
        blocked = time.perf_counter() - started
        self.checkpoint_s += blocked
        return blocked

    @torch.no_grad()
    def evaluate(self) -> float | None:
        test, eval_fn = self.task.test_data, self.task.eval_fn
        if test is None or eval_fn is None:
            return None
        model = self.strategy.model
        was_training = model.training
        model.eval()
        lo, hi = rank_slice(0, len(test), self.ctx.world_size, self.ctx.rank)  # type: ignore[arg-type]
        loader = make_loader(
            Subset(test, range(lo, hi)), cuda=self.ctx.device.type == "cuda", batch_size=512
        )
        correct = total = 0
        for inputs, targets in loader:
            # A fresh mark per batch: a long evaluation is progress, not a hang.
            self.watchdog.enter(self.progress.step, "evaluation", "evaluation all-reduce")
            c, t = eval_fn(
                model(to_device(inputs, self.ctx.device)), to_device(targets, self.ctx.device)
            )
            correct, total = correct + c, total + t
        model.train(was_training)
        counts = torch.tensor([correct, total], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(counts)
        return float(counts[0] / counts[1]) if counts[1] > 0 else None

    def _finish(self, wall_s: float, accuracy: float | None) -> dict[str, Any] | None:
        self.totals.memory = self.strategy.memory_bytes()
        self.totals.peak_rss_bytes = peak_rss_bytes()
        if self.strategy.holds_replica:
            self.totals.params_sha256 = params_sha256(self.strategy.model)
        gathered: list[RankTotals | None] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, self.totals)
        if not self.ctx.is_main:
            return None
        model = self.strategy.model
        started = time.perf_counter()
        atomic_torch_save(
            self.run_dir / "checkpoints" / "final.pt",
            {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}},
        )
        checkpoint_s = self.checkpoint_s + time.perf_counter() - started
        # Also the restarts whose world failed again before it could checkpoint them.
        self.progress.recoveries = run_recoveries(self.run_dir, self.progress.recoveries)
        summary = build_summary(
            [r for r in gathered if r is not None],
            wall_s=wall_s,
            checkpoint_s=checkpoint_s,
            progress=self.progress,
            test_accuracy=accuracy,
            params_hash=params_sha256(model),
            info={
                "strategy": self.cfg.train.strategy,
                "backend": self.ctx.backend,
                "device": self.ctx.device.type,
                "batch_size_per_worker": self.cfg.train.batch_size,
                "global_batch_size": self.cfg.train.batch_size * self.data_world_size,
                **self.strategy.summary_info(),
                "epochs": self.cfg.train.epochs,
                "steps_per_epoch": self.sampler.steps_per_epoch(),
                "config_hash": self.cfg.hash(),
                "scaletrain_version": __version__,
                "torch_version": torch.__version__,
            },
        )
        atomic_write_json(self.run_dir / "summary.json", summary)
        return summary
