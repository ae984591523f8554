"""``scaletrain report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page about the runs.

Everything comes from each run directory's summary.json and metrics.jsonl; the plots are
drawn with matplotlib (Agg) and embedded as base64 PNGs, so the page is one file that opens
anywhere without the run directories. Per page:

- a table of the runs' headline figures;
- loss against step and against wall time (the step's sample-weighted mean over the ranks
  that report a loss);
- test accuracy during training (--eval-every) and the learning rate, against step;
- samples/s per rank against step;
- the mean step split into data, compute, communication in flight but hidden, blocked
  waiting, and checkpoint time, one bar per run;
- the job's wall time split into kept steps (goodput) and each kind of lost time;
- with runs of two or more world sizes: throughput against workers, beside the ideal
  (the smallest run's rate per worker, times the workers);
- under --balance speed: each rank's share of a step's samples, by step;
- staleness histograms, for runs whose summary.json has one (parameter-server runs), and
  the effective learning rate each applied push was given;
- for runs with failures: every rank's steps against wall-clock time, with each death and
  the moment training was running again marked.

A run directory without summary.json is refused with a message naming it (a run still going,
or one that failed, has none).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from scaletrain.io import read_jsonl  # noqa: E402


class Run:
    def __init__(self, directory: Path) -> None:
        summary = directory / "summary.json"
        if not summary.is_file():
            raise ValueError(
                f"report: {directory} has no summary.json (not a finished scaletrain run)"
            )
        self.dir = directory
        self.summary: dict[str, Any] = json.loads(summary.read_text())
        metrics = directory / "metrics.jsonl"
        self.records = read_jsonl(metrics) if metrics.is_file() else []
        s = self.summary
        self.label = f"{directory.name}: {s['strategy']} x{s['world_size']}"

    def loss_by_step(self) -> tuple[list[int], list[float], list[float]]:
        """(steps, sample-weighted mean loss, time_s of rank 0 or the first reporter)."""
        sums: dict[int, list[float]] = {}
        times: dict[int, float] = {}
        for r in self.records:
            if r.get("loss") is not None and r["samples"]:
                acc = sums.setdefault(r["step"], [0.0, 0.0])
                acc[0] += r["loss"] * r["samples"]
                acc[1] += r["samples"]
            times.setdefault(r["step"], r["unix_time"])
        start = min(times.values(), default=0.0)
        steps = sorted(sums)
        return (
            steps,
            [sums[s][0] / sums[s][1] for s in steps],
            [times[s] - start for s in steps],
        )

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """A per-step figure every rank records alike (lr, test_accuracy), by step."""
        by_step = {r["step"]: r[key] for r in self.records if r.get(key) is not None}
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def plot_loss(runs: list[Run]) -> str:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 3.8))
    values: list[float] = []
    for run in runs:
        steps, loss, seconds = run.loss_by_step()
        by_step.plot(steps, loss, label=run.label)
        by_time.plot(seconds, loss, label=run.label)
        values += loss
    # Log scale once the loss spans decades; a linear one reads better over a short run.
    scale = "log" if values and min(values) > 0 and max(values) / min(values) > 20 else "linear"
    by_step.set(xlabel="step", ylabel="training loss", yscale=scale, title="loss by step")
    by_time.set(xlabel="wall time (s)", ylabel="training loss", yscale=scale,
                title="loss by wall time")  # fmt: skip
    by_step.legend(fontsize=8)
    return png(fig)


def plot_eval(runs: list[Run]) -> str | None:
    """Test accuracy during training (--eval-every), by step; None when no run scored."""
    scored = [(run, run.series("test_accuracy")) for run in runs]
    if not any(steps for _, (steps, _) in scored):
        return None
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for run, (steps, values) in scored:
        if steps:
            ax.plot(steps, values, marker=".", label=run.label)
    ax.set(xlabel="step", ylabel="test accuracy", title="evaluation during training")
    ax.legend(fontsize=8)
    return png(fig)


def constant_lr(runs: list[Run]) -> float | None:
    """The learning rate every run trained with at every step, when there is one."""
    rates = {v for run in runs for v in run.series("lr")[1]}
    return rates.pop() if len(rates) == 1 else None


def plot_lr(runs: list[Run]) -> str | None:
    """The learning rate by step; None when it never changed (or no run recorded one)."""
    if not any(run.series("lr")[0] for run in runs) or constant_lr(runs) is not None:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for run in runs:
        steps, values = run.series("lr")
        if steps:
            ax.plot(steps, values, label=run.label)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax.legend(fontsize=8)
    return png(fig)


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_rank_rates(runs: list[Run]) -> str:
    """Each rank's samples/s per step: the raw points faint (one step is noisy: a
    collective's wait, a checkpoint), a rolling mean over them as the line to read."""
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for run in runs:
        ranks = sorted({r["rank"] for r in run.records})
        for rank in ranks:
            mine = [r for r in run.records if r["rank"] == rank and r["step_s"] > 0]
            steps = [r["step"] for r in mine]
            rates = [r["samples"] / r["step_s"] for r in mine]
            window = max(5, len(rates) // 20)
            (line,) = ax.plot(steps, rolling_mean(rates, window), linewidth=1.2,
                              label=f"{run.dir.name} rank {rank}")  # fmt: skip
            ax.scatter(steps, rates, s=3, alpha=0.25, color=line.get_color())
    title = "samples per second of each rank (dots: each step; line: rolling mean)"
    ax.set(xlabel="step", ylabel="samples/s", title=title)
    ax.legend(fontsize=7, ncol=4)
    return png(fig)


def plot_breakdown(runs: list[Run]) -> str:
    """Mean step per rank: data, compute, hidden communication, blocked, checkpoint."""
    parts = ("data", "compute", "blocked on communication", "checkpoint")
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(runs) + 1.8))
    for i, run in enumerate(runs):
        t, steps = run.summary["time_breakdown"], max(run.summary["steps"], 1)
        values = [t["data_s"], t["compute_s"], t["wait_s"], t["checkpoint_s"]]
        left = 0.0
        for part, value, color in zip(parts, values, ("#999", "#4c72b0", "#c44e52", "#dd8452"),
                                      strict=True):  # fmt: skip
            ms = value / steps * 1e3
            ax.barh(i, ms, left=left, color=color, label=part if i == 0 else None)
            left += ms
    ax.set_yticks(range(len(runs)), [r.label for r in runs], fontsize=8)
    ax.set(xlabel="ms per step (mean over ranks)", title="where a step's time goes")
    ax.legend(fontsize=8, loc="lower right")
    return png(fig)


