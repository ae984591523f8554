"""Random points of the flag space, for the flag-space fuzzer (tests/unit/test_flag_space.py
draws many and checks the refusals without starting a process; tests/dist/test_flag_space.py
trains a few for real, ``make stress`` many more).

A draw is a dict of RunConfig leaf overrides, biased towards combinations that run (most
draws keep most flags at their defaults, as users do) so that the accepted ones are many and
the refused ones are the edges. ``argv`` turns it into the command line a user would type.
"""

from __future__ import annotations

import random
from typing import Any

STRATEGIES = ("ddp", "fsdp", "local_sgd", "diloco", "pipeline", "tensor", "ps")
COMPRESSIONS = ("fp16", "bf16", "powersgd:rank=2", "topk:ratio=0.1", "sign")

# Every configuration key the fuzzer sets: each value its help documents, with what it needs
# beside it to mean something (a strategy, a world size). tests/unit/test_flag_space.py
# checks each alone in every mode that supports it (a wrong refusal fails), and that every
# key of RunConfig is here or in FIXED.
PIPELINE = {"strategy": "pipeline", "nproc_per_node": 2}
PS2 = {"strategy": "ps", "nproc_per_node": 4, "num_servers": 2}
DOCUMENTED: dict[str, list[tuple[Any, dict[str, Any]]]] = {
    "activation_checkpointing": [(True, {"model": "transformer"})],
    "balance": [("none", {}), ("speed", {})],
    "balance_every": [(2, {"balance": "speed"})],
    "barrier_timeout_s": [(5.0, {"strategy": "ps", "nproc_per_node": 3})],
    "batch_size": [(1, {}), (8, {})],
    "bucket_mb": [(1.0, {})],
    "checkpoint_async": [(True, {"checkpoint_every": "2"})],
    "checkpoint_every": [("0", {}), ("3", {}), ("auto", {"mtbf_s": 60.0})],
    "clip_grad_norm": [(1.0, {})],
    "compile": [(True, {})],
    "compression": [("none", {}), *((c, {}) for c in COMPRESSIONS)],
    "consistency": [(c, {"strategy": "ps", "nproc_per_node": 3}) for c in ("bsp", "asp")]
    + [("ssp", {"strategy": "ps", "nproc_per_node": 3, "staleness": 1})],
    "dataset": [("digits", {}), ("synthetic", {"image_size": 8})],
    "deterministic": [(True, {})],
    "device": [("auto", {}), ("cpu", {})],
    "drop_last": [(True, {})],
    "epochs": [(2, {})],
    "eval_every": [(3, {})],
    "grad_accum": [(2, {})],
    "hang_timeout_s": [(30.0, {})],
    "image_size": [(8, {"dataset": "synthetic"})],
    "inject": [("kill:rank=1:step=3", {"max_restarts": 1}), ("slow:rank=1:factor=2", {}),
               ("hang:rank=1:step=3", {"max_restarts": 1}),
               ("killnode:rank=1:step=3", {"max_restarts": 1}),
               ("corrupt-checkpoint:step=3", {"checkpoint_every": "2", "max_restarts": 1}),
               ("kill-before-reply:rank=3:step=2", {**PS2, "ps_replicas": 1}),
               ("kill-during-copy:rank=3:step=2", {**PS2, "ps_replicas": 1}),
               ("break-backup-link:rank=3:step=2", {**PS2, "ps_replicas": 1})],
    "keep_checkpoints": [(1, {"checkpoint_every": "2"})],
    "log_sample_ids": [(True, {})],
    "lr": [(0.01, {})],
    "lr_schedule": [(v, {}) for v in ("constant", "cosine", "linear", "step")],
    "max_memory_per_rank": [(10**10, {})],
    "max_restarts": [(2, {})],
    "max_steps": [(5, {})],
    "microbatches": [(2, PIPELINE)],
    "model": [(m, {}) for m in ("cnn", "mlp", "transformer")],
    "momentum": [(0.0, {}), (0.5, {})],
    "mtbf_s": [(60.0, {"checkpoint_every": "auto"})],
    "nnodes": [("1", {}), ("1:2", {"rdzv_endpoint": "127.0.0.1:29400"})],
    "nproc_per_node": [(1, {}), (3, {})],
    "num_samples": [(64, {})],
    "num_servers": [(2, {"strategy": "ps", "nproc_per_node": 4})],
    "num_threads": [(1, {})],
    "optimizer": [(o, {}) for o in ("sgd", "adam", "adamw")],
    "outer_lr": [(0.5, {"strategy": "diloco"})],
    "outer_momentum": [(0.0, {"strategy": "diloco"})],
    "precision": [(v, {}) for v in ("32", "bf16-mixed", "fp16-mixed")],
    "preempt_check_every": [(3, {})],
    "ps_replicas": [(0, {}), (1, PS2)],
    "rdzv_keep_alive_s": [(3, {})],
    "rdzv_last_call_s": [(5, {})],
    "recovery": [("restart", {}), ("inplace", {})],
    "replica_size": [(1, {"strategy": "fsdp", "nproc_per_node": 2})],
    "schedule": [(v, PIPELINE) for v in ("gpipe", "1f1b")],
    "seed": [(7, {})],
    "split_points": [("3", {**PIPELINE, "model": "cnn"})],
    "stages": [(2, PIPELINE)],
    "staleness": [(1, {"strategy": "ps", "nproc_per_node": 3, "consistency": "ssp"})],
    "staleness_rule": [(v, {"strategy": "ps", "nproc_per_node": 3, "consistency": "asp"})
                       for v in ("inverse", "share", "none")],
    "strategy": [(v, {}) for v in STRATEGIES if v != "ps"] + [("ps", {"nproc_per_node": 3})],
    "sync_every": [(2, {"strategy": "local_sgd"})],
    "task": [("examples/tabular_task.py:build_task", {})],
    "timeout_s": [(60.0, {})],
    "tp": [(2, {"strategy": "tensor", "nproc_per_node": 2, "model": "transformer"})],
    "warmup_steps": [(2, {})],
    "weight_decay": [(0.01, {})],
    "width": [(16, {})],
}  # fmt: skip
# Keys the fuzzer never sets, and why.
FIXED = {
    "out": "each run gets a directory of its own",
    "data_dir": "names shards on disk that `scaletrain shard` wrote (tests/unit/test_shards.py)",
    "verify": "checks the shards of --data-dir (tests/unit/test_shards.py)",
    "join_token_file": "names a secret file (tests/dist/test_ps_server.py)",
    "node_rank": "multi-node wiring: the netns lab's tests (tests/e2e/test_netns.py)",
    "rdzv_endpoint": "multi-node wiring: the netns lab's tests",
    "rdzv_id": "multi-node wiring: the netns lab's tests",
    "local_addr": "multi-node wiring: the netns lab's tests",
    "bind": "multi-node wiring: the netns lab's tests (tests/unit/test_rendezvous.py)",
}
# Keys a trained draw leaves alone: sized by size_to_train, or what would make a correct run
# fail or wait (a fault without restarts, an elastic rendezvous's last call, a cap).
UNTRAINED = {"inject", "nnodes", "max_memory_per_rank", "timeout_s", "hang_timeout_s",
             "num_threads", "device", "task", "epochs", "batch_size", "num_samples",
             "max_steps", "lr", "optimizer", "momentum", "weight_decay", "outer_lr",
             "outer_momentum", "strategy", "model", "dataset", "image_size", "nproc_per_node",
             "num_servers", "rdzv_last_call_s", "recovery", "tp"}  # fmt: skip


