"""Command line: ``scaletrain run | demo | shard``. Thin: parses, calls the API.

Every RunConfig leaf is a flag of the same name (train.batch_size -> --batch-size); flags
override --config FILE, which overrides the defaults. Exit codes: 0 success, 1 a worker
failed (or an internal failure, said so), 2 bad input (one paragraph on stderr, nothing
started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.config import RunConfig, leaf_fields, load_toml, with_overrides

DEMO_DEFAULTS: dict[str, Any] = {
    "nproc_per_node": 2,
    "dataset": "digits",
    "model": "cnn",
    "epochs": 10,
    "batch_size": 32,
    "lr": 0.05,
    # The demo shows fault tolerance too: rank 1 is SIGKILLed before step 60 (of 230); the
    # elastic agent restarts the group and it resumes from the checkpoint of step 55.
    "checkpoint_every": 5,
    "max_restarts": 1,
    "inject": "kill:rank=1:step=60",
}
FLAG_ALIASES = {"data_dir": ["--data"]}  # the short name users reach for first
# Flags `scaletrain bench` takes as lists of its own instead of one run's value.
BENCH_OWN = frozenset({"strategy", "compression", "nproc_per_node", "out"})


# The config flags of `scaletrain predict`: the model they describe is counted for --params.
PREDICT_MODEL_FLAGS = frozenset({"model", "task", "width", "dataset", "image_size", "data_dir"})


def add_config_flags(
    parser: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()
) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML run configuration")
    types = {"int": int, "float": float, "str": str}
    for name, (section, f) in leaf_fields().items():
        if name in exclude:
            continue
        flags = ["--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, [])]
        where = f"[{section}] {name}" if section else name
        options: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            # argparse formats help with %: a literal one (as in "50%") must be doubled.
            "help": f"{f.metadata.get('help', '')} ({where}, default {f.default!r})".replace(
                "%", "%%"
            ),
        }
        if f.type == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = types[str(f.type)]
        parser.add_argument(*flags, **options)


def add_model_and_cluster_flags(p: argparse.ArgumentParser) -> None:
    """predict's and plan's flags: the model (a run, or a description), the cluster and
    what failures cost."""
    p.add_argument("--calibrate", metavar="RUN_DIR", help="a finished 1-worker run of the job")
    p.add_argument(
        "--params", metavar="N",
        help="without a run: the model's parameters (25.6M, 7B, 1e8), with --step-ms; or "
             "counted from the model that --model / --task / --config describe",
    )  # fmt: skip
    p.add_argument(
        "--step-ms", type=float, metavar="T",
        help="without a run: one device's step (forward, backward, optimizer) at --batch-size",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="without a run: samples per device per step")  # fmt: skip
    p.add_argument(
        "--grad-bytes-per-param", type=float, default=4.0,
        help="without a run: bytes each parameter's gradient sends (4 fp32, 2 bf16)",
    )  # fmt: skip
    p.add_argument(
        "--overlap", type=float, default=None,
        help="share of gradient communication hidden behind backward, 0-1 (default: the "
             "run's measured one, or 0)",
    )  # fmt: skip
    p.add_argument(
        "--cluster", metavar="NAME",
        help="a named cluster (its devices per node, links and latency; the flags below "
             "override it): " + ", ".join(costmodel_cluster_names()),
    )  # fmt: skip
    p.add_argument("--cluster-file", metavar="TOML",
                   help="more named clusters, in clusters.toml's form")  # fmt: skip
    p.add_argument(
        "--bandwidth", default=None,
        help="between nodes, per node (per worker with one device a node): bits (10gbit, "
             "100Gb/s) or bytes (900GB/s); default 10gbit",
    )  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (default 1)")  # fmt: skip
    p.add_argument("--intra-bandwidth", default=None,
                   help="within a node, per device, e.g. 450GB/s")  # fmt: skip
    p.add_argument("--latency-us", type=float, default=None,
                   help="per-message latency (default 30)")  # fmt: skip
    # The model whose parameters --params would give, counted (its config flags only).
    add_config_flags(p, exclude=frozenset(leaf_fields()) - PREDICT_MODEL_FLAGS)
    p.add_argument(
        "--node-mtbf-h", type=float, default=None,
        help="a node's mean time between failures, hours (default: 7.9 h x 1,024 GPUs per "
             "GPU, published for 1,024-GPU jobs, over --gpus-per-node)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-s", type=float, default=None,
        help="what a checkpoint blocks training (default: the run's measured saves; without a "
             "run 12 bytes a parameter, weights and Adam's moments, at 1 GB/s)",
    )  # fmt: skip
    p.add_argument(
        "--restart-s", type=float, default=300.0,
        help="a failed node's way back: replaced, started, rendezvous, state loaded "
             "(default 300)",
    )  # fmt: skip
    p.add_argument(
        "--pause-s", type=float, default=5.0,
        help="in place: the survivors' pause at each failure, new quorum (default 5)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scaletrain", description="Train PyTorch models across processes and hosts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with the given configuration")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything and print what would start on this node, then exit",
    )
    run.add_argument(
        "--join-token",
        metavar="SECRET",
        help="the secret processes prove to join scaletrain's own endpoints (not written to "
        "config.toml; visible in `ps`: prefer --join-token-file or $SCALETRAIN_JOIN_TOKEN)",
    )
    add_config_flags(run)
    add_config_flags(sub.add_parser("demo", help="2 local workers train the CNN on digits"))
    bench = sub.add_parser("bench", help="run a job over a grid of workers, strategies, ...")
    bench.add_argument("--nproc", default="1,2", help="worker counts, e.g. 1,2,4")
    bench.add_argument("--strategy", dest="strategies", default="ddp", help="e.g. ddp,local_sgd")
    bench.add_argument("--compression", dest="compressions", default="none",
                       help="e.g. none,powersgd")  # fmt: skip
    bench.add_argument(
        "--bandwidth", default="", help="shaped links, e.g. 1gbit,100mbit (netns lab, root)"
    )
    bench.add_argument("--out", default="", help="sweep directory (default runs/bench-<time>)")
    add_config_flags(bench, exclude=BENCH_OWN)
    predict = sub.add_parser(
        "predict", help="predict step time and efficiency at scale",
        description="Calibrated from a finished 1-worker run (--calibrate), or from a "
                    "description of the model and the cluster (--params and --step-ms).",
    )  # fmt: skip
    add_model_and_cluster_flags(predict)
    predict.add_argument("--workers", default="2,8,64,1024", help="worker (device) counts")
    predict.add_argument(
        "--methods",
        default="ddp,local_sgd:8,ps:4,compressed:100:10",
        help="ddp, local_sgd:H, ps:K[:R] (dedicated servers; R=1: a backup of each slice), "
        "ps-colocated[:K], fsdp, hsdp:S (shard "
        "groups of S), tp:T:ACTIVATION_MB (tensor parallel of T within a node), "
        "compressed:RATIO[:ENCODE_MS], pipeline:P:M",
    )
    predict.add_argument(
        "--cores", type=int, default=0, help="cores the workers share (0: each has its own)"
    )
    predict.add_argument(
        "--colocated-slowdown", type=float, default=None, metavar="X",
        help="with --cores: one worker's compute beside the others over a worker's alone "
             "(measured: 2 workers that never synchronize; default 1)",
    )  # fmt: skip
    predict.add_argument(
        "--collective-cpu-us-per-mb", type=float, default=None, metavar="US",
        help="with --cores: the CPU a process spends per MB it sends in an all-reduce, which "
             "the workers' compute pays when they outnumber the cores (default 0: not modelled)",
    )  # fmt: skip
    predict.add_argument(
        "--probe-host", action="store_true",
        help="with --cores: probe this host with W processes for each W of --workers (their "
             "all-reduce's CPU, the slowdown of their other work): for devices on a shared host",
    )  # fmt: skip
    predict.add_argument("--json", action="store_true",
                         help="print the predictions as a JSON list, nothing else")  # fmt: skip
    plan = sub.add_parser(
        "plan", help="rank configurations by time to train or cost, failures included",
        description="Which method, devices and checkpoint interval train the given work "
                    "soonest (or cheapest): the cost model's step at each, the failure "
                    "model's goodput, within a deadline, a budget and a global batch limit.",
    )  # fmt: skip
    add_model_and_cluster_flags(plan)
    plan.set_defaults(cores=0, probe_host=False, colocated_slowdown=None,
                      collective_cpu_us_per_mb=None)  # fmt: skip
    plan.add_argument("--workers", default="8,16,32,64,128,256,512",
                      help="device counts to consider")  # fmt: skip
    plan.add_argument("--methods", default="ddp,fsdp,local_sgd:8",
                      help="methods to consider (as predict --methods)")  # fmt: skip
    plan.add_argument("--samples", metavar="N",
                      help="the work: samples to train an epoch (25.6M, 1e9)")  # fmt: skip
    plan.add_argument("--tokens", metavar="N",
                      help="the work in tokens (with --seq-len: a sample a sequence)")  # fmt: skip
    plan.add_argument("--seq-len", type=int, default=None,
                      help="with --tokens: tokens a sample")  # fmt: skip
    plan.add_argument("--epochs", type=float, default=1.0, dest="plan_epochs",
                      help="times through the work (default 1)")  # fmt: skip
    plan.add_argument("--global-batch", type=int, default=None,
                      help="a fixed global batch: each device trains its share, its step "
                           "in proportion (default: --batch-size a device)")  # fmt: skip
    plan.add_argument("--max-global-batch", type=int, default=None,
                      help="set aside configurations whose global batch is larger")  # fmt: skip
    plan.add_argument("--deadline", default=None,
                      help="set aside what takes longer: 7d, 36h, 90m")  # fmt: skip
    plan.add_argument("--budget-gpu-hours", type=float, default=None,
                      help="set aside what takes more GPU-hours")  # fmt: skip
    plan.add_argument("--price-per-gpu-hour", type=float, default=None,
                      help="a GPU-hour's price, for the cost column")  # fmt: skip
    plan.add_argument("--rank-by", choices=["time", "cost"], default="time",
                      help="time to train (default), or cost (GPU-hours)")  # fmt: skip
    plan.add_argument("--top", type=int, default=5, help="configurations to show")
    plan.add_argument("--json", action="store_true",
                      help="print every configuration as a JSON list, nothing else")  # fmt: skip
    report = sub.add_parser("report", help="write one HTML page with plots of finished runs")
    report.add_argument("run_dirs", nargs="+", help="run directories (with summary.json)")
    report.add_argument(
        "--out", default="", help="HTML file to write (default: RUN_DIR/report.html of the first)"
    )
    shard = sub.add_parser("shard", help="convert a dataset into shards for --data")
    shard.add_argument("src", help="digits | synthetic | a folder of class folders | .npz")
    shard.add_argument("out", help="shard directory to create")
    shard.add_argument("--shard-size", type=int, default=10_000, help="samples per shard")
    shard.add_argument("--num-samples", type=int, default=0, help="built-ins: training samples")
    shard.add_argument("--image-size", type=int, default=0, help="resize images to NxN")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from scaletrain.launch import run
    from scaletrain.metrics.progress import render_summary

    base: dict[str, Any] = {}
    if args.command == "demo":
        base = dict(DEMO_DEFAULTS, out=f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = load_toml(args.config) if args.config else with_overrides(RunConfig(), base)
    cfg = with_overrides(cfg, {k: v for k, v in vars(args).items() if k in leaf_fields()})
    if getattr(args, "join_token", None):  # to the launcher's children, never to a file
        from scaletrain import env

        os.environ[env.JOIN_TOKEN] = args.join_token
    if getattr(args, "dry_run", False):
        from scaletrain.launch import describe_plan

        print(describe_plan(cfg))
        return 0
    if args.command == "demo" and cfg.fault.inject:
        print(f"demo: injecting {cfg.fault.inject} to show a failure and its recovery")
    summary = run(cfg)
    if summary.get("already_complete"):
        steps = summary.get("steps")
        print(f"the job in {summary['run_dir']} is complete (it trained {steps} steps); nothing "
              "to do. To train it further raise --epochs or --max-steps.")  # fmt: skip
        return 0
    if "strategy" in summary:
        render_summary(summary, Console())
        if args.command == "demo":
            from scaletrain.analysis.report import write_report

            run_dir = Path(summary["run_dir"])
            print(f"report: {write_report([run_dir], run_dir / 'report.html')}")
    else:
        print(f"done; rank 0 ran on another node. Run directory: {summary['run_dir']}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from scaletrain.analysis.sweep import parse_list, plan, render, sweep

    cfg = load_toml(args.config) if args.config else RunConfig()
    cfg = with_overrides(cfg, {k: v for k, v in vars(args).items() if k in leaf_fields()})
    points = plan(
        parse_list(args.nproc, "nproc", int),
        parse_list(args.strategies, "strategy"),
        parse_list(args.compressions, "compression"),
        parse_list(args.bandwidth, "bandwidth") if args.bandwidth else [""],
    )
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    table = sweep(cfg, out, points)
    render(table)
    print(f"table: {out / 'bench.csv'}")
    finished = sum(r["status"] == "ok" for r in table)
    return 0 if finished else 1


def costmodel_cluster_names() -> list[str]:
    from scaletrain.analysis.costmodel import load_clusters

    return sorted(load_clusters())


def model_parameters(args: argparse.Namespace) -> int | None:
    """The parameters of the model that predict's config flags describe (None: none given)."""
    given = {k: v for k, v in vars(args).items() if k in PREDICT_MODEL_FLAGS}
    if not given and not args.config:
        return None
    from scaletrain.task import build_task

    cfg = load_toml(args.config) if args.config else RunConfig()
    task = build_task(with_overrides(cfg, given))
    return sum(p.numel() for p in task.model.parameters())