LOST = ("startup_s", "redone_s", "checkpoint_s", "between_steps_s", "failure_detection_s",
        "restart_s", "between_job_runs_s", "finish_s")  # fmt: skip


def plot_job_time(runs: list[Run]) -> str | None:
    """The job's wall time per run: kept steps (goodput), then each kind of lost time."""
    with_job = [r for r in runs if r.summary.get("goodput") is not None]
    if not with_job:
        return None
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(with_job) + 1.8))
    colors = ("#55a868", "#999", "#c44e52", "#dd8452", "#64b5cd", "#8172b2", "#937860", "#da8bc3",
              "#ccb974")  # fmt: skip
    for i, run in enumerate(with_job):
        s = run.summary
        values = [s["goodput"] * s["wall_s"], *(s["time_lost"].get(k, 0.0) for k in LOST)]
        left = 0.0
        for name, value, color in zip(("kept steps", *LOST), values, colors, strict=True):
            label = name.removesuffix("_s").replace("_", " ") if i == 0 else None
            ax.barh(i, value, left=left, color=color, label=label)
            left += value
    ax.set_yticks(range(len(with_job)), [r.label for r in with_job], fontsize=8)
    ax.set(xlabel="seconds of the job's wall time", title="where the job's time went (goodput)")
    ax.legend(fontsize=8, loc="lower right", ncol=4)
    return png(fig)


