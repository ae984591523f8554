"""``scaletrain plan``: which configuration trains the job soonest (or cheapest), before renting.

A configuration is a method (as ``scaletrain predict --methods``), a number of devices, the
global batch that gives, and how failures are survived. For each, the cost model
(costmodel.py) predicts the step and the samples per second; the failure model
(``costmodel.plan_failures``) gives the Young/Daly checkpoint interval at that many nodes and
the goodput, for restart from a checkpoint and, for the methods scaletrain recovers in place,
for in-place recovery. Then:

    time to train = samples to train / (samples per second x goodput)
    GPU-hours     = time to train x devices / 3600
    cost          = GPU-hours x price per GPU-hour

Configurations that miss ``--deadline``, exceed ``--budget-gpu-hours`` or a global batch
limit are set aside, each with its reason; the rest are ranked by time to train (or by cost),
and each ranked configuration says why it loses to the one above it: the factor of its time
(or cost) that moved most, among devices, efficiency (the share of a step that is not
communication, from the cost model) and goodput.

Assumptions, beyond the cost model's: a step's compute grows in proportion to the samples a
device trains (with ``--global-batch``, each device trains the global batch over the
devices); dedicated parameter servers are not counted in GPU-hours; the global batch's effect
on convergence (more samples to the same loss at a larger batch) is the user's to put into
the samples to train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from scaletrain.analysis import costmodel
from scaletrain.analysis.costmodel import Calibration

# Methods scaletrain recovers in place (--recovery inplace): the others restart from a
# checkpoint when a node fails.
INPLACE_METHODS = ("ddp", "local_sgd", "diloco")


@dataclass(frozen=True)
class Failures:
    """What failures cost: a node's mean time between failures, what a checkpoint blocks,
    a failed node's way back, and (in place) the survivors' pause."""

    node_mtbf_s: float
    checkpoint_s: float
    restart_s: float
    pause_s: float


@dataclass(frozen=True)
class Limits:
    deadline_s: float | None = None
    budget_gpu_hours: float | None = None
    max_global_batch: int | None = None


@dataclass(frozen=True)
class Option:
    method: str
    workers: int
    global_batch: int
    recovery: str  # "restart" or "inplace"
    step_s: float
    samples_per_s: float
    efficiency: float
    checkpoint_interval_s: float
    goodput: float
    time_s: float
    gpu_hours: float
    cost: float | None  # None: no price given
    excluded: str = ""  # why it was set aside ("" when it is ranked)
    loses_because: str = ""  # why it ranks below the one above it


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds from '7d', '36h', '90m', '45s' or a number of seconds."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}
    value = text.strip().lower()
    unit = value[-1] if value and value[-1] in "dhms" else ""
    try:
        seconds = float(value[: len(value) - len(unit)]) * units[unit]
    except ValueError:
        raise ValueError(f"{what}: expected a duration such as 7d, 36h or 90m, got {text!r}") \
            from None  # fmt: skip
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{what}: must be above 0, got {text!r}")
    return seconds


def configure(cal: Calibration, workers: int, global_batch: int | None) -> Calibration | None:
    """The calibration at ``workers`` devices: with a fixed global batch each device trains
    its share, and its compute scales with it (None: the batch does not split into at least
    one sample a device)."""
    if global_batch is None:
        return cal
    per_device = global_batch // workers
    if per_device < 1:
        return None
    return replace(cal, compute_s=cal.compute_s * per_device / cal.batch_size,
                   batch_size=per_device)  # fmt: skip


def options(
    cal: Calibration, methods: list[str], worker_counts: list[int], samples: float,
    failures: Failures, limits: Limits, price: float | None = None,
    global_batch: int | None = None,
) -> list[Option]:  # fmt: skip
    """Every configuration, unranked; the ones set aside say why in ``excluded``."""
    out = []
    for method in methods:
        for workers in worker_counts:
            at = configure(cal, workers, global_batch)
            if at is None:
                continue
            p = costmodel.predict_method(at, method, workers)
            f = costmodel.plan_failures(p.workers, cal.gpus_per_node, failures.node_mtbf_s,
                                        failures.checkpoint_s, failures.restart_s,
                                        failures.pause_s)  # fmt: skip
            ways = [("restart", f.goodput_restart)]
            if method.split(":")[0] in INPLACE_METHODS:
                ways.append(("inplace", f.goodput_inplace))
            for recovery, goodput in ways:
                rate = p.samples_per_s * goodput
                time_s = samples / rate if rate > 0 else math.inf
                gpu_hours = time_s * p.workers / 3600
                option = Option(
                    method=method, workers=p.workers, global_batch=at.batch_size * p.workers,
                    recovery=recovery, step_s=p.step_s, samples_per_s=p.samples_per_s,
                    efficiency=p.efficiency, checkpoint_interval_s=f.checkpoint_interval_s,
                    goodput=goodput, time_s=time_s, gpu_hours=gpu_hours,
                    cost=None if price is None else gpu_hours * price,
                )  # fmt: skip
                out.append(replace(option, excluded=_excluded(option, limits)))
            if method.startswith("pipeline"):
                break  # one pipeline: the worker count does not apply
    return out


def _excluded(o: Option, limits: Limits) -> str:
    if limits.max_global_batch is not None and o.global_batch > limits.max_global_batch:
        return f"global batch {o.global_batch:,} above {limits.max_global_batch:,}"
    if limits.deadline_s is not None and o.time_s > limits.deadline_s:
        return (f"{duration_text(o.time_s)} to train, past the deadline "
                f"({duration_text(limits.deadline_s)})")  # fmt: skip
    if limits.budget_gpu_hours is not None and o.gpu_hours > limits.budget_gpu_hours:
        return (f"{o.gpu_hours:,.0f} GPU-hours, over the budget "
                f"({limits.budget_gpu_hours:,.0f})")  # fmt: skip
    return ""


def rank(opts: list[Option], by: str = "time") -> list[Option]:
    """The options not set aside, best first (by time to train, or by cost: GPU-hours when
    no price was given; ties go to fewer devices), each saying why it loses to the one
    above."""
    if by not in ("time", "cost"):
        raise ValueError(f"plan: rank by time or cost, not {by!r}")
    kept = [o for o in opts if not o.excluded]
    if by == "time":
        kept.sort(key=lambda o: (o.time_s, o.workers, o.gpu_hours))
    else:
        kept.sort(key=lambda o: (o.gpu_hours, o.time_s, o.workers))
    return [kept[0], *(replace(b, loses_because=why_behind(a, b, by))
                       for a, b in zip(kept, kept[1:], strict=False))] if kept else []  # fmt: skip


def why_behind(a: Option, b: Option, by: str) -> str:
    """Why ``b`` ranks below ``a``: its time (or GPU-hours) over a's, and the factor of it
    that moved most. time = samples / (per-device rate x devices x efficiency x goodput),
    where the per-device rate is the same for every configuration of one global batch rule;
    GPU-hours drop the devices."""
    ratio = (b.time_s / a.time_s) if by == "time" else (b.gpu_hours / a.gpu_hours)
    what = "the time" if by == "time" else "the GPU-hours"
    factors = {
        "efficiency": a.efficiency / b.efficiency if b.efficiency else math.inf,
        "goodput": a.goodput / b.goodput if b.goodput else math.inf,
    }
    if by == "time":
        factors["devices"] = a.workers / b.workers
    # The per-device compute (a fixed global batch trains fewer samples a device at more
    # devices) is the rest of the ratio.
    name, factor = max(factors.items(), key=lambda kv: kv[1])
    if ratio < 1.005:
        return f"as good: {what} within half a percent ({ratio:.4f}x)"
    if factor <= 1.0005:
        return f"{ratio:.2f}x {what}: each device trains fewer samples a step"
    if name == "devices":
        return f"{ratio:.2f}x {what}: {b.workers:,} devices against {a.workers:,}"
    if name == "efficiency":
        return (f"{ratio:.2f}x {what}: communication leaves {b.efficiency:.1%} of its "
                f"devices' compute against {a.efficiency:.1%}")  # fmt: skip
    return (f"{ratio:.2f}x {what}: failures leave it {b.goodput:.1%} goodput against "
            f"{a.goodput:.1%} ({b.recovery} against {a.recovery})")  # fmt: skip


def duration_text(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds / 3600:,.1f} h"