def predict_calibration(args: argparse.Namespace, worker_counts: list[int]) -> Any:
    """The cost model's Calibration: from a finished 1-worker run, or from a description of
    the model (--params, --step-ms, --batch-size) and of the cluster (--cluster and the link
    flags, which override it)."""
    from scaletrain.analysis import costmodel

    counted = model_parameters(args)
    if counted is not None and args.params is not None:
        raise ValueError(
            f"{args.command}: --params gives the count; --model, --task and --config "
            "count it from a model: give one or the other"
        )
    if counted is not None:
        args.params = str(counted)
    described = [f for f in ("params", "step_ms", "batch_size") if getattr(args, f) is not None]
    if args.calibrate and described:
        raise ValueError(
            f"{args.command}: --calibrate takes the model from a run; --params, --step-ms "
            "and --batch-size describe one instead: give one or the other"
        )
    if not args.calibrate and len(described) < 3:
        raise ValueError(
            f"{args.command}: give --calibrate RUN_DIR (a finished 1-worker run of the "
            "job), or describe the model: --params N --step-ms T --batch-size B "
            "(one device's step at B samples)"
        )
    cluster = None
    if args.cluster:
        clusters = costmodel.load_clusters(Path(args.cluster_file) if args.cluster_file else None)
        if args.cluster not in clusters:
            raise ValueError(f"{args.command}: no cluster named {args.cluster!r}; known: "
                             + ", ".join(sorted(clusters)))  # fmt: skip
        cluster = clusters[args.cluster]
    elif args.cluster_file:
        raise ValueError(
            f"{args.command}: --cluster-file adds named clusters: pick one with --cluster"
        )
    gpus = args.gpus_per_node or (cluster.gpus_per_node if cluster else 1)
    if gpus < 1:
        raise ValueError(f"{args.command}: --gpus-per-node must be at least 1")
    bandwidth = (costmodel.parse_bandwidth(args.bandwidth, "--bandwidth") if args.bandwidth
                 else cluster.bandwidth_Bps if cluster else 10e9 / 8)  # fmt: skip
    intra = (costmodel.parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth")
             if args.intra_bandwidth
             else cluster.intra_bandwidth_Bps if cluster else 0.0)  # fmt: skip
    if gpus > 1 and not intra:
        raise ValueError(
            f"{args.command}: with --gpus-per-node above 1, give --intra-bandwidth (each "
            "device's bandwidth within its node, e.g. 450GB/s) or --cluster"
        )
    latency_us = args.latency_us if args.latency_us is not None else (
        cluster.latency_us if cluster else 30.0)  # fmt: skip
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        raise ValueError(f"{args.command}: --overlap is a share, 0-1, got {args.overlap}")
    link: dict[str, Any] = {"latency_s": latency_us * 1e-6, "bandwidth_Bps": bandwidth,
            "gpus_per_node": gpus, "intra_bandwidth_Bps": intra,
            **shared_host(args)}  # fmt: skip
    if not args.calibrate:
        if args.step_ms <= 0 or args.batch_size < 1 or args.grad_bytes_per_param <= 0:
            raise ValueError(
                f"{args.command}: --step-ms, --batch-size and --grad-bytes-per-param must be "
                "above 0"
            )
        params = costmodel.parse_count(args.params, "--params")
        if args.probe_host:
            raise ValueError(
                f"{args.command}: --probe-host probes this host for a job's step measured "
                "here: use it with --calibrate"
            )
        return costmodel.Calibration(
            compute_s=args.step_ms / 1e3, batch_size=args.batch_size,
            grad_bytes=round(params * args.grad_bytes_per_param), overlap=args.overlap or 0.0,
            cores=args.cores, **link,
        )  # fmt: skip
    measured = costmodel.calibrate_run(Path(args.calibrate))
    host: tuple[Any, ...] = ()
    if args.probe_host:
        if not args.cores:
            raise ValueError("--probe-host probes the host the workers share: give --cores")
        if max(worker_counts) > 256:
            raise ValueError("--probe-host starts W processes on this host: --workers at most 256")
        from scaletrain.analysis.probe import probe_host

        device_s = max(measured["compute_s"] - measured["cpu_s"], 0.0)
        host = probe_host(device_s, [w for w in worker_counts if w > 1])
    overlap = measured["overlap"] if args.overlap is None else args.overlap
    return costmodel.Calibration(
        compute_s=measured["compute_s"], batch_size=int(measured["batch_size"]),
        grad_bytes=int(measured["grad_bytes"]), overlap=overlap, cores=args.cores,
        cpu_s=measured["cpu_s"] if args.cores else 0.0, host=host, **link,
    )  # fmt: skip


