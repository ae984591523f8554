"""Claim: the pipeline's idle time (its bubble) is what the schedule predicts, (P-1)/(M+P-1)
for P stages and M microbatches, and pipeline and fsdp hold a fraction of ddp's per-rank state.

Bubble: P stages of equal work (L identical blocks, split evenly by --split-points), one
process each, --max-steps steps per configuration; the measured bubble is summary.json's
1 - busy / wall over all stages and steps (each stage's busy time: its forward and backward
chunks; the first step, which also infers shapes, left out). 1F1B where M >= P, else GPipe
(1F1B needs M >= P). Floor: within 10% relative of theory for M >= P.

Two kinds of stage work:
- "device": each block stands for an accelerator: its forward sleeps --device-ms (5 ms) per
  sample, its backward twice that, on top of a small real Linear. Sleeping stages do not
  compete for this machine's cores, so P stages behave as P devices would, and the figure
  tests the schedule and its send/recv, not the host. This is the row the floor applies to.
  The formula leaves out the schedule's own cost per microbatch: on this host about 0.35 ms
  per hop (torch's schedule bookkeeping and a gloo send/recv on loopback), which 1F1B pays
  twice per microbatch as idle time. At 5 ms a microbatch is 120-240 ms of work even at M=16,
  as on accelerators, where a hop takes tens of microseconds; with less work per microbatch
  (--device-ms 1.25) that fixed cost shows at M=16.
- "cpu": each block is a real 1024x1024 Linear + ReLU computed on one core. These rows are
  printed, not judged: on a shared host each stage's speed varies from step to step and the
  slower stage sets the pace, which adds idle time the schedule does not cause; with P above
  the core count, stages also share cores and their busy times stretch.

Memory: the same cpu model (8.4M parameters, Adam) on 2 ranks under ddp, fsdp and pipeline:
per-rank training state (parameters, gradients, optimizer) and peak process RSS.

    python benchmarks/pipeline_bubble.py [--stages 2,4] [--microbatches 1,2,4,8,16]
        [--kinds device,cpu] [--device-ms 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from floors import Floors  # noqa: E402
from sleeping_device import DeviceTime  # noqa: E402
from torch import nn  # noqa: E402

import scaletrain  # noqa: E402
from scaletrain.config import RunConfig, with_overrides  # noqa: E402
from scaletrain.data.datasets import build_dataset  # noqa: E402
from scaletrain.task import Task  # noqa: E402

FLOORS = Floors()

HIDDEN = 1024
BLOCKS = 8
BATCH = 64
# Per sample and block, forward; the workers read it from the environment (--device-ms).
DEVICE_MS_PER_SAMPLE = float(os.environ.get("BENCH_DEVICE_MS", "5"))


class DeviceBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = DeviceTime.apply(x, DEVICE_MS_PER_SAMPLE * 1e-3 * x.shape[0])
        return torch.relu(self.linear(x))


def build_model(kind: str, in_features: int, classes: int) -> nn.Sequential:
    width = HIDDEN if kind == "cpu" else 64

    def block() -> nn.Module:
        if kind == "cpu":
            return nn.Sequential(nn.Linear(width, width), nn.ReLU())
        return DeviceBlock(width)

    layers = [nn.Flatten(), nn.Linear(in_features, width)]
    layers += [block() for _ in range(BLOCKS)]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def build_task(cfg: RunConfig) -> Task:
    """The workers' task: synthetic 8x8 images, the model kind from the environment."""
    train = build_dataset("synthetic", "train", num_samples=cfg.data.num_samples, image_size=8)
    test = build_dataset("synthetic", "test", num_samples=cfg.data.num_samples, image_size=8)
    in_features = 3 * 8 * 8
    model = build_model(os.environ["BENCH_STAGE_KIND"], in_features, train.num_classes)
    return Task(model=model, train_data=train, test_data=test)


def split_points(stages: int) -> str:
    """Top-level names that begin stages 2..P: blocks are layers 2..BLOCKS+1."""
    per = BLOCKS // stages
    return ",".join(str(2 + per * s) for s in range(1, stages))


def run(out: Path, kind: str, world: int, **overrides: Any) -> dict[str, Any]:
    os.environ["BENCH_STAGE_KIND"] = kind
    cfg = with_overrides(
        RunConfig(),
        {
            "out": str(out),
            "nproc_per_node": world,
            "task": f"{Path(__file__).resolve()}:build_task",
            "num_samples": BATCH * 40,
            "batch_size": BATCH,
            "drop_last": True,
            "num_threads": 1,
            "seed": 0,
            **overrides,
        },
    )
    return scaletrain.run(cfg, show_progress=False)


