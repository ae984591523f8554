"""Run configuration: a tree of small dataclasses, read from and written to TOML.

Every leaf field is also a command-line flag (``train.batch_size`` -> ``--batch-size``),
so leaf names are unique across sections. Validation happens in ``__post_init__`` and
raises ``ValueError`` naming the field. Names and specs that live in registries (strategy,
dataset, model, optimizer, compressor, fault) are checked by the launcher before any process
starts (launch.check_names): the registries are in the layers above, and this module, the
bottom of the package, imports none of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def parse_nnodes(value: str) -> tuple[int, int]:
    """'2' -> (2, 2); '1:4' -> (1, 4), as torchrun's --nnodes."""
    parts = str(value).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"nnodes: expected N or MIN:MAX, got {value!r}") from None
    _require(1 <= lo <= hi, "nnodes", f"need 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def threads_per_worker(num_threads: int, local_world_size: int) -> int:
    """--num-threads, or else this machine's cores shared evenly by its local workers."""
    return num_threads or max(1, (os.cpu_count() or 1) // local_world_size)


@dataclass(kw_only=True)
class LaunchSection:
    """How processes are started (mirrors torchrun's flags)."""

    nproc_per_node: int = field(default=1, metadata={"help": "worker processes on this node"})
    nnodes: str = field(default="1", metadata={"help": "number of nodes, N or MIN:MAX"})
    node_rank: int = field(
        default=0, metadata={"help": "this node's index; node 0 hosts the rendezvous"}
    )
    rdzv_endpoint: str = field(
        default="", metadata={"help": "HOST:PORT of the c10d rendezvous (default: local)"}
    )
    rdzv_id: str = field(default="", metadata={"help": "job id shared by all nodes"})
    local_addr: str = field(
        default="",
        metadata={"help": "this node's address as the other nodes reach it (default: hostname)"},
    )
    bind: str = field(
        default="",
        metadata={
            "help": "address this node's endpoints listen on (default: node 0's rendezvous "
            "address, the workers' MASTER_ADDR; 0.0.0.0: every interface)"
        },
    )
    max_restarts: int = field(default=0, metadata={"help": "worker-group restarts on failure"})
    rdzv_last_call_s: int = field(
        default=30,
        metadata={
            "help": "MIN:MAX nodes: how long a rendezvous waits for more nodes once MIN joined"
        },
    )
    rdzv_keep_alive_s: int = field(
        default=5,
        metadata={
            "help": "a node whose launcher is silent 3x this long leaves the rendezvous "
            "(torch's default 5; lower notices a dead node sooner, too low drops slow ones)"
        },
    )
    timeout_s: float = field(
        default=300.0, metadata={"help": "timeout of rendezvous and every collective, seconds"}
    )
    join_token_file: str = field(
        default="",
        metadata={
            "help": "file holding the secret a process must prove to join scaletrain's own "
            "endpoints (parameter servers); default: $SCALETRAIN_JOIN_TOKEN, else one per run"
        },
    )

    def __post_init__(self) -> None:
        _require(
            self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1, got {self.nproc_per_node}"
        )
        parse_nnodes(self.nnodes)
        _require(self.node_rank >= 0, "node_rank", f"must be >= 0, got {self.node_rank}")
        _require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        _require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        _require(self.rdzv_last_call_s >= 0, "rdzv_last_call_s", "must be >= 0")
        _require(self.rdzv_keep_alive_s >= 1, "rdzv_keep_alive_s", "must be >= 1")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            _require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                "rdzv_endpoint",
                f"expected HOST:PORT, got {self.rdzv_endpoint!r}",
            )
        if parse_nnodes(self.nnodes)[1] > 1:
            _require(
                bool(self.rdzv_endpoint),
                "rdzv_endpoint",
                "required when nnodes > 1 (HOST:PORT of node 0)",
            )


PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")
LR_SCHEDULES = ("constant", "cosine", "linear", "step")


@dataclass(kw_only=True)
class TrainSection:
    """The training loop."""

    strategy: str = field(default="ddp", metadata={"help": "training strategy"})
    epochs: int = field(default=1, metadata={"help": "passes over the training data"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many steps (0: no limit)"})
    batch_size: int = field(default=32, metadata={"help": "samples per worker per step"})
    drop_last: bool = field(
        default=False, metadata={"help": "drop the last incomplete global batch of each epoch"}
    )
    seed: int = field(default=0, metadata={"help": "seed of model init and data order"})
    deterministic: bool = field(
        default=False, metadata={"help": "deterministic kernels: same seed, same weights"}
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    num_threads: int = field(
        default=0, metadata={"help": "intra-op threads per worker (0: cores / local workers)"}
    )
    max_memory_per_rank: int = field(
        default=0,
        metadata={"help": "refuse a strategy whose per-rank training state exceeds this (bytes)"},
    )
    precision: str = field(
        default="32",
        metadata={"help": "32, bf16-mixed or fp16-mixed (autocast; fp16 with a loss scaler)"},
    )
    grad_accum: int = field(
        default=1,
        metadata={
            "help": "micro-batches of --batch-size per optimizer step (gradients synchronized "
            "once, after the last)"
        },
    )
    eval_every: int = field(
        default=0, metadata={"help": "score the test split every N steps (0: only at the end)"}
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={"help": "recompute each block's activations in backward instead of keeping them"},
    )
    balance: str = field(
        default="none",
        metadata={
            "help": "none, or speed: split each step's samples over the ranks in proportion "
            "to their measured speed (slower workers get fewer)"
        },
    )
    balance_every: int = field(
        default=10, metadata={"help": "--balance speed: steps between re-plans of the split"}
    )
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile the model's forward (the first steps compile it)"},
    )

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        _require(self.max_steps >= 0, "max_steps", f"must be >= 0, got {self.max_steps}")
        _require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        _require(self.num_threads >= 0, "num_threads", f"must be >= 0, got {self.num_threads}")
        _require(self.max_memory_per_rank >= 0, "max_memory_per_rank", "must be >= 0")
        _require(
            self.precision in PRECISIONS,
            "precision",
            f"must be one of {', '.join(PRECISIONS)}; got {self.precision!r}",
        )
        _require(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        _require(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        _require(
            self.balance in ("none", "speed"),
            "balance",
            f"must be none or speed, got {self.balance!r}",
        )
        _require(self.balance_every >= 1, "balance_every", "must be >= 1")
        _require(
            self.device in ("auto", "cpu", "cuda"),
            "device",
            f"must be one of auto, cpu, cuda; got {self.device!r}",
        )


@dataclass(kw_only=True)
class DataSection:
    """What to train on: a built-in dataset, or a user task that brings its own."""

    dataset: str = field(default="digits", metadata={"help": "built-in dataset"})
    data_dir: str = field(
        default="",
        metadata={"help": "shard directory written by `scaletrain shard` (replaces dataset)"},
    )
    verify: bool = field(
        default=False, metadata={"help": "check every shard's sha256 before training"}
    )
    num_samples: int = field(
        default=0, metadata={"help": "training samples to use (0: the dataset's default)"}
    )
    image_size: int = field(default=32, metadata={"help": "side of synthetic images, pixels"})
    task: str = field(
        default="",
        metadata={
            "help": "user task 'file.py:function' or 'module:function' (replaces dataset and model)"
        },
    )

    def __post_init__(self) -> None:
        _require(self.num_samples >= 0, "num_samples", f"must be >= 0, got {self.num_samples}")
        _require(self.image_size >= 8, "image_size", f"must be >= 8, got {self.image_size}")
        if self.task:
            _require(
                ":" in self.task,
                "task",
                f"expected 'file.py:function' or 'module:function', got {self.task!r}",
            )


@dataclass(kw_only=True)
class ModelSection:
    model: str = field(default="cnn", metadata={"help": "built-in model"})
    width: int = field(default=32, metadata={"help": "base channel/hidden width of the model"})

    def __post_init__(self) -> None:
        _require(self.width >= 1, "width", f"must be >= 1, got {self.width}")


@dataclass(kw_only=True)
class OptimSection:
    optimizer: str = field(default="sgd", metadata={"help": "sgd, adam or adamw"})
    lr: float = field(default=0.05, metadata={"help": "learning rate"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    clip_grad_norm: float = field(
        default=0.0,
        metadata={
            "help": "clip a gradient's norm to this (0: off). Which gradient depends on the "
            "strategy: ddp, fsdp, tensor, pipeline, ps bsp and --recovery inplace clip the "
            "step's gradient over all ranks (so they equal one process); local_sgd and "
            "diloco each replica's own; ps asp and ssp each push's"
        },
    )
    lr_schedule: str = field(
        default="constant",
        metadata={"help": "constant, cosine, linear (to 0) or step (x0.1 at 50% and 75%)"},
    )
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup from 0 to --lr"})

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.clip_grad_norm >= 0, "clip_grad_norm", "must be >= 0 (0: off)")
        _require(
            self.lr_schedule in LR_SCHEDULES,
            "lr_schedule",
            f"must be one of {', '.join(LR_SCHEDULES)}; got {self.lr_schedule!r}",
        )
        _require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")


RECOVERY_MODES = ("restart", "inplace")


@dataclass(kw_only=True)
class FaultSection:
    """Checkpoints and fault injection."""

    checkpoint_every: str = field(
        default="0",
        metadata={
            "help": "save a checkpoint every N steps (0: never; auto: the interval that loses "
            "the least time to checkpoints and rework at --mtbf-s, from the measured costs)",
            "int_or": "auto",
        },
    )
    mtbf_s: float = field(
        default=0.0,
        metadata={"help": "--checkpoint-every auto: the mean time between failures, seconds"},
    )
    keep_checkpoints: int = field(default=3, metadata={"help": "checkpoints kept on disk"})
    checkpoint_async: bool = field(
        default=False,
        metadata={"help": "write checkpoints in the background (the step waits for a copy)"},
    )
    inject: str = field(default="", metadata={"help": "faults to inject, e.g. kill:rank=1:step=7"})
    recovery: str = field(
        default="restart",
        metadata={
            "help": "restart: the group restarts from the last checkpoint; inplace: survivors "
            "continue, a restarted worker heals from a peer (torchft)"
        },
    )
    hang_timeout_s: float = field(
        default=0.0,
        metadata={"help": "a rank without progress this long is a hang (0: half of timeout_s)"},
    )
    log_sample_ids: bool = field(
        default=False, metadata={"help": "record each step's sample ids in metrics.jsonl"}
    )
    preempt_check_every: int = field(
        default=10,
        metadata={
            "help": "steps between the workers' checks for a preemption request (SIGTERM, "
            "SIGUSR1 to the launcher: finish the step, checkpoint, exit 3)"
        },
    )

    @property
    def checkpoint_auto(self) -> bool:
        return self.checkpoint_every == "auto"

    @property
    def checkpoint_interval(self) -> int:
        """N of --checkpoint-every N (0: none; and 0 under auto, whose interval the loop sets)."""
        return 0 if self.checkpoint_auto else int(self.checkpoint_every)

    @property
    def checkpoints_on(self) -> bool:
        return self.checkpoint_auto or self.checkpoint_interval > 0

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_every, int):  # FaultSection(checkpoint_every=20)
            self.checkpoint_every = str(self.checkpoint_every)
        every = self.checkpoint_every
        _require(
            every == "auto" or (every.isdigit()),
            "checkpoint_every",
            f"must be a number of steps >= 0 or auto, got {every!r}",
        )
        _require(self.mtbf_s >= 0, "mtbf_s", f"must be >= 0, got {self.mtbf_s}")
        _require(
            not self.checkpoint_auto or self.mtbf_s > 0,
            "mtbf_s",
            "--checkpoint-every auto needs --mtbf-s: the mean time between failures you expect "
            "(seconds), which with the measured checkpoint cost sets the interval",
        )
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        _require(self.hang_timeout_s >= 0, "hang_timeout_s", "must be >= 0")
        _require(self.preempt_check_every >= 1, "preempt_check_every", "must be >= 1")
        _require(
            self.recovery in RECOVERY_MODES,
            "recovery",
            f"must be one of {', '.join(RECOVERY_MODES)}; got {self.recovery!r}",
        )


@dataclass(kw_only=True)
class CommSection:
    """How workers communicate: gradient compression, bucketing, and for local_sgd / diloco
    how often they synchronize at all."""

    compression: str = field(
        default="none",
        metadata={"help": "gradient compressor NAME[:key=value...] (ddp), e.g. powersgd:rank=4"},
    )
    bucket_mb: float = field(default=25.0, metadata={"help": "DDP gradient bucket size, MB"})
    sync_every: int = field(
        default=8, metadata={"help": "local_sgd / diloco: local steps between synchronizations"}
    )
    outer_lr: float = field(default=0.7, metadata={"help": "diloco: outer Nesterov SGD lr"})
    outer_momentum: float = field(
        default=0.9, metadata={"help": "diloco: outer Nesterov SGD momentum"}
    )

    def __post_init__(self) -> None:
        _require(self.bucket_mb > 0, "bucket_mb", f"must be > 0, got {self.bucket_mb}")
        _require(self.sync_every >= 1, "sync_every", f"must be >= 1, got {self.sync_every}")
        _require(self.outer_lr > 0, "outer_lr", f"must be > 0, got {self.outer_lr}")
        _require(
            0 <= self.outer_momentum < 1,
            "outer_momentum",
            f"must be in [0, 1), got {self.outer_momentum}",
        )


SCHEDULES = ("gpipe", "1f1b")


@dataclass(kw_only=True)
class ParallelSection:
    """Model parallelism: how the model itself is split over ranks (pipeline, tensor)."""

    stages: int = field(
        default=0, metadata={"help": "pipeline: stages per pipeline (0: world size)"}
    )
    microbatches: int = field(
        default=4, metadata={"help": "pipeline: microbatches each batch is cut into"}
    )
    schedule: str = field(default="1f1b", metadata={"help": "pipeline: gpipe or 1f1b"})
    split_points: str = field(
        default="",
        metadata={
            "help": "pipeline: top-level layers that begin stages 2..P, comma-separated "
            "(default: balanced by parameter count)"
        },
    )
    tp: int = field(default=1, metadata={"help": "tensor: ranks per tensor-parallel group"})
    replica_size: int = field(
        default=0,
        metadata={
            "help": "fsdp: ranks per replica group (HSDP): each group shards the model over "
            "its ranks, the groups all-reduce the shards' gradients (0: one group of every rank)"
        },
    )

    def __post_init__(self) -> None:
        _require(self.stages >= 0, "stages", f"must be >= 0, got {self.stages}")
        _require(self.microbatches >= 1, "microbatches", f"must be >= 1, got {self.microbatches}")
        _require(
            self.schedule in SCHEDULES,
            "schedule",
            f"must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}",
        )
        _require(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        _require(self.replica_size >= 0, "replica_size", f"must be >= 0, got {self.replica_size}")


CONSISTENCY_MODES = ("bsp", "asp", "ssp")


# The parameter server's rules for an asynchronous push's lr (consistency.staleness_lr_factor).
STALENESS_RULES = ("inverse", "share", "none")


@dataclass(kw_only=True)
class PsSection:
    """Parameter server (--strategy ps): K of the world's processes serve the parameters."""

    num_servers: int = field(
        default=1, metadata={"help": "ps: server processes (the other processes are workers)"}
    )
    consistency: str = field(
        default="bsp",
        metadata={"help": "ps: bsp (synchronous), asp (asynchronous) or ssp (bounded staleness)"},
    )
    staleness: int = field(
        default=-1,
        metadata={"help": "ssp: how many steps a worker may run ahead of the slowest (required)"},
    )
    staleness_rule: str = field(
        default="inverse",
        metadata={
            "help": "asp, ssp: each push's learning rate: inverse (--lr / (1 + its "
            "staleness)), share (--lr / workers) or none (--lr)"
        },
    )
    barrier_timeout_s: float = field(
        default=30.0,
        metadata={"help": "bsp: how long the servers wait for a silent worker before dropping it"},
    )
    ps_replicas: int = field(
        default=0,
        metadata={
            "help": "ps: backups of each server's slice, on the next server process (0 or 1): "
            "every update reaches the backup before the worker's push is acknowledged, and a "
            "restarted server takes its slice from it (needs --num-servers >= 2)"
        },
    )

    def __post_init__(self) -> None:
        _require(self.num_servers >= 1, "num_servers", f"must be >= 1, got {self.num_servers}")
        _require(
            self.consistency in CONSISTENCY_MODES,
            "consistency",
            f"must be one of {', '.join(CONSISTENCY_MODES)}; got {self.consistency!r}",
        )
        # -1 is "not given" (TOML has no null); any other negative value is a mistake.
        _require(self.staleness >= -1, "staleness", f"must be >= 0, got {self.staleness}")
        _require(self.barrier_timeout_s > 0, "barrier_timeout_s", "must be > 0")
        _require(
            self.ps_replicas in (0, 1), "ps_replicas", f"must be 0 or 1, got {self.ps_replicas}"
        )
        _require(
            self.staleness_rule in STALENESS_RULES,
            "staleness_rule",
            f"must be one of {', '.join(STALENESS_RULES)}; got {self.staleness_rule!r}",
        )
        if self.consistency == "ssp":
            _require(
                self.staleness >= 0,
                "staleness",
                "--consistency ssp needs --staleness S (steps a worker may run ahead of the "
                "slowest; 0 waits for every worker at every step)",
            )
        else:
            _require(
                self.staleness == -1,
                "staleness",
                f"applies to --consistency ssp only, not {self.consistency}",
            )


# Where one node of a job differs from the others: left out of RunConfig.hash().
NODE_FIELDS = ("node_rank", "local_addr", "bind")

# What a job run again on its run directory may change (launch/jobs.py): how and where it
# runs, how long it trains (EXTENDS), what it records. Every other field is the math of the
# training, the same in the checkpoint it resumes (math_hash); a field added later is math
# until it is named here, so a resume never mixes two computations by accident.
EXTENDS = ("epochs", "max_steps")
FREE_FIELDS = frozenset({
    *EXTENDS, "device", "num_threads", "max_memory_per_rank", "eval_every",
    "activation_checkpointing", "compile", "verify", "checkpoint_every", "keep_checkpoints",
    "checkpoint_async", "inject", "hang_timeout_s", "log_sample_ids", "mtbf_s", "bucket_mb",
    "preempt_check_every", "balance", "balance_every",
    "barrier_timeout_s", "ps_replicas",
})  # fmt: skip
FREE_SECTIONS = ("launch",)

SECTIONS: dict[str, type] = {
    "launch": LaunchSection,
    "train": TrainSection,
    "data": DataSection,
    "model": ModelSection,
    "optim": OptimSection,
    "fault": FaultSection,
    "comm": CommSection,
    "parallel": ParallelSection,
    "ps": PsSection,
}


@dataclass(kw_only=True)
class RunConfig:
    """A run's whole configuration: one section per TOML table (``launch``, ``train``,
    ``data``, ``model``, ``optim``, ``fault``, ``comm``, ``parallel``, ``ps``), each key a flag
    of ``scaletrain run`` (the configuration reference lists them all). Build one with
    ``with_overrides(RunConfig(), {"nproc_per_node": 2, ...})`` (flat keys, as the flags
    name them) or ``load_toml(path)``; both validate it."""

    out: str = field(default="", metadata={"help": "run directory (default runs/<timestamp>)"})
    launch: LaunchSection = field(default_factory=LaunchSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    fault: FaultSection = field(default_factory=FaultSection)
    comm: CommSection = field(default_factory=CommSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    ps: PsSection = field(default_factory=PsSection)

    @property
    def samples_per_step(self) -> int:
        """Samples one data-parallel rank trains per optimizer step: --grad-accum
        micro-batches of --batch-size."""
        return self.train.batch_size * self.train.grad_accum

    @property
    def hang_timeout_s(self) -> float:
        """How long a rank may make no progress before it counts as hung: --hang-timeout-s,
        else half the collective timeout (so the watchdog names the rank before gloo fails)."""
        return self.fault.hang_timeout_s or self.launch.timeout_s / 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable hash of everything that affects training (not where it is written, nor
        which node wrote it: the nodes of one job differ only in those)."""
        d = self.to_dict()
        d.pop("out")
        for name in NODE_FIELDS:
            d["launch"].pop(name)
        return hashlib.sha256(dumps_toml(d).encode()).hexdigest()[:16]

    def math_fields(self) -> dict[str, Any]:
        """The fields a resumed job must share with its checkpoints: {leaf name: value}."""
        return {
            name: getattr(getattr(self, section), name) if section else getattr(self, name)
            for name, (section, _) in leaf_fields().items()
            if name != "out" and section not in FREE_SECTIONS and name not in FREE_FIELDS
        }

    def math_hash(self) -> str:
        """Hash of the math fields: a checkpoint loads only into a run with the same."""
        text = dumps_toml({k: v for k, v in sorted(self.math_fields().items())})
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def clip_scope(cfg: RunConfig) -> str:
    """What --clip-grad-norm bounds under ``cfg``'s strategy (summary.json says it too)."""
    if cfg.train.strategy in ("local_sgd", "diloco"):
        return "replica: each replica's own gradient, before its local update"
    if cfg.train.strategy == "ps" and cfg.ps.consistency != "bsp":
        return "push: each push's gradient, before the servers apply it"
    return "global: the step's gradient over all ranks, before the update"


def leaf_fields() -> dict[str, tuple[str | None, dataclasses.Field[Any]]]:
    """Flag name -> (section or None for top level, field). Names are unique by design."""
    out: dict[str, tuple[str | None, dataclasses.Field[Any]]] = {}
    for f in dataclasses.fields(RunConfig):
        if f.name in SECTIONS:
            for sub in dataclasses.fields(SECTIONS[f.name]):
                assert sub.name not in out, f"duplicate config leaf {sub.name}"
                out[sub.name] = (f.name, sub)
        else:
            out[f.name] = (None, f)
    return out


def _coerce(where: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        if not ok and f.metadata.get("int_or") and isinstance(value, int):
            value, ok = str(value), not isinstance(value, bool)  # 20 or "20", or "auto"
    if not ok:
        raise ValueError(f"{where}: expected {kind}, got {value!r}")
    return value


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from nested dicts (as TOML gives); unknown keys are errors."""
    kwargs: dict[str, Any] = {}
    top = {f.name: f for f in dataclasses.fields(RunConfig)}
    for key, value in data.items():
        if key not in top:
            raise ValueError(f"unknown key {key!r}; valid top-level keys: {', '.join(top)}")
        if key not in SECTIONS:
            kwargs[key] = _coerce(key, top[key], value)
            continue
        if not isinstance(value, dict):
            raise ValueError(f"[{key}] must be a table, got {value!r}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[key])}
        section: dict[str, Any] = {}
        for k, v in value.items():
            if k not in fields:
                raise ValueError(f"unknown key {k!r} in [{key}]; valid: {', '.join(fields)}")
            section[k] = _coerce(f"{key}.{k}", fields[k], v)
        kwargs[key] = SECTIONS[key](**section)
    return RunConfig(**kwargs)


def with_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """Apply flat overrides {leaf_name: value} (as the CLI gives) and re-validate."""
    data = cfg.to_dict()
    leaves = leaf_fields()
    for name, value in overrides.items():
        section, _ = leaves[name]
        if section is None:
            data[name] = value
        else:
            data[section][name] = value
    return from_dict(data)


def load_toml(path: str | Path) -> RunConfig:
    """The configuration in the TOML file at ``path`` (its tables as RunConfig's sections);
    ValueError naming the key for an unknown key or a value of the wrong type."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {p} is not valid TOML: {e}") from None
    try:
        return from_dict(data)
    except ValueError as e:
        raise ValueError(f"config file {p}: {e}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def dumps_toml(data: dict[str, Any]) -> str:
    """Write the flat-scalars-then-tables subset of TOML that RunConfig needs."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"
