"""The launcher's live view of rank 0 (progress bar) and the end-of-run summary table.

Rendering happens in the launcher process, not in a worker: a thread tails DIR/metrics.jsonl
and shows rank 0's latest step, loss, throughput of the whole job and communication share over
a sliding window. Workers pay one small file append per step for it and never draw anything.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class ProgressView:
    def __init__(self, metrics_path: Path, *, enabled: bool = True, window: int = 20) -> None:
        console = Console(stderr=True)
        self.path = metrics_path
        self.enabled = enabled
        # A live bar is for a terminal. Elsewhere (a log file, CI) one plain line per tenth of
        # the run says the same without flooding the log.
        self.live = console.is_terminal
        self._console = console
        self._next_line_step = 0
        self.window: deque[dict[str, Any]] = deque(maxlen=window)
        self._offset = 0
        self._partial = b""
        self._loss: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scaletrain-progress")
        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TextColumn("comm {task.fields[comm]} overlap {task.fields[overlap]}"),
            TextColumn("{task.fields[mb]} MB/step"),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,  # redraw only when a poll brings news, at most twice a second
        )
        self._task: Any = None

    def __enter__(self) -> ProgressView:
        if self.enabled:
            if self.live:
                self._progress.start()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=5)
            self.poll()
            if self.live:
                self._progress.stop()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.poll()

    def _new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def poll(self) -> None:
        for record in self._new_records():
            if record.get("rank") == 0:
                self.window.append(record)
            # Under pipeline parallelism only the last stage has a loss: take any rank's.
            if record.get("loss") is not None:
                self._loss = record["loss"]
        if not self.window:
            return
        last = self.window[-1]
        fields = {
            "epoch": last["epoch"] + 1,
            "loss": "-" if self._loss is None else f"{self._loss:.4f}",
            "rate": f"{self.rate():,.0f}",
            "comm": f"{self.comm_share():.0%}",
            "overlap": f"{self.mean('overlap'):.0%}",
            "mb": f"{self.mean('comm_bytes') / 1e6:.2f}",
        }
        if not self.live:
            self._print_line(last, fields)
            return
        if self._task is None:
            self._task = self._progress.add_task("train", total=last["total_steps"], **fields)
        self._progress.update(self._task, completed=last["step"], **fields)
        self._progress.refresh()

    def _print_line(self, last: dict[str, Any], fields: dict[str, Any]) -> None:
        if last["step"] < self._next_line_step:
            return
        total = last["total_steps"]
        self._next_line_step = last["step"] + max(1, total // 10)
        self._console.print(
            f"step {last['step']}/{total} epoch {fields['epoch']} loss {fields['loss']} "
            f"{fields['rate']} samples/s comm {fields['comm']} overlap {fields['overlap']} "
            f"{fields['mb']} MB/step",
            highlight=False,
            soft_wrap=True,  # one line per report in a log, however narrow the console
        )

    def rate(self) -> float:
        """Samples per second of the whole job over the window (rank 0's clock)."""
        if len(self.window) < 2:
            last = self.window[-1]
            return float(last["global_samples"] / last["step_s"]) if last["step_s"] else 0.0
        span = self.window[-1]["time_s"] - self.window[0]["time_s"]
        samples = sum(r["global_samples"] for r in list(self.window)[1:])
        return samples / span if span > 0 else 0.0

    def mean(self, key: str) -> float:
        values = [r.get(key) or 0.0 for r in self.window]
        return sum(values) / len(values) if values else 0.0

    def comm_share(self) -> float:
        step = sum(r["step_s"] for r in self.window)
        return sum(r["comm_s"] for r in self.window) / step if step > 0 else 0.0


def count(n: int, noun: str) -> str:
    """``n`` of ``noun``: 1 worker, 2 workers."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def describe_recovery(r: dict[str, Any]) -> str:
    """One line per recovery, e.g. 'rank 1 death before step 60: detected in 0.3 s, training
    again 3.1 s later from the checkpoint of step 55 (4 steps redone)'."""
    who = f"rank {r['rank']}" if r.get("rank") is not None else "a worker"
    what = f"{who} {r.get('cause', 'failure')}"
    if r.get("cause") == "node-joined":  # not a failure: the world was stopped to grow
        what = "a node joined"
    if r["kind"] == "inplace":
        line = f"in place: {what} at step {r.get('failed_step')}; the other workers"
        if r.get("detected_s") is None:
            return line + " did not train again"
        line += (
            f" noticed in {r['detected_s']:.1f} s and trained on {r['resumed_s']:.1f} s later "
            f"with {count(r.get('world_size') or 0, 'worker')}, no rollback"
        )
        if r.get("rejoined_step"):
            line += f"; it rejoined at step {r['rejoined_step']} ({r['rejoin_s']:.1f} s)"
        if r.get("healed_bytes"):
            line += f", healed {r['healed_bytes'] / 1e6:.1f} MB from a peer in {r['heal_s']:.2f} s"
        return line
    if r["kind"].startswith("ps-"):
        return describe_ps_recovery(r, what)
    if r.get("failed_step"):
        what += f" at step {r['failed_step']}"
    timing = []
    if r.get("detected_s") is not None:
        timing.append(f"detected in {r['detected_s']:.1f} s")
    if r.get("resumed_s") is not None:
        timing.append(f"training again {r['resumed_s']:.1f} s later")
    where = f"from the checkpoint of step {r['step']}" if r.get("step") else "from the start"
    return (
        f"{r['kind']}: {what}; " + (", ".join(timing) + " " if timing else "") + where
        + f" ({r.get('lost_steps', 0)} steps redone, {count(r.get('world_size') or 0, 'worker')})"
    )  # fmt: skip


def describe_ps_recovery(r: dict[str, Any], what: str) -> str:
    if r["kind"] == "ps-drop":
        return (
            f"parameter server: worker {r['rank']} dropped from a bsp step by server {r['server']}"
        )
    if r["kind"] == "ps-server":
        line = f"server {r['server']} ({what})"
        if r.get("resumed_s") is None:
            return line + "; not restarted"
        source = "its backup's copy" if r.get("restored_from") == "backup" else "its checkpoint"
        if r.get("taken_over_by") is not None:
            return line + (
                f" lost for good; rank {r['taken_over_by']}, its backup, served its slice "
                f"{r['resumed_s']:.1f} s later from its copy of version {r['restored_version']}"
            )
        return line + (
            f" restarted and serving {r['resumed_s']:.1f} s later from {source} of "
            f"version {r['restored_version']}; the workers reconnected"
        )
    line = f"worker {what}: its {r.get('requeued_samples', 0)} leased samples were dealt again"
    if r.get("others_next_step_s") is not None:
        line += f"; the others' next step came {r['others_next_step_s']:.2f} s later"
    if r.get("rejoined_step"):
        line += f"; it rejoined at step {r['rejoined_step']} ({r['resumed_s']:.1f} s)"
    return line


def job_time_line(summary: dict[str, Any]) -> str:
    """The job's wall time, its goodput, and where the rest went (the largest items)."""
    line = f"{summary['wall_s']:.2f} s"
    if summary.get("goodput") is None:
        return line
    lost = sorted(((v, k) for k, v in summary.get("time_lost", {}).items() if v >= 0.05),
                  reverse=True)[:3]  # fmt: skip
    items = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for v, k in lost)
    return f"{line}, goodput {summary['goodput']:.0%}" + (f" (lost: {items})" if items else "")


