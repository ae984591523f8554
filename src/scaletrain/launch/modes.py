"""The ways scaletrain runs a job, and the flags each one does not honour.

- ``restart``: torch's elastic agent; the group restarts from the newest checkpoint when a
  worker dies or hangs (agent.py). Every flag applies.
- ``inplace`` (``--recovery inplace``): torchft; survivors go on, a restarted replica heals
  from a live peer (inplace.py, strategies/inplace.py; local SGD and DiLoCo at each
  synchronization, strategies/inplace_rounds.py); a stuck one is ended by its own watchdog
  and restarted. Nothing is rolled back; checkpoints are for losing every replica at once.
- ``ps`` (``--strategy ps``): parameter servers and workers (ps.py, strategies/param_server/).
  The servers checkpoint their own partitions, always in the background; a silent worker is
  dropped after --barrier-timeout-s, a silent node after --timeout-s; a worker stuck outside
  its pushes, pulls and leases is ended by its own watchdog (--hang-timeout-s), restarted,
  and its leases dealt to the others.

All three run the same training loop in their workers (trainer.py); launch/__init__.py
starts each one's launcher.

A flag a mode would ignore is refused before any process starts, with a message that names
the mode, instead of meaning something else there or nothing at all.
"""

from __future__ import annotations

from scaletrain.config import RunConfig, parse_nnodes

MODES = ("restart", "inplace", "ps")
# The strategies --recovery inplace runs (strategies/inplace.py, inplace_rounds.py; fsdp in
# replica groups: inplace_hsdp.py).
INPLACE_STRATEGIES = ("ddp", "local_sgd", "diloco", "fsdp")


# Compressors in-place recovery cannot carry, and why (fp16 and bf16 it can: one all-reduce
# of a stateless encoding, on torchft's fault-tolerant process group).
INPLACE_REFUSED_COMPRESSORS = {
    "powersgd": "its warm-started factors and error feedback must be the same on every "
    "replica, and a replica that heals or restarts has neither",
    "topk": "it all-gathers every replica's payload, and torchft carries only all-reduces "
    "through its quorum",
    "sign": "it all-gathers every replica's payload, and torchft carries only all-reduces "
    "through its quorum",
}


def mode_of(cfg: RunConfig) -> str:
    if cfg.train.strategy == "ps":
        return "ps"
    return "inplace" if cfg.fault.recovery == "inplace" else "restart"


def _faults(cfg: RunConfig) -> set[str]:
    return {item.split(":")[0].strip() for item in cfg.fault.inject.split(",") if item.strip()}


def refusals(cfg: RunConfig) -> list[str]:
    """Why ``cfg``'s mode cannot honour some of its flags: one line per flag, empty when it
    honours them all."""
    mode, faults = mode_of(cfg), _faults(cfg)
    out = []
    if mode == "inplace":
        name = "--recovery inplace"
        if cfg.train.strategy not in INPLACE_STRATEGIES:
            out.append(
                f"recovery: {name} runs data parallel training (--strategy ddp, local_sgd, "
                f"diloco, or fsdp in replica groups), not {cfg.train.strategy!r}"
            )
        if cfg.train.strategy == "fsdp":
            out += _hsdp_refusals(cfg, name)
        if cfg.train.strategy in ("local_sgd", "diloco") and cfg.train.balance == "speed":
            out.append(
                f"balance: under {name} --strategy {cfg.train.strategy} deals a round of "
                "--sync-every steps at each synchronization, evenly; the rates --balance speed "
                "splits by ride on every step's gradient all-reduce, which local SGD does "
                "not have: drop --balance speed (or use --strategy ddp)"
            )
        compressor = cfg.comm.compression.split(":")[0].strip()
        if compressor in INPLACE_REFUSED_COMPRESSORS:
            out.append(
                f"compression: {name} carries fp16 and bf16 gradients, not {compressor}: "
                f"{INPLACE_REFUSED_COMPRESSORS[compressor]}"
            )
        lo, hi = parse_nnodes(cfg.launch.nnodes)
        if lo != hi:
            out.append(
                "nnodes: inplace recovery starts a fixed set of replicas (the survivors of a "
                f"lost node go on without it); pass --nnodes N, not {cfg.launch.nnodes!r}"
            )
        if "corrupt-checkpoint" in faults:
            out.append(
                f"inject: corrupt-checkpoint tests a restart's fall back to an older checkpoint; "
                f"under {name} a replica that dies heals from a live peer, and a checkpoint is "
                "read only when the whole job starts again"
            )
    for fault in sorted(faults & {"break-backup-link", "kill-before-reply", "kill-during-copy"}):
        if mode != "ps" or not cfg.ps.ps_replicas:
            out.append(
                f"inject: {fault} fires in a parameter server's replication of its slice: "
                "it needs --strategy ps with --ps-replicas 1"
            )
    if mode == "ps":
        name = "--strategy ps"
        if cfg.fault.checkpoint_auto:
            out.append(
                f"checkpoint_every: under {name} the servers checkpoint every N of their own "
                "updates; auto sets the training loop's interval: pass a number"
            )
        if cfg.fault.checkpoint_async:
            out.append(
                f"checkpoint_async: under {name} the servers always write their checkpoints "
                "in the background (a worker never waits for one); drop --checkpoint-async"
            )
        if cfg.fault.recovery != "restart":
            out.append(
                "recovery: the parameter server recovers its own way (a dead worker's data is "
                "dealt to the others, a dead server reloads its partition); drop --recovery "
                "inplace"
            )
        if "corrupt-checkpoint" in faults:
            out.append(
                f"inject: corrupt-checkpoint damages the trainer's checkpoints; under {name} "
                "the servers keep their own"
            )
    return out


def _hsdp_refusals(cfg: RunConfig, name: str) -> list[str]:
    """What fsdp in place (replica groups: strategies/inplace_hsdp.py) does not do yet."""
    out = []
    size = cfg.parallel.replica_size
    if not size:
        out.append(
            f"recovery: {name} --strategy fsdp recovers whole replica groups, each "
            "sharding the model over its ranks (HSDP): pass --replica-size R (R ranks a "
            "group, at least 2 groups)"
        )
    elif size >= cfg.launch.nproc_per_node * parse_nnodes(cfg.launch.nnodes)[0]:
        out.append(
            f"replica_size: {name} needs at least 2 replica groups to heal one from another; "
            f"--replica-size {size} makes one of the whole world"
        )
    if cfg.train.balance == "speed":
        out.append(
            f"balance: {name} with replica groups splits every step evenly; --balance speed "
            "is not built for groups yet"
        )
    if size and cfg.launch.nproc_per_node % size:
        out.append(
            f"replica_size: {name} keeps each replica group on one node: --replica-size "
            f"{size} must divide --nproc-per-node {cfg.launch.nproc_per_node}"
        )
    return out


def check_flags(cfg: RunConfig) -> None:
    """Raise ValueError listing every flag ``cfg``'s mode would not honour."""
    problems = refusals(cfg)
    if problems:
        raise ValueError("; ".join(problems))