def _maybe(rng: random.Random, p: float, value: Any, default: Any) -> Any:
    return value if rng.random() < p else default


def draw(rng: random.Random, *, trainable: bool = False) -> dict[str, Any]:
    """One point of the flag space. ``trainable``: sized to train to better than chance in
    seconds (enough samples and steps), for the draws that run."""
    strategy = rng.choice(STRATEGIES)
    d: dict[str, Any] = {
        "strategy": strategy,
        "nproc_per_node": rng.randint(1, 4),
        "model": rng.choice(("cnn", "mlp", "transformer")),
        "dataset": rng.choices(("digits", "synthetic"), (4, 1))[0],
        "batch_size": rng.choice((1, 2, 3, 4, 8, 16)),
        "epochs": rng.randint(1, 3),
        "seed": rng.randint(0, 99),
    }
    if d["dataset"] == "synthetic":
        d["image_size"] = 8
    if strategy in ("tensor", "fsdp") and rng.random() < 0.6:
        d["tp"] = 2
        d["model"] = "transformer"
    if strategy == "fsdp" and "tp" not in d and rng.random() < 0.5:
        d["replica_size"] = rng.choice((1, 2))  # HSDP (refused where 2 divides no world)
    elif rng.random() < 0.03:
        d["replica_size"] = 2  # refused: replica groups are fsdp's
    if strategy == "ps":
        # 1 to 8 servers: most counts do not divide the parameters (slices of two lengths).
        d["num_servers"] = rng.choice((1, 2, 2, 3, 3, 4, 5, 6, 7, 8))
        d["nproc_per_node"] = d["num_servers"] + rng.randint(1, 3)
        d["consistency"] = rng.choice(("bsp", "asp", "ssp"))
        if d["consistency"] == "ssp":
            d["staleness"] = rng.randint(0, 2)
        if rng.random() < 0.5:
            d["ps_replicas"] = 1  # refused with one server: the backup is another server
    elif rng.random() < 0.02:
        d["ps_replicas"] = 1  # refused: no parameter server to back up
    if strategy in ("local_sgd", "diloco"):
        d["sync_every"] = rng.randint(1, 4)
    if strategy == "pipeline":
        d["microbatches"] = rng.choice((1, 2, 4))
        d["schedule"] = rng.choice(("gpipe", "1f1b"))
        d["drop_last"] = rng.random() < 0.5
    extras = {
        "recovery": _maybe(rng, 0.15, "inplace", None),
        "precision": _maybe(rng, 0.3, rng.choice(("bf16-mixed", "fp16-mixed")), None),
        "grad_accum": _maybe(rng, 0.3, rng.choice((2, 3)), None),
        "clip_grad_norm": _maybe(rng, 0.25, 1.0, None),
        "lr_schedule": _maybe(rng, 0.3, rng.choice(("cosine", "linear", "step")), None),
        "warmup_steps": _maybe(rng, 0.2, 2, None),
        "eval_every": _maybe(rng, 0.25, 3, None),
        "compile": _maybe(rng, 0.08, True, None),
        "activation_checkpointing": _maybe(rng, 0.12, True, None),
        "balance": _maybe(rng, 0.15, "speed", None),
        "compression": _maybe(rng, 0.2, rng.choice(COMPRESSIONS), None),
        "checkpoint_every": _maybe(rng, 0.3, rng.choice((3, "auto")), None),
        "checkpoint_async": _maybe(rng, 0.15, True, None),
        "max_steps": _maybe(rng, 0.25, rng.randint(2, 12), None),
    }
    d |= {k: v for k, v in extras.items() if v is not None}
    _draw_the_rest(rng, d, trainable)
    if d.get("checkpoint_every") == "auto":
        d["mtbf_s"] = 60.0
    if d.get("balance") == "speed":
        d["balance_every"] = 2
    if trainable:
        size_to_train(d)
    else:
        d["num_samples"] = rng.choice((0, 64, 100))
    return d


