"""In-place recovery, launcher side: host torchft's lighthouse, start one worker process per
replica, and when one dies restart only that one (up to --max-restarts times each) while the
others keep training (fault/inplace.py). torch's elastic agent cannot do this: it stops and
restarts the whole group on any failure.

Each death is recorded in logs/incidents.jsonl and, at the end, in summary.json's
``recoveries`` with times read back from metrics.jsonl: ``detected_s``, from the death to the
survivors' next quorum without the dead replica (the lighthouse notices a missing heartbeat
after HEARTBEAT_TIMEOUT_MS); ``resumed_s``, from there to their first committed step; and for
a restarted replica ``rejoined_step`` and ``rejoin_s`` (relaunch to its first committed step,
most of it a fresh Python importing torch). ``lost_steps`` is 0 by construction: nothing rolls
back; a step that was in flight is not applied and its samples are trained in the next one.

The lighthouse binds to loopback: the mode runs on one node for now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from scaletrain.config import RunConfig
from scaletrain.fault.checkpoint import atomic_write_json
from scaletrain.fault.fleet import ProcessFleet
from scaletrain.fault.inplace import LIGHTHOUSE_ENV, read_finals
from scaletrain.metrics.logs import tail
from scaletrain.metrics.summary import RankTotals, build_summary

# The lighthouse drops a replica whose heartbeats (every 100 ms) stop for this long.
HEARTBEAT_TIMEOUT_MS = 500
# How long a quorum waits for replicas that are alive but have not asked to join yet.
JOIN_TIMEOUT_MS = 100


class InplaceFailed(RuntimeError):
    """Every replica failed for good."""


class Supervisor(ProcessFleet):
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        # The lighthouse logs every quorum at INFO from Rust, into the launcher's terminal.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.coordination import LighthouseServer

        super().__init__(run_dir, cfg.launch.nproc_per_node, cfg.launch.max_restarts)
        self.cfg = cfg
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )

    def env(self, rank: int) -> dict[str, str]:
        return {
            **super().env(rank),
            LIGHTHOUSE_ENV: self.lighthouse.address(),
            "SCALETRAIN_RECOVERY": "inplace",
        }

    def may_restart(self, rank: int) -> bool:
        # Once a replica has finished, the run is over: nothing to rejoin.
        return super().may_restart(rank) and not self.finished

    def kind(self, rank: int) -> str:
        return "inplace"

    def run(self, ranks: range | list[int] | None = None) -> None:
        try:
            super().run(ranks)
        finally:
            self.lighthouse.shutdown()
        if not self.finished:
            last = self.deaths[-1] if self.deaths else {"rank": 0, "cause": "no replica finished"}
            log = self.run_dir / "logs" / f"rank{last['rank']}.log"
            raise InplaceFailed(
                f"every replica failed; the last, rank {last['rank']}, {last['cause']}. "
                f"Last lines of {log}:\n" + "\n".join(tail(log))
            )

    def recoveries(self) -> list[dict[str, Any]]:
        """Each death, timed from the steps in metrics.jsonl."""
        path = self.run_dir / "metrics.jsonl"
        records = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        out = []
        for death in self.deaths:
            rank, died = death["rank"], death["died_at"]
            mine = [r for r in records if r["rank"] == rank and r["attempt"] == death["attempt"]]
            after = sorted((r for r in records if r["rank"] != rank and r["unix_time"] > died),
                           key=lambda r: r["unix_time"])  # fmt: skip
            entry = {
                "kind": "inplace",
                "rank": rank,
                "cause": death["cause"],
                "failed_step": max((r["step"] for r in mine), default=0) + 1,
                "failed_at": died,
                "lost_steps": 0,
                "world_size": after[0]["participants"] if after else None,
                "step": after[0]["step"] - 1 if after else None,
                "detected_s": None,
                "resumed_s": None,
            }
            if after:
                first = after[0]
                quorum_at = first["unix_time"] - first["step_s"] + first["quorum_s"]
                entry["detected_s"] = max(quorum_at - died, 0.0)
                entry["resumed_s"] = first["unix_time"] - max(quorum_at, died)
            if death["restarted"]:
                back = [r for r in records
                        if r["rank"] == rank and r["attempt"] == death["attempt"] + 1]  # fmt: skip
                if back:
                    entry["rejoined_step"] = back[0]["step"]
                    entry["rejoin_s"] = back[0]["unix_time"] - death["restarted_at"]
            out.append(entry)
        return out

    def summary(self) -> dict[str, Any]:
        finals = read_finals(self.run_dir)
        # The replica that trained longest (a restarted one joined late).
        main = max(finals, key=lambda f: (f["progress"]["step"], f["wall_s"]))
        progress = SimpleNamespace(
            step=main["progress"]["step"],
            samples_trained=main["progress"]["samples_trained"],
            recoveries=self.recoveries(),
        )
        cfg = self.cfg
        summary = build_summary(
            [RankTotals(**f["totals"]) for f in finals],
            wall_s=main["wall_s"],
            checkpoint_s=0.0,
            progress=progress,
            test_accuracy=main["test_accuracy"],
            params_hash=main["params_sha256"],
            info={
                "strategy": cfg.train.strategy,
                "recovery": "inplace",
                "backend": "gloo",
                "device": main["device"],
                "batch_size_per_worker": cfg.train.batch_size,
                "global_batch_size": cfg.train.batch_size * self.world,
                "epochs": cfg.train.epochs,
                "steps_per_epoch": main["steps_per_epoch"],
                "config_hash": cfg.hash(),
                "scaletrain_version": main["scaletrain_version"],
                "torch_version": main["torch_version"],
            },
        )
        summary["world_size"] = self.world
        # Replicas that finished must hold the same weights; the hash says whether they do.
        summary["replicas_agree"] = len({f["params_sha256"] for f in finals}) == 1
        atomic_write_json(self.run_dir / "summary.json", summary)
        return summary


def run_inplace(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    supervisor = Supervisor(cfg, run_dir)
    supervisor.run()
    return supervisor.summary()