def bubble_rows(args: argparse.Namespace, tmp: Path) -> None:
    cores = os.cpu_count() or 1
    rows = []
    for kind in args.kinds.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            for m in (int(m) for m in args.microbatches.split(",")):
                schedule = "1f1b" if m >= stages else "gpipe"
                summary = run(tmp / f"{kind}-{stages}-{m}", kind, stages, strategy="pipeline",
                              stages=stages, microbatches=m, schedule=schedule,
                              split_points=split_points(stages), max_steps=args.steps)  # fmt: skip
                pipe = summary["pipeline"]
                measured, theory = pipe["bubble_measured"], pipe["bubble_theoretical"]
                rel = abs(measured - theory) / theory
                judged = m >= stages and kind == "device"
                note = (
                    f"  ({stages} stages share {cores} cores)"
                    if kind == "cpu" and stages > cores
                    else ""
                )
                verdict = (
                    FLOORS.check(f"{kind} P={stages} M={m}: bubble within 10% of theory",
                                 rel <= 0.10)
                    if judged else "-"
                )  # fmt: skip
                print(f"{kind:<7} {stages:>2} {m:>3} {schedule:<6} {measured:>9.1%} {theory:>7.1%} "
                      f"{rel:>7.1%} {verdict:>5}{note}", flush=True)  # fmt: skip
                rows.append([kind, stages, m, schedule, f"{measured:.1%}", f"{theory:.1%}",
                             f"{rel:.1%}", verdict])  # fmt: skip
    FLOORS.table(
        "the bubble, measured against (P-1)/(M+P-1)",
        ["stage work", "P", "M", "schedule", "measured", "theory", "relative error", "floor 10%"],
        rows,
        f"device: blocks that sleep {args.device_ms} ms per sample forward (twice that "
        "backward), as accelerators; cpu: real compute on this host's cores, not judged.",
    )
    FLOORS.headline(
        "pipeline bubble against (P-1)/(M+P-1), P = 2 and 4, M >= P",
        f"within 10% in {sum(r[7] == 'PASS' for r in rows)} of "
        f"{sum(r[7] != '-' for r in rows)} judged configurations",
    )


def memory_rows(tmp: Path) -> None:
    print("\nper-rank memory, 2 ranks, cpu model (8.4M parameters), Adam:")
    print(f"{'strategy':<9} {'params MB':>9} {'grads MB':>9} {'optim MB':>9} {'state MB':>9} "
          f"{'peak RSS MB':>11}")  # fmt: skip
    rows = []
    for strategy in ("ddp", "fsdp", "pipeline"):
        extra = (
            {"split_points": split_points(2), "microbatches": 4} if strategy == "pipeline" else {}
        )
        summary = run(tmp / f"mem-{strategy}", "cpu", 2, strategy=strategy, optimizer="adam",
                      lr=0.001, max_steps=4, **extra)  # fmt: skip
        ranks = summary["per_rank"]
        top = max(ranks, key=lambda r: sum(r["memory"].values()))["memory"]
        print(f"{strategy:<9} {top['param_bytes'] / 1e6:>9.1f} {top['grad_bytes'] / 1e6:>9.1f} "
              f"{top['optimizer_bytes'] / 1e6:>9.1f} {summary['max_rank_state_bytes'] / 1e6:>9.1f} "
              f"{summary['max_rank_peak_rss_bytes'] / 1e6:>11.0f}", flush=True)  # fmt: skip
        sizes = (top["param_bytes"], top["grad_bytes"], top["optimizer_bytes"],
                 summary["max_rank_state_bytes"])  # fmt: skip
        rss = summary["max_rank_peak_rss_bytes"] / 1e6
        rows.append([strategy, *(f"{v / 1e6:.1f} MB" for v in sizes), f"{rss:.0f} MB"])
    FLOORS.table("per-rank memory, 2 ranks, the cpu model (8.4M parameters), Adam",
                 ["strategy", "parameters", "gradients", "optimizer", "training state",
                  "peak RSS"], rows)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--kinds", default="device,cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device-ms", type=float, default=DEVICE_MS_PER_SAMPLE)
    args = parser.parse_args()
    os.environ["BENCH_DEVICE_MS"] = str(args.device_ms)
    print(f"{BLOCKS} equal blocks split evenly, batch {BATCH}, {args.steps} steps (first left "
          f"out); device blocks: {args.device_ms} ms per sample forward")  # fmt: skip
    print(f"{'stage':<7} {'P':>2} {'M':>3} {'sched':<6} {'measured':>9} {'theory':>7} "
          f"{'rel err':>7} {'floor':>5}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        bubble_rows(args, Path(tmp))
        memory_rows(Path(tmp))
    FLOORS.finish()


if __name__ == "__main__":
    main()
