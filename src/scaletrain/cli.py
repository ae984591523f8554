"""Command line: ``scaletrain run | demo``. Thin: parses, builds a RunConfig, calls the API.

Every RunConfig leaf is a flag of the same name (train.batch_size -> --batch-size); flags
override --config FILE, which overrides the defaults. Exit codes: 0 success, 1 a worker
failed, 2 bad input (one paragraph on stderr, nothing started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from scaletrain.config import RunConfig, leaf_fields, load_toml, with_overrides

DEMO_DEFAULTS: dict[str, Any] = {
    "nproc_per_node": 2,
    "dataset": "digits",
    "model": "cnn",
    "epochs": 10,
    "batch_size": 32,
    "lr": 0.05,
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML run configuration")
    types = {"int": int, "float": float, "str": str}
    for name, (section, f) in leaf_fields().items():
        flag = "--" + name.replace("_", "-")
        where = f"[{section}] {name}" if section else name
        help_text = f"{f.metadata.get('help', '')} ({where}, default {f.default!r})"
        if f.type == "bool":
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=name, type=types[str(f.type)], default=argparse.SUPPRESS, help=help_text
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scaletrain", description="Train PyTorch models across processes and hosts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with the given configuration")
    add_config_flags(run)
    demo = sub.add_parser("demo", help="2 local workers train the built-in CNN on digits")
    add_config_flags(demo)
    return parser


def resolve_config(args: argparse.Namespace, base: dict[str, Any]) -> RunConfig:
    cfg = load_toml(args.config) if args.config else with_overrides(RunConfig(), base)
    overrides = {k: v for k, v in vars(args).items() if k in leaf_fields()}
    return with_overrides(cfg, overrides)


def cmd_run(args: argparse.Namespace, base: dict[str, Any]) -> int:
    from rich.console import Console

    from scaletrain.launch import run
    from scaletrain.metrics.progress import render_summary

    cfg = resolve_config(args, base)
    summary = run(cfg)
    if "strategy" in summary:
        render_summary(summary, Console())
    else:
        print(f"done; rank 0 ran on another node. Run directory: {summary['run_dir']}")
    return 0


def fail(message: str) -> None:
    print(f"scaletrain: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = (
        dict(DEMO_DEFAULTS, out=f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
        if args.command == "demo"
        else {}
    )
    try:
        from scaletrain.launch import LaunchFailed, WorkerFailed

        return cmd_run(args, base)
    except ValueError as e:
        fail(f"error: {e}")
        return 2
    except WorkerFailed as e:
        fail(str(e))
        return 1
    except LaunchFailed as e:
        fail(f"launch failed: {e}")
        return 1
    except KeyboardInterrupt:
        fail("interrupted; workers were stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