def _draw_the_rest(rng: random.Random, d: dict[str, Any], trainable: bool) -> None:
    """Now and then, any other documented key, with what it needs, where that agrees with
    the draw so far (a key that needs another strategy is left out)."""
    for key in sorted(DOCUMENTED):
        if key in d or (trainable and key in UNTRAINED) or rng.random() >= 0.04:
            continue
        value, needs = rng.choice(DOCUMENTED[key])
        if any(d.get(k, v) != v for k, v in needs.items() if k in ("strategy", "model")):
            continue
        d[key] = value
        for k, v in needs.items():
            d.setdefault(k, v)


def data_parallel_width(d: dict[str, Any]) -> int:
    """About how many replicas share each step's samples in draw ``d``."""
    world = d["nproc_per_node"]
    if d["strategy"] == "ps":
        return world - d["num_servers"]
    if d["strategy"] == "pipeline":
        return 1  # --stages defaults to the world size: one pipeline
    return world // d.get("tp", 1)


def size_to_train(d: dict[str, Any]) -> None:
    """Enough optimizer steps, of enough samples, to beat chance by far whatever the draw's
    replicas and accumulation: the CNN and MLP about 60 SGD steps of 8 a replica; the
    transformer about 135 AdamW steps of 32 over all replicas; DiLoCo's inner steps AdamW, as
    its paper trains them. Measured: fewer steps or samples, or SGD with momentum under
    DiLoCo's Nesterov outer step, leave a correct run at chance (0.1), which would read as a
    failure. Digits; a few seconds of compute."""
    d["dataset"] = "digits"
    d.pop("image_size", None)
    d.pop("max_steps", None)
    d["width"] = 16
    if d.get("compression") == "sign" and d["model"] == "transformer" and d.get("tp", 1) == 1:
        d["model"] = "cnn"  # 1-bit gradients train the transformer too slowly to tell here
    dp = max(1, data_parallel_width(d))
    if d["model"] == "transformer":
        d["batch_size"] = {1: 32, 2: 16, 3: 12}.get(dp, 8)
        steps, d["num_samples"] = 135, 1437
    else:
        d["batch_size"] = 8
        steps, d["num_samples"] = 60, 640
    if d["model"] == "transformer" or d["strategy"] == "diloco":
        d["optimizer"], d["lr"] = "adamw", 0.003
        steps = max(steps, 100)
        if d["model"] == "transformer" and d["strategy"] == "diloco":
            steps = 200  # measured 0.18-0.31 at 135 steps: the outer step slows it
            # The outer Nesterov step (lr 0.7, momentum 0.9) moves the weights about 7x each
            # synchronization's change, so with H = 1 or 2 the transformer trains as under
            # AdamW at about 0.02 and stays near chance (measured 0.21 and 0.22 at H = 1, 2;
            # 0.47 at H = 4; one make stress draw failed at 0.20). The inner lr scaled by H / 4
            # gave 0.50, 0.475 and 0.47.
            d["lr"] = 0.003 * min(1.0, d.get("sync_every", 8) / 4)
    elif d.get("consistency") in ("asp", "ssp"):
        d["lr"] = 0.02  # stale gradients under momentum SGD: 0.1 diverged, 0.02 trains
    else:
        # SGD with momentum 0.9 on 8 samples a step is at the edge of diverging at 0.1: one
        # replica's ddp (a make stress draw, seeds 11-18) ended at chance for 2 of 8 seeds,
        # and at 0.05 beat 0.55 for all 8. With more samples a step 0.1 trains, and a smaller
        # lr was slower (local_sgd over 4 replicas: 0.49 at 0.05, 0.84 at 0.1).
        d["lr"] = 0.05 if dp * d["batch_size"] * d.get("grad_accum", 1) <= 8 else 0.1
    per_step = dp * d["batch_size"] * d.get("grad_accum", 1)
    d["epochs"] = max(1, -(-steps * per_step // d["num_samples"]))


def argv(d: dict[str, Any]) -> list[str]:
    """The command line of draw ``d`` (booleans as --flag / --no-flag)."""
    out: list[str] = []
    for key, value in d.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def describe(d: dict[str, Any]) -> str:
    """A draw as a test id: every parameter, so a failing one can be typed in again."""
    return " ".join(argv(d))