def checkpointing_line(c: dict[str, Any]) -> str:
    """How often the loop checkpointed, and (with an MTBF) what that costs."""
    every = c.get("interval_steps")
    line = f"every {every} steps" if every else "only at the end"
    if c["mode"] == "auto":
        line = f"auto: {line}"
    if c.get("interval_s") is not None:
        line += f" ({c['interval_s']:.1f} s)"
    if c.get("cost_s") is not None:
        line += f"; a save blocks {c['cost_s'] * 1e3:.0f} ms"
    if c.get("predicted_overhead") is not None:
        line += f"; predicted overhead {c['predicted_overhead']:.1%} at MTBF {c['mtbf_s']:g} s"
    return line


def render_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    t = summary["time_breakdown"]
    table = Table(title="scaletrain run summary", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    rows = [
        (
            "strategy",
            (
                f"ps {ps['consistency']}"
                + (f"({ps['staleness_bound']})" if ps["staleness_bound"] is not None else "")
                + f": {count(ps['num_workers'], 'worker')}, {count(ps['num_servers'], 'server')} "
                if (ps := summary.get("ps"))
                else f"{summary['strategy']} on {count(summary['world_size'], 'worker')} "
            )
            + f"({summary['backend']}, {summary['device']})",
        ),
        (
            "steps / samples",
            f"{summary['steps']} / {summary['samples']:,} "
            f"(global batch {summary['global_batch_size']})",
        ),
        ("wall time", job_time_line(summary)),
        (
            "throughput",
            f"{_fmt(summary['samples_per_s'], ',.0f')} samples/s over the job; "
            f"{_fmt(summary.get('train_samples_per_s'), ',.0f')} while training",
        ),
        *(
            [("checkpoints", checkpointing_line(c))]
            if (c := summary.get("checkpointing")) and c.get("mode") != "none"
            else []
        ),
        ("final loss", _fmt(summary["final_loss"], ".4f")),
        (
            "test accuracy",
            "-" if summary["test_accuracy"] is None else f"{summary['test_accuracy']:.2%}",
        ),
        (
            "time per rank",
            f"compute {t['compute_s']:.2f} s, comm {t['comm_s']:.2f} s, "
            f"wait {t['wait_s']:.2f} s, data {t['data_s']:.2f} s",
        ),
        (
            "communication",
            f"{summary['comm_share']:.0%} of step time in flight, "
            f"{summary['wait_share']:.0%} blocked, overlap {summary['overlap']:.0%}; "
            f"{summary['comm_bytes_per_step'] / 1e6:.2f} MB sent per step per rank"
            + (
                f" ({summary['compression_ratio']:.1f}x compressed)"
                if summary.get("compression_ratio") and summary["compression_ratio"] > 1.001
                else ""
            ),
        ),
        (
            "memory per rank",
            f"training state {summary.get('max_rank_state_bytes', 0) / 1e6:.1f} MB "
            f"(parameters, gradients, optimizer, copies), process peak "
            f"{summary.get('max_rank_peak_rss_bytes', 0) / 1e6:.0f} MB",
        ),
        ("params sha256", summary["params_sha256"][:16] + "..."),
    ]
    if pipe := summary.get("pipeline"):
        rows.insert(1, (
            "pipeline",
            f"{pipe['stages']} stages x {pipe['data_parallel']} data parallel, "
            f"{pipe['microbatches']} microbatches ({pipe['schedule']}); bubble "
            f"{_fmt(pipe['bubble_measured'], '.0%')} measured, "
            f"{pipe['bubble_theoretical']:.0%} in theory",
        ))  # fmt: skip
    if "staleness_histogram" in summary:
        hist = summary["staleness_histogram"]
        rows.insert(-1, ("staleness", ", ".join(f"{k}: {v}" for k, v in hist.items())
                         + " (updates between pull and push: applied gradients)"))  # fmt: skip
    rows[-1:-1] = [("recovery", describe_recovery(r)) for r in summary.get("recoveries", [])]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"run directory: [bold]{summary['run_dir']}[/bold]")
