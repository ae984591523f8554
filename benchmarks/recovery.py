"""Claims: a failed worker is replaced and training is running again within seconds, and
checkpointing in the background costs the step almost nothing.

1. Failure to resumed, restart mode (digits CNN, 2 workers, --checkpoint-every 10): a SIGKILL
   of rank 1 before step 30, and a hang of rank 1 before step 30 (--hang-timeout-s 5). From
   summary.json's recoveries: detected_s (last sign of life -> the agent or the watchdog
   notices) and resumed_s (detection -> the first step of the restarted group completes).
   Floor: restart <= 10 s from death to resumed. In place (--recovery inplace, torchft): the
   same SIGKILL; detected_s is death -> the survivors' next quorum without rank 1 (the
   lighthouse's heartbeat timeout), resumed_s quorum -> their first committed step; no
   checkpoints, nothing rolls back. Floor: inplace <= 2 s. Also printed: how long the
   restarted rank 1 took from its relaunch to its first step back in the group (rejoin_s).
   The same in place with the gradient all-reduce in fp16 (--compression fp16), and with
   local SGD and DiLoCo (--sync-every 8), same floor: there the survivors' next quorum is
   their next synchronization (detected_s holds their local steps up to it: they do not
   stop), and the dead replica's steps of its round are lost (printed; their samples are
   trained again). And fault-tolerant HSDP (--strategy fsdp --replica-size 2 on 4 workers:
   2 groups of 2; rank 1 killed, its mate rank 0 ended with it, the group restarted whole).
   Healing: the bytes a restarted replica copied from a live peer and how fast (a model of
   68 MB; the copy's own time, torchft's checkpoint transport timed), ddp and DiLoCo; HSDP's
   restarted group, each rank its half of the shards.
2. Checkpoint overhead at --checkpoint-every 10, synchronous vs --checkpoint-async, against no
   checkpoints, runs interleaved: the share of rank 0's training loop spent blocked on
   checkpoints (time_breakdown.checkpoint_s / wall_s; the direct measure), and the slowdown
   of the whole loop against the run without checkpoints (noisier: it includes machine noise).
   The same in place (--recovery inplace --checkpoint-async: the writer is each step's quorum
   rank 0, the others never wait), against in place without checkpoints; and HSDP in place
   (the writing group's ranks each write their shards; its rank 0 publishes once all are
   on disk), against HSDP in place without checkpoints.
   Floor: async <= 5%, in every mode.

3. The parameter server's server restart: server 1 of 2 SIGKILLed before its 25th update
   (from its checkpoint; with --ps-replicas 1 from its backup, and lost for good, taken over
   by its backup's process: no update lost)
   (asp, ssp(2), bsp; --checkpoint-every 10): kill -> its slice restored, kill -> the
   slice's next applied update, and the updates of that slice lost (since its checkpoint).
   Floor: the next update within 2 s.

    python benchmarks/recovery.py [--repeats 3] [--parts recovery,ps,heal,checkpoint]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from floors import Floors  # noqa: E402

FLOORS = Floors()

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "--nproc-per-node",
    "2",
    "--dataset",
    "digits",
    "--model",
    "cnn",
    "--batch-size",
    "32",
    "--seed",
    "0",
    "--epochs",
    "20",  # 23 steps per epoch: room for the faults and the 200 steps below
]


# Fault-tolerant HSDP in place: 2 replica groups of 2 ranks (the same global batch as BASE's).
HSDP = ["--strategy", "fsdp", "--replica-size", "2", "--nproc-per-node", "4", "--batch-size", "16"]


def run(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "run", *BASE, *args, "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The writer's per-step blocked time (final.pt is written after the loop): rank 0's in the
    # restart mode; in place quorum rank 0 of each step writes, any replica (the others
    # record 0), so the sum over replicas.
    # In place with replica groups (HSDP), each group's rank 0 (its ranks write at once).
    inplace = "--recovery" in args
    group = int(args[args.index("--replica-size") + 1]) if "--replica-size" in args else 1
    writers = [r for r in records if (inplace and r["rank"] % group == 0) or r["rank"] == 0]
    summary["blocked_s"] = sum(r["checkpoint_s"] for r in writers)
    return summary


def recovery_times(tmp: Path, repeats: int) -> None:
    faults = {
        "kill (restart)": ["--inject", "kill:rank=1:step=30"],
        "hang (restart)": ["--inject", "hang:rank=1:step=30", "--hang-timeout-s", "5"],
    }
    print("failure -> resumed, restart mode (median over repeats)")
    print(f"{'fault':<22} {'detected_s':>8} {'resumed_s':>10} {'total_s':>8}  floor")
    table: list[list[object]] = []
    for name, extra in faults.items():
        rows: list[tuple[float, float]] = []
        for i in range(repeats):
            args = ["--max-steps", "60", "--checkpoint-every", "10", "--max-restarts", "1", *extra]
            summary = run(args, tmp / f"{name.split()[0]}-{i}")
            [recovery] = summary["recoveries"]
            rows.append((recovery["detected_s"], recovery["resumed_s"]))
        detected = statistics.median(d for d, _ in rows)
        resumed = statistics.median(r for _, r in rows)
        total = detected + resumed
        verdict = (f"<= 10 s: {FLOORS.check(f'{name}: failure to resumed <= 10 s', total <= 10)}"
                   if "kill" in name else "-")  # fmt: skip
        print(f"{name:<22} {detected:8.2f} {resumed:10.2f} {total:8.2f}  {verdict}")
        table.append([name, f"{detected:.2f}", f"{resumed:.2f}", f"{total:.2f} s", verdict])
    # In place: plain, with the gradient all-reduce in fp16 (--compression fp16), local SGD and
    # DiLoCo (rounds of 8 steps, an epoch's last of 7: the kill lands in steps 24-31), and
    # HSDP (2 groups of 2: 4 workers of 16, the same global batch).
    rounds = ["--sync-every", "8"]
    for name, extra in {
        "kill (inplace)": [],
        "kill (inplace, fp16)": ["--compression", "fp16"],
        "kill (inplace, lsgd)": ["--strategy", "local_sgd", *rounds],
        "kill (inplace, diloco)": ["--strategy", "diloco", *rounds],
        "kill (inplace, hsdp)": HSDP,
    }.items():
        rows, rejoins, heals, lost = [], [], [], []
        for i in range(repeats):
            # 20 epochs: long enough for the restarted rank to rejoin before the end.
            args = ["--recovery", "inplace", "--max-restarts", "1",
                    "--inject", "kill:rank=1:step=30", *extra]  # fmt: skip
            summary = run(args, tmp / f"{name.split('(')[1].strip(')').replace(', ', '-')}-{i}")
            # Under HSDP the killed rank's group mate is ended with it: a recovery of its own.
            recovery = next(r for r in summary["recoveries"] if r["rank"] == 1)
            rows.append((recovery["detected_s"], recovery["resumed_s"]))
            if recovery.get("rejoin_s") is not None:
                rejoins.append(recovery["rejoin_s"])
            if recovery.get("healed_bytes"):
                heals.append((recovery["healed_bytes"], recovery["heal_s"]))
            lost.append(recovery.get("lost_work_steps", 0))
        detected = statistics.median(d for d, _ in rows)
        resumed = statistics.median(r for _, r in rows)
        total = detected + resumed
        verdict = FLOORS.check(f"{name}: failure to resumed <= 2 s", total <= 2)
        print(f"{name:<22} {detected:8.2f} {resumed:10.2f} {total:8.2f}  <= 2 s: {verdict}")
        table.append([name, f"{detected:.2f}", f"{resumed:.2f}", f"{total:.2f} s",
                      f"<= 2 s: {verdict}"])  # fmt: skip
        if rejoins:
            print(f"  the restarted rank rejoined {statistics.median(rejoins):.1f} s after its "
                  f"relaunch ({len(rejoins)}/{repeats} runs; most of it a fresh Python "
                  "importing torch)")  # fmt: skip
        if heals:
            healed = statistics.median(b for b, _ in heals)
            seconds = statistics.median(t for _, t in heals)
            print(f"  it healed {healed / 1e6:.2f} MB from a peer in {seconds:.3f} s "
                  f"({healed / seconds / 1e9:.3f} GB/s)")  # fmt: skip
        if any(lost):
            print(
                f"  work lost with it: {statistics.median(lost):.0f} steps of its round "
                "(its samples trained again by the next round)"
            )

    FLOORS.table(
        f"a rank killed (or hung) before step 30, 2 workers, digits CNN; medians of {repeats}",
        ["fault (recovery)", "detected s", "resumed s", "failure to resumed", "floor"], table,
        "restart: the group restarts from the checkpoint of step 30 (--checkpoint-every 10); "
        "in place: the survivors' next quorum forms without the dead replica, which rejoins "
        "later and heals from a peer.",
    )  # fmt: skip
    totals = {row[0]: row[3] for row in table}
    FLOORS.headline(
        "a SIGKILLed worker, in place (torchft) against restart from a checkpoint",
        f"{totals['kill (inplace)']} against {totals['kill (restart)']} to training again",
    )


def ps_server_kill(tmp: Path, repeats: int) -> None:
    """The parameter server's restart path: server 1 of 2 (3 workers) SIGKILLed before its
    25th update, --checkpoint-every 10: its launcher restarts it, it reloads its newest
    checkpoint (or, with --ps-replicas 1, takes its slice from the backup on server 0; or,
    with no restart left, server 0's process serves the slice from its copy), the workers
    reconnect. From its recoveries entry: resumed_s (kill -> slice restored or taken over),
    next_update_s (kill -> the slice's next applied update) and the updates of that slice
    lost with it (24 applied before the kill, minus the version it restored), the three
    paths side by side."""
    print("\nparameter-server server killed, restarted from its checkpoint or its backup "
          "(median over repeats)")  # fmt: skip
    print(f"{'mode':<8} {'from':<11} {'restored_s':>10} {'next_update_s':>13} "
          f"{'lost updates':>12}  floor")  # fmt: skip
    table: list[list[object]] = []
    for mode, flags in {"asp": ["asp"], "ssp(2)": ["ssp", "--staleness", "2"],
                        "bsp": ["bsp"]}.items():  # fmt: skip
        for source, extra in [
            ("checkpoint", []),
            ("backup", ["--ps-replicas", "1"]),
            ("taken over", ["--ps-replicas", "1", "--max-restarts", "0"]),
        ]:
            rows = []
            for i in range(repeats):
                args = ["--strategy", "ps", "--nproc-per-node", "5", "--num-servers", "2",
                        "--consistency", *flags, "--epochs", "3", "--checkpoint-every", "10",
                        "--max-restarts", "1", "--inject", "kill:rank=4:step=25",
                        *extra]  # fmt: skip
                summary = run(args, tmp / f"ps-{flags[0]}-{source.split()[0]}-{i}")
                [death] = [r for r in summary["recoveries"] if r["kind"] == "ps-server"]
                assert death["restored_from"] == source.replace("taken over", "backup"), death
                assert ("taken_over_by" in death) == (source == "taken over"), death
                rows.append((death["resumed_s"], death["next_update_s"],
                             24 - death["restored_version"]))  # fmt: skip
            restored, nxt, lost = (statistics.median(col) for col in zip(*rows, strict=True))
            verdict = FLOORS.check(f"ps {mode} from its {source}: kill to next update <= 2 s",
                                   nxt <= 2)  # fmt: skip
            print(f"{mode:<8} {source:<11} {restored:10.2f} {nxt:13.2f} {lost:12.0f}  "
                  f"<= 2 s: {verdict}")  # fmt: skip
            table.append([mode, source, f"{restored:.2f} s", f"{nxt:.2f} s", f"{lost:.0f}",
                          f"<= 2 s: {verdict}"])  # fmt: skip
            if source != "checkpoint" and lost:
                FLOORS.check(f"ps {mode} from its backup: no update lost", False)
    FLOORS.table(
        f"a parameter server's server 1 of 2 killed before its 25th update; medians of {repeats}",
        ["mode", "the slice from", "kill to restored", "kill to next update", "updates lost",
         "floor"], table,
        "3 workers, the CNN, --checkpoint-every 10. From its checkpoint the slice loses the "
        "updates since; from its backup (--ps-replicas 1) none; taken over: no restart left, "
        "the backup's process serves the slice.",
    )  # fmt: skip


def heal_throughput(tmp: Path, repeats: int) -> None:
    """A restarted replica copies the training state from a live peer (torchft's HTTP
    checkpoint transport): a model large enough for the copy to dominate (mlp, width 1024:
    17M parameters, 68 MB, and as much SGD momentum; DiLoCo in place also its global
    parameters and outer momentum, from the state of the last synchronization). From
    summary.json's recovery: the bytes healed and the copy's time (the transport's receive,
    within the healing quorum). No floor: the anchor is torchft's process-group transport,
    about 2.2 GB/s."""
    table: list[list[object]] = []
    for name, extra in {
        "ddp": [],
        "diloco": ["--strategy", "diloco", "--sync-every", "4"],
        "hsdp": HSDP,
    }.items():
        rows = []
        for i in range(repeats):
            args = ["--recovery", "inplace", "--max-restarts", "1", "--model", "mlp", "--width",
                    "1024", "--epochs", "4", "--num-threads", "1",
                    "--inject", "kill:rank=1:step=5,slow:rank=0:factor=3", *extra]  # fmt: skip
            recoveries = run(args, tmp / f"heal-{name}-{i}")["recoveries"]
            recovery = next(r for r in recoveries if r["rank"] == 1)
            if recovery.get("healed_bytes"):
                rows.append((recovery["healed_bytes"], recovery["heal_s"]))
        if not rows:
            sys.exit(f"heal throughput ({name}): the restarted replica never rejoined")
        healed = statistics.median(b for b, _ in rows)
        seconds = statistics.median(s for _, s in rows)
        print(
            f"\nheal from a peer, {name} in place (mlp width 1024, {len(rows)}/{repeats} runs "
            f"rejoined, medians): {healed / 1e6:.0f} MB in {seconds:.2f} s, "
            f"{healed / seconds / 1e9:.2f} GB/s (torchft's process-group transport: about "
            "2.2 GB/s)"
        )
        rate = f"{healed / seconds / 1e9:.2f} GB/s"
        table.append([name, f"{healed / 1e6:.0f} MB", f"{seconds:.2f} s", rate,
                      f"{len(rows)} of {repeats}"])  # fmt: skip
    FLOORS.table(
        "a restarted replica heals from a live peer (mlp width 1024: 17M parameters); medians",
        ["in place", "copied", "in", "rate", "runs that rejoined"], table,
        "torchft's HTTP checkpoint transport; no floor (its process-group transport is "
        "reported at about 2.2 GB/s).",
    )  # fmt: skip


def checkpoint_overhead(tmp: Path, repeats: int) -> None:
    inplace = ["--recovery", "inplace"]
    modes = {
        "none": [],
        "sync": ["--checkpoint-every", "10"],
        "async": ["--checkpoint-every", "10", "--checkpoint-async"],
        "inplace none": inplace,
        "inplace async": [*inplace, "--checkpoint-every", "10", "--checkpoint-async"],
        "hsdp none": [*inplace, *HSDP],
        "hsdp async": [*inplace, *HSDP, "--checkpoint-every", "10", "--checkpoint-async"],
    }
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(repeats):
        for mode, extra in modes.items():
            results[mode].append(run(["--max-steps", "200", *extra], tmp / f"ckpt-{mode}-{i}"))
    print(
        "\ncheckpoint overhead at --checkpoint-every 10 (200 steps, median over repeats; in "
        "place one replica writes each, the slowdown against in place without)"
    )
    print(f"{'mode':<13} {'wall_s':>7} {'blocked/ckpt ms':>15} {'blocked share':>13} "
          f"{'slowdown':>9}  floor")  # fmt: skip
    table: list[list[object]] = []
    for mode, summaries in results.items():
        base = results[f"{mode.split()[0]} none" if " " in mode else "none"]
        base_wall = statistics.median(s["wall_s"] for s in base)
        wall = statistics.median(s["wall_s"] for s in summaries)
        blocked = statistics.median(s["blocked_s"] for s in summaries)
        per_ckpt = blocked / 20 * 1e3
        share = blocked / wall
        claim = f"{mode} checkpoints block <= 5% of wall"
        verdict = (f"<= 5%: {FLOORS.check(claim, share <= 0.05)}"
                   if mode.endswith("async") else "")  # fmt: skip
        print(f"{mode:<13} {wall:7.2f} {per_ckpt:15.1f} {share:13.1%} "
              f"{wall / base_wall - 1:+9.1%}  {verdict}")  # fmt: skip
        table.append([mode, f"{wall:.2f} s", f"{per_ckpt:.1f} ms", f"{share:.1%}",
                      f"{wall / base_wall - 1:+.1%}", verdict])  # fmt: skip
    FLOORS.table(
        f"checkpoints every 10 steps, 200 steps; medians of {repeats}",
        ["mode", "wall", "blocked a checkpoint", "blocked share", "against none", "floor"],
        table, "In place one replica writes each checkpoint; the slowdown is against the same "
        "mode without checkpoints, within the noise of a shared host.",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="recovery,ps,heal,checkpoint",
                        help="which measurements (comma-separated)")  # fmt: skip
    args = parser.parse_args()
    parts = {"recovery": recovery_times, "ps": ps_server_kill, "heal": heal_throughput,
             "checkpoint": checkpoint_overhead}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.parts.split(","):
            parts[name](Path(tmp), args.repeats)
    FLOORS.finish()


if __name__ == "__main__":
    main()