def predict_argv(cal: Any, workers: list[int], methods: list[str]) -> list[str]:
    """The ``scaletrain predict`` command line that describes ``cal`` (a cost-model
    Calibration without host probes) and predicts ``methods`` at ``workers``: what a
    calibration measured here reads as on the command line (benchmarks/costmodel.py prints
    it)."""
    if cal.grad_bytes % 4 or cal.cpu_s or cal.host or cal.ps_host:
        raise ValueError("predict_argv: fp32 gradients and no host probes only")
    argv = [
        "scaletrain", "predict", "--params", str(cal.grad_bytes // 4),
        "--step-ms", repr(cal.compute_s * 1e3), "--batch-size", str(cal.batch_size),
        "--latency-us", repr(cal.latency_s * 1e6), "--bandwidth", f"{cal.bandwidth_Bps!r}B/s",
        "--overlap", repr(cal.overlap),
    ]  # fmt: skip
    if cal.gpus_per_node > 1:
        argv += ["--gpus-per-node", str(cal.gpus_per_node),
                 "--intra-bandwidth", f"{cal.intra_bandwidth_Bps!r}B/s"]  # fmt: skip
    if cal.cores:
        per_mb = cal.collective_cpu_per_byte * 1e12
        argv += ["--cores", str(cal.cores), "--colocated-slowdown", repr(cal.colocated_slowdown),
                 "--collective-cpu-us-per-mb", repr(per_mb)]  # fmt: skip
    return [*argv, "--workers", ",".join(map(str, workers)), "--methods", ",".join(methods)]


def shared_host(args: argparse.Namespace) -> dict[str, float]:
    """What sharing ``--cores`` costs the workers, as measured on the host (the Calibration's
    colocated_slowdown and collective_cpu_per_byte); nothing without --cores."""
    given = {"--colocated-slowdown": args.colocated_slowdown,
             "--collective-cpu-us-per-mb": args.collective_cpu_us_per_mb}  # fmt: skip
    named = [flag for flag, value in given.items() if value is not None]
    if named and not args.cores:
        raise ValueError(
            f"{args.command}: {' and '.join(named)} describe{'s' if len(named) == 1 else ''} "
            "workers sharing a host's cores: give --cores too"
        )
    if any(value is not None and value < 0 for value in given.values()) or (
        args.colocated_slowdown is not None and args.colocated_slowdown == 0
    ):
        raise ValueError(
            f"{args.command}: --colocated-slowdown must be above 0 and "
            "--collective-cpu-us-per-mb at least 0"
        )
    out: dict[str, float] = {}
    if args.colocated_slowdown is not None:
        out["colocated_slowdown"] = args.colocated_slowdown
    if args.collective_cpu_us_per_mb is not None:
        out["collective_cpu_per_byte"] = args.collective_cpu_us_per_mb * 1e-12
    return out


def failure_inputs(args: argparse.Namespace, cal: Any) -> tuple[float, float]:
    """predict's (node MTBF in hours, checkpoint seconds): the flags, or their defaults (a
    node of ``cal``'s devices at the published per-device MTBF; the calibrating run's
    measured saves, else 12 bytes a parameter at 1 GB/s)."""
    from scaletrain.analysis import costmodel

    mtbf_h = args.node_mtbf_h
    if mtbf_h is None:
        mtbf_h = costmodel.DEVICE_MTBF_H / cal.gpus_per_node
    checkpoint_s = args.checkpoint_s
    if checkpoint_s is None:
        measured = args.calibrate and costmodel.measured_checkpoint_s(Path(args.calibrate))
        params = costmodel.parse_count(args.params) if args.params else cal.grad_bytes / 4
        checkpoint_s = measured or 12 * params / 1e9
    for name, value in (("--node-mtbf-h", mtbf_h), ("--checkpoint-s", checkpoint_s),
                        ("--restart-s", args.restart_s), ("--pause-s", args.pause_s)):  # fmt: skip
        if value < 0 or (name == "--node-mtbf-h" and value == 0):
            raise ValueError(f"{args.command}: {name} must be above 0, got {value:g}")
    return mtbf_h, checkpoint_s


def print_cluster_sources(console: Any, args: argparse.Namespace) -> None:
    """The sources of --cluster's figures, a line each."""
    from scaletrain.analysis import costmodel

    if args.cluster:
        clusters = costmodel.load_clusters(Path(args.cluster_file) if args.cluster_file else None)
        for source in clusters[args.cluster].sources:
            console.print(f"{args.cluster}: {source}", highlight=False, soft_wrap=True)


def plan_work(args: argparse.Namespace) -> float:
    """plan's samples to train: --samples (or --tokens over --seq-len) times --epochs."""
    from scaletrain.analysis import costmodel

    if bool(args.samples) == bool(args.tokens):
        raise ValueError("plan: give the work as --samples N or as --tokens N (with --seq-len)")
    if args.tokens:
        if not args.seq_len or args.seq_len < 1:
            raise ValueError("plan: --tokens counts the work in tokens: give --seq-len, the "
                             "tokens of one sample")  # fmt: skip
        samples = costmodel.parse_count(args.tokens, "--tokens") / args.seq_len
    else:
        samples = costmodel.parse_count(args.samples, "--samples")
    if not args.plan_epochs > 0:
        raise ValueError(f"plan: --epochs must be above 0, got {args.plan_epochs:g}")
    return samples * args.plan_epochs


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from scaletrain.analysis import planner
    from scaletrain.analysis.sweep import parse_list

    samples = plan_work(args)
    worker_counts = parse_list(args.workers, "workers", int)
    if min(worker_counts) < 1:
        raise ValueError("plan: --workers must be at least 1")
    for name in ("global_batch", "max_global_batch", "budget_gpu_hours", "price_per_gpu_hour"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"plan: --{name.replace('_', '-')} must be above 0, got {value:g}")
    if args.top < 1:
        raise ValueError("plan: --top must be at least 1")
    cal = predict_calibration(args, worker_counts)
    mtbf_h, checkpoint_s = failure_inputs(args, cal)
    failures = planner.Failures(mtbf_h * 3600, checkpoint_s, args.restart_s, args.pause_s)
    limits = planner.Limits(
        deadline_s=planner.parse_duration(args.deadline, "--deadline") if args.deadline else None,
        budget_gpu_hours=args.budget_gpu_hours, max_global_batch=args.max_global_batch,
    )  # fmt: skip
    every = planner.options(cal, parse_list(args.methods, "methods"), worker_counts, samples,
                            failures, limits, args.price_per_gpu_hour,
                            args.global_batch)  # fmt: skip
    ranked = planner.rank(every, args.rank_by)
    if args.json:
        order = {id(o): i for i, o in enumerate(every)}  # the ranked first, then the rest
        rest = sorted((o for o in every if o.excluded), key=lambda o: order[id(o)])
        print(json.dumps([{"rank": i + 1 if not o.excluded else None, **dataclasses.asdict(o)}
                          for i, o in enumerate([*ranked, *rest])], indent=1))  # fmt: skip
        return 0
    # Piped (a file, the docs), rich would cut the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    price = args.price_per_gpu_hour
    console.print(
        f"plan: {samples:,.0f} samples to train; {cal.compute_s * 1e3:,.1f} ms a step at "
        f"{cal.batch_size} samples a device, {cal.grad_bytes / 1e6:,.1f} MB of gradients; "
        f"{cal.gpus_per_node} devices a node; ranked by "
        f"{'time to train' if args.rank_by == 'time' else 'cost (GPU-hours)'} (W: devices, "
        "batch: the global batch, ckpt: the checkpoint interval)",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    if not ranked:
        reasons = sorted({o.excluded.split(",")[0].split(" (")[0] for o in every})
        console.print("no configuration fits: " + "; ".join(reasons[:5]), highlight=False,
                      soft_wrap=True)  # fmt: skip
        return 0
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in (
        "#",
        "method",
        "W",
        "batch",
        "recovery",
        "ckpt",
        "to train",
        "goodput",
        "GPU-h",
        *(["cost"] if price else []),
    ):
        table.add_column(column, no_wrap=column != "method")  # fmt: skip
    for i, o in enumerate(ranked[: args.top], 1):
        table.add_row(str(i), o.method, f"{o.workers:,}", f"{o.global_batch:,}", o.recovery,
                      f"{o.checkpoint_interval_s / 60:,.0f} min",
                      planner.duration_text(o.time_s), f"{o.goodput:.1%}",
                      f"{o.gpu_hours:,.0f}",
                      *([f"{o.cost:,.0f}"] if o.cost is not None else []))  # fmt: skip
    console.print(table)
    for i, o in enumerate(ranked[1 : args.top + 1], 2):
        shown = "" if i <= args.top else " (the next one, not shown)"
        console.print(f"  #{i} {o.method} on {o.workers:,}{shown}: {o.loses_because}",
                      highlight=False, soft_wrap=True)  # fmt: skip
    excluded = [o for o in every if o.excluded]
    if excluded:
        console.print(f"set aside: {len(excluded)} of {len(every)} configurations, e.g. "
                      f"{excluded[0].method} on {excluded[0].workers:,}: "
                      f"{excluded[0].excluded}", highlight=False, soft_wrap=True)  # fmt: skip
    console.print(
        f"assumes: the cost model's (scaletrain predict), a node failing every {mtbf_h:,.0f} h "
        f"on average, a checkpoint blocking {checkpoint_s:.1f} s every Young/Daly interval, a "
        f"failed node back in {args.restart_s:g} s; a step's compute in proportion to a "
        "device's samples; the global batch's effect on convergence is not modelled",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    print_cluster_sources(console, args)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from scaletrain.analysis import costmodel
    from scaletrain.analysis.sweep import parse_list

    worker_counts = parse_list(args.workers, "workers", int)
    if min(worker_counts) < 1:
        raise ValueError("predict: --workers must be at least 1")
    cal = predict_calibration(args, worker_counts)
    predictions = []
    for method in parse_list(args.methods, "methods"):
        for workers in worker_counts:
            predictions.append(costmodel.predict_method(cal, method, workers))
            if method.startswith("pipeline"):
                break
    mtbf_h, checkpoint_s = failure_inputs(args, cal)
    failures = {w: costmodel.plan_failures(w, cal.gpus_per_node, mtbf_h * 3600, checkpoint_s,
                                           args.restart_s, args.pause_s)
                for w in worker_counts}  # fmt: skip
    if args.json:
        print(json.dumps([{"method": p.method, "workers": p.workers, "step_s": p.step_s,
                           "samples_per_s": p.samples_per_s, "efficiency": p.efficiency,
                           "failures": dataclasses.asdict(failures[p.workers])}
                          for p in predictions], indent=1))  # fmt: skip
        return 0
    bandwidth = f"{cal.bandwidth_Bps * 8 / 1e9:g} Gbit/s"
    link = (f"{cal.gpus_per_node} devices a node at {cal.intra_bandwidth_Bps / 1e9:g} GB/s "
            f"each, nodes at {bandwidth}" if cal.gpus_per_node > 1 else bandwidth)  # fmt: skip
    table = Table(title=f"predicted at {link}, {cal.latency_s * 1e6:g} us latency",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)  # fmt: skip
    for column in ("W", "method", "step ms", "compute ms", "comm ms", "samples/s", "effic."):
        table.add_column(column, no_wrap=True)
    for p in predictions:
        table.add_row(str(p.workers), p.method, f"{p.step_s * 1e3:,.1f}",
                      f"{p.compute_s * 1e3:,.1f}", f"{p.comm_s * 1e3:,.1f}",
                      f"{p.samples_per_s:,.0f}", f"{p.efficiency:.0%}")  # fmt: skip
    console = Console()
    origin = (f"calibrated from {args.calibrate}" if args.calibrate else
              f"described: {costmodel.parse_count(args.params):,} parameters")  # fmt: skip
    console.print(
        f"{origin}: {cal.compute_s * 1e3:.1f} ms per step without "
        f"communication at {cal.batch_size} samples per worker, {cal.grad_bytes / 1e6:.1f} MB "
        f"of gradients, overlap {cal.overlap:.0%}",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    console.print(table)
    shared = "every worker has its own compute"
    if cal.cores:
        shared = (f"the workers share {cal.cores} cores (" + (
            f"their host CPU per step: {cal.cpu_s * 1e3:.2f} ms alone" if cal.cpu_s else
            f"one beside the others computes {cal.colocated_slowdown:.2f}x as long as alone, "
            f"an all-reduce costs {cal.collective_cpu_per_byte * 1e12:.0f} us of CPU per MB "
            "sent") + ")")  # fmt: skip
    hierarchy = ("hierarchical all-reduce (within each node, then across nodes)"
                 if cal.gpus_per_node > 1 else "ring all-reduce")  # fmt: skip
    console.print(
        f"assumes: {shared} and a link at the bandwidth; {hierarchy}; no stragglers or noise; "
        "ps is synchronous with the busiest server link as its bound; see "
        "scaletrain/analysis/costmodel.py for every formula",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    losses = Table(title="failures: goodput (hours lost a day), restart against in place",
                   box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)  # fmt: skip
    for column in ("W", "nodes", "job MTBF", "ckpt every", "restart", "in place"):
        losses.add_column(column, no_wrap=True)
    for f in failures.values():
        losses.add_row(str(f.workers), str(f.nodes), f"{f.job_mtbf_s / 3600:,.1f} h",
                       f"{f.checkpoint_interval_s / 60:,.1f} min",
                       f"{f.goodput_restart:.1%} ({f.lost_h_per_day_restart:.2f} h)",
                       f"{f.goodput_inplace:.1%} ({f.lost_h_per_day_inplace:.2f} h)")  # fmt: skip
    console.print(losses)
    first = next(iter(failures.values()))
    console.print(
        f"failures: a node fails every {mtbf_h:,.0f} h on average, "
        f"independently; a checkpoint blocks {checkpoint_s:.1f} s, every Young/Daly "
        f"interval sqrt(2 x checkpoint x job MTBF); a failed node is back in "
        f"{args.restart_s:g} s; in place, the survivors pause {args.pause_s:g} s a failure. "
        f"First order: only while intervals and restarts are short against the job's MTBF "
        f"({first.job_mtbf_s / 3600:,.1f} h at W={first.workers})",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    print_cluster_sources(console, args)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from scaletrain.analysis.report import write_report

    dirs = [Path(d) for d in args.run_dirs]
    out = Path(args.out) if args.out else dirs[0] / "report.html"
    print(f"report: {write_report(dirs, out)}")
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from scaletrain.data.shards import write_shards
    from scaletrain.data.sources import build_source

    start = time.perf_counter()
    source = build_source(args.src, num_samples=args.num_samples, image_size=args.image_size)
    out = Path(args.out)
    manifest = write_shards(
        out,
        source.splits,
        num_classes=source.num_classes,
        class_names=source.class_names,
        shard_size=args.shard_size,
        source=source.description,
    )
    files = [
        f
        for entries in manifest["splits"].values()
        for e in entries
        for f in (e["images"], e["labels"])
    ]
    size = sum((out / f).stat().st_size for f in files)
    for split, entries in manifest["splits"].items():
        print(
            f"{split}: {sum(e['num_samples'] for e in entries):,} samples in {len(entries)} shards"
        )
    seconds = time.perf_counter() - start
    print(f"wrote {size / 1e9:.3f} GB ({size / 1e6:.1f} MB) to {out} in {seconds:.1f} s")
    return 0


def fail(message: str) -> None:
    print(f"scaletrain: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["run"], ["demo"]):
        # First: a preemption signal at any moment of a run is answered (exit 3, or 0 once
        # the job finished), never the default death by SIGTERM (launch/signals.py).
        from scaletrain.launch.signals import GUARD

        GUARD.install()
    from scaletrain.launch.leaving import leave

    return leave(run_command(argv))


def run_command(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
    from scaletrain.launch import InternalFailure, LaunchFailed, Preempted, WorkerFailed

    try:
        commands = {"shard": cmd_shard, "report": cmd_report, "bench": cmd_bench,
                    "predict": cmd_predict, "plan": cmd_plan}  # fmt: skip
        return commands.get(args.command, cmd_run)(args)
    except ValueError as e:
        fail(f"error: {e}")
        return 2
    except WorkerFailed as e:
        fail(str(e))
        return 1
    except LaunchFailed as e:
        fail(f"launch failed: {e}")
        return 1
    except InternalFailure as e:
        fail(f"internal failure: {e}")
        return 1
    except Preempted as e:
        fail(str(e))
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        fail("interrupted; workers were stopped")
        return 130
    except BrokenPipeError:
        # The reader of the output left (`scaletrain predict --json | head`): nothing more
        # to say, and nothing to flush at exit either (Python's own advice for EPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