def plot_scaling(runs: list[Run]) -> str | None:
    by_world: dict[int, float] = {}
    for run in runs:
        rate = run.summary.get("samples_per_s")
        if rate:
            world = run.summary["world_size"]
            by_world[world] = max(rate, by_world.get(world, 0.0))
    if len(by_world) < 2:
        return None
    worlds = sorted(by_world)
    per_worker = by_world[worlds[0]] / worlds[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(worlds, [by_world[w] for w in worlds], "o-", label="measured")
    ax.plot(worlds, [per_worker * w for w in worlds], "--", color="gray", label="ideal")
    ax.set(xlabel="workers", ylabel="samples/s", title="scaling", xticks=worlds)
    ax.legend()
    return png(fig)


STARTUP = ("launch_s", "imported_s", "group_s", "model_s", "first_step_s")


def plot_where_time_goes(runs: list[Run]) -> str | None:
    """Against world size (runs of two or more sizes): start-up by phase and the finish, and
    a step split into compute, communication and the rest (the loop's own share)."""
    sized = sorted((r for r in runs if r.summary.get("startup")),
                   key=lambda r: r.summary["world_size"])  # fmt: skip
    if len({r.summary["world_size"] for r in sized}) < 2:
        return None
    fig, (start, step) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r.summary['world_size']}\n{r.summary['strategy']}" for r in sized]
    x = list(range(len(sized)))
    bottom = [0.0] * len(sized)
    for phase in (*STARTUP, "finish_s"):
        values = [
            (r.summary.get("time_lost", {}) if phase == "finish_s" else r.summary["startup"]).get(
                phase, 0.0
            )
            or 0.0
            for r in sized
        ]
        start.bar(x, values, bottom=bottom, label=phase.removesuffix("_s").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    start.set(xticks=x, xticklabels=labels, ylabel="seconds",
              title="launch to first step, by phase; and last step to summary")  # fmt: skip
    start.legend(fontsize=7)
    parts: dict[str, list[float]] = {"compute": [], "communication (blocked)": [], "rest": []}
    for r in sized:
        s = r.summary
        steps = max(s.get("steps") or 1, 1)
        t = s["time_breakdown"]
        compute, blocked = t["compute_s"] / steps, (t["wait_s"] + t["data_s"]) / steps
        whole = (s.get("train_wall_s") or 0.0) / steps
        parts["compute"].append(1e3 * compute)
        parts["communication (blocked)"].append(1e3 * blocked)
        parts["rest"].append(1e3 * max(whole - compute - blocked, 0.0))
    bottom = [0.0] * len(sized)
    for name, values in parts.items():
        step.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    step.set(xticks=x, xticklabels=labels, ylabel="ms per step",
             title="a step: compute, blocked on communication, the rest")  # fmt: skip
    step.legend(fontsize=7)
    return png(fig)


def plot_shares(runs: list[Run]) -> str | None:
    """--balance speed: each rank's share of a step's samples, by step."""
    balanced = [run for run in runs if any(r.get("share") is not None for r in run.records)]
    if not balanced:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for run in balanced:
        for rank in sorted({r["rank"] for r in run.records}):
            mine = sorted((r["step"], r["share"]) for r in run.records
                          if r["rank"] == rank and r.get("share") is not None)  # fmt: skip
            ax.step([m[0] for m in mine], [m[1] for m in mine], where="post",
                    label=f"{run.dir.name} rank {rank}")  # fmt: skip
    ax.set(xlabel="step", ylabel="share of the step's samples", ylim=(0, None),
           title="--balance speed: each rank's share")  # fmt: skip
    ax.legend(fontsize=7, ncol=4)
    return png(fig)


def plot_staleness(runs: list[Run]) -> str | None:
    """Parameter-server runs: the histogram of applied gradients by staleness, and the
    effective learning rate of each applied push (--lr times its factor: the schedule's and
    the staleness rule's), by wall time."""
    with_hist = [r for r in runs if r.summary.get("staleness_histogram")]
    if not with_hist:
        return None
    fig, (hist_ax, lr_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in with_hist:
        hist = {int(k): v for k, v in run.summary["staleness_histogram"].items()}
        hist_ax.bar(list(hist), list(hist.values()), alpha=0.6, label=run.label)
        pushes = [r for r in run.records if r.get("committed") and r.get("lr") is not None]
        if pushes:
            start = min(r["unix_time"] for r in run.records)
            lr_ax.plot([r["unix_time"] - start for r in pushes], [r["lr"] for r in pushes], ".",
                       markersize=3, label=run.label)  # fmt: skip
    hist_ax.set(xlabel="staleness (versions)", ylabel="applied gradients", title="staleness")
    hist_ax.legend(fontsize=8)
    lr_ax.set(xlabel="wall time (s)", ylabel="learning rate applied",
              title="the effective lr of each applied push")  # fmt: skip
    return png(fig)


def plot_recoveries(run: Run) -> str:
    fig, ax = plt.subplots(figsize=(11, 3.8))
    start = min(r["unix_time"] for r in run.records)
    for rank in sorted({r["rank"] for r in run.records}):
        mine = [r for r in run.records if r["rank"] == rank]
        ax.plot([r["unix_time"] - start for r in mine], [r["step"] for r in mine], ".",
                markersize=2, label=f"rank {rank}")  # fmt: skip
    for i, rec in enumerate(run.summary["recoveries"]):
        failed_at = rec.get("failed_at")
        if failed_at is None and rec.get("detected_at") and rec.get("detected_s") is not None:
            failed_at = rec["detected_at"] - rec["detected_s"]
        if failed_at:
            ax.axvline(failed_at - start, color="red", linestyle="--",
                       label="failure" if i == 0 else None)  # fmt: skip
            if rec.get("detected_s") is not None and rec.get("resumed_s") is not None:
                back = failed_at - start + rec["detected_s"] + rec["resumed_s"]
                ax.axvline(back, color="green", linestyle=":",
                           label="training again" if i == 0 else None)  # fmt: skip
    ax.set(xlabel="wall time (s)", ylabel="step", title=f"{run.label}: steps and failures")
    ax.legend(fontsize=8)
    return png(fig)


def headline_rows(runs: list[Run]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for run in runs:
        s = run.summary
        rows.append(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
                run.dir.name, s["strategy"], s["world_size"], s["steps"],
                fmt(s.get("samples_per_s"), ",.0f"), fmt(s.get("final_loss"), ".4f"),
                fmt(s.get("test_accuracy"), ".2%"), f"{s.get('comm_share', 0):.0%}",
                f"{s.get('comm_bytes_per_step', 0) / 1e6:.2f}", len(s.get("recoveries", [])),
            )) + "</tr>"
        )  # fmt: skip
    head = ("run", "strategy", "workers", "steps", "samples/s", "final loss", "test accuracy",
            "comm share", "MB sent/step/rank", "recoveries")  # fmt: skip
    return (
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
        + "".join(rows) + "</table>"
    )  # fmt: skip


def build_report(run_dirs: list[Path]) -> str:
    runs = [Run(d) for d in run_dirs]
    sections = [("Runs", headline_rows(runs))]

    def image(title: str, data: str | None, why_not: str = "") -> None:
        """A plot; where it has no data, one line that says why (or nothing at all)."""
        if data is not None:
            alt = html.escape(title)
            sections.append((title, f'<img alt="{alt}" src="data:image/png;base64,{data}">'))
        elif why_not:
            sections.append((title, f'<p class="none">{html.escape(why_not)}</p>'))

    image("Loss", plot_loss(runs))
    image("Test accuracy during training", plot_eval(runs),
          "Not scored during training (--eval-every N scores the test split every N steps); "
          "the final test accuracy is in the table above.")  # fmt: skip
    rate = constant_lr(runs)
    image("Learning rate", plot_lr(runs),
          f"Constant: {rate:g} at every step (--lr-schedule constant, no warmup)."
          if rate is not None else "")  # fmt: skip
    image("Samples per second per rank", plot_rank_rates(runs))
    image("Step time breakdown", plot_breakdown(runs))
    image("The job's time", plot_job_time(runs))
    image("Scaling", plot_scaling(runs))
    image("Where the time goes, by world size", plot_where_time_goes(runs))
    image("Balance", plot_shares(runs))
    image("Staleness", plot_staleness(runs))
    for run in runs:
        if run.summary.get("recoveries") and run.records:
            image(f"Recoveries of {run.dir.name}", plot_recoveries(run))
    body = "\n".join(f"<h2>{html.escape(t)}</h2>\n{content}" for t, content in sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>scaletrain report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>scaletrain report</h1>
{body}
</body></html>
"""


def write_report(run_dirs: list[Path], out: Path) -> Path:
    text = build_report(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out
