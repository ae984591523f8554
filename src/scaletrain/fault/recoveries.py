"""summary.json's ``recoveries``, for every mode: one entry per failure, built from what
the run left on disk. Pure functions of the records: metrics.jsonl (every rank's steps, with
attempt and time), logs/incidents.jsonl (each death a launcher noticed, each hang a watchdog
diagnosed), logs/ps_events.jsonl (what the parameter servers saw).

- restart: ``failure_details`` says what ended an attempt; the restarted world's ``resume``
  (recovery.py) makes the entry, and ``run_recoveries`` adds the restarts whose world failed
  again before it could checkpoint them (logs/recoveries.jsonl).
- inplace: ``inplace_recoveries``: from each death to the survivors' first quorum without it
  (``detected_s``), to their first committed step (``resumed_s``), and a restarted replica's
  ``rejoined_step``; nothing is rolled back.
- ps: ``ps_recoveries``: what the servers saw of a worker's death (its requeued lease) and
  how long the others went on, a server's restored version; bsp drops.

Every entry has ``kind``, ``rank``, ``cause``, ``failed_step`` or ``failed_at``,
``detected_s``, ``resumed_s`` and ``lost_steps``, as far as the mode can know them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scaletrain.io import append_jsonl, read_jsonl

Record = dict[str, Any]


def attempt_records(records: list[Record], rank: int, attempt: int) -> list[Record]:
    """``rank``'s steps in ``attempt``, as metrics.jsonl holds them."""
    return [r for r in records if r["rank"] == rank and r.get("attempt") == attempt]


def failed_step(mine: list[Record], default: int = 0) -> int:
    """The step a process did not finish: the one after its last record."""
    return max((r["step"] for r in mine), default=default) + 1


def rejoin(records: list[Record], death: Record) -> Record | None:
    """The first step a restarted process recorded in its next attempt, or None."""
    back = attempt_records(records, death["rank"], death["attempt"] + 1)
    return back[0] if back and "restarted_at" in death else None


def read_incidents(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "incidents.jsonl"
    return read_jsonl(path)


def failure_details(
    incidents: list[dict[str, Any]],
    records: list[dict[str, Any]],
    attempt: int,
    started_at: int = 0,
) -> dict[str, Any]:
    """What ended ``attempt``, which started after step ``started_at``: cause, rank(s), step,
    detection time. A hang (named by the watchdog) explains the deaths it caused, so it wins
    over them."""
    mine = [i for i in incidents if i.get("attempt") == attempt]
    # A rank that could not read the heartbeats (it may be the one cut off) only guesses.
    hangs = sorted((i for i in mine if i["kind"] == "hang"),
                   key=lambda i: bool(i.get("store_unreachable")))  # fmt: skip
    if not mine:
        return {"cause": "unknown", "rank": None, "ranks": [], "failed_step": None,
                "detected_at": None, "detected_s": None, "resumed_s": None}  # fmt: skip
    incident = hangs[0] if hangs else mine[0]
    ranks = incident["ranks"]
    lost = lost_ranks(mine, records, attempt) if not hangs else []
    if lost:
        incident = {**min(mine, key=lambda i: i["detected_at"]), "kind": "node-lost"}
        ranks = lost
    if incident["kind"] == "death" and len(ranks) > 1:
        ranks = _stopped_first(ranks, records, attempt)
    last = [r for r in records if r.get("attempt") == attempt and (not ranks or r["rank"] in ranks)]
    if incident["kind"] == "hang":
        failed_step, since = incident["step"], incident["stalled_since"]
    else:
        failed_step = max((r["step"] for r in last), default=started_at) + 1
        since = max((r.get("unix_time", 0.0) for r in last), default=0.0) or None
    detected_at = incident["detected_at"]
    return {
        "cause": incident["kind"],
        "rank": ranks[0] if ranks else None,
        "ranks": ranks,
        "failed_step": failed_step,
        "detected_at": detected_at,
        "detected_s": detected_at - since if since else None,
        "resumed_s": None,
    }


def _stopped_first(ranks: list[int], records: list[dict[str, Any]], attempt: int) -> list[int]:
    """Of the ranks a death report names (every rank that left no error file: the one that
    died, and those the agent then stopped with SIGTERM before they could write one), the
    ones that stopped at the earliest step. A rank that went on training after another one
    stopped did not die first: between local-SGD synchronizations nothing holds the others
    back, and they ran on until the agent stopped them. In lockstep (ddp) all stopped at the
    same step and the agent's order stands."""
    reached = {rank: 0 for rank in ranks}
    for r in records:
        if r.get("attempt") == attempt and r["rank"] in reached:
            reached[r["rank"]] = max(reached[r["rank"]], r["step"])
    earliest = min(reached.values())
    return [rank for rank in ranks if reached[rank] == earliest]


def lost_ranks(
    incidents: list[dict[str, Any]], records: list[dict[str, Any]], attempt: int
) -> list[int]:
    """Ranks of ``attempt`` whose node reported nothing, when every node that did report saw
    only symptoms (its collectives broke): those ranks' node is gone, agent and all, as when
    a machine dies. Empty when some node names a cause of its own."""
    if not incidents or not all(i.get("collateral") for i in incidents):
        return []
    reported = {r for i in incidents for r in i.get("node_ranks", [])}
    trained = {r["rank"] for r in records if r.get("attempt") == attempt}
    return sorted(trained - reported)


def job_resume_details(run_dir: Path, records: list[Record], job_run: int) -> Record:
    """What ended the job run before ``job_run`` and how long the job was not running: from
    its last step (``failed_at``) to this run's start (``gap_s``); ``detected_at`` is this
    run's start, so ``resumed_s`` (set by mark_resumed) is its start-up to the first step."""
    runs = read_jsonl(run_dir / "logs" / "job_runs.jsonl")
    started = next((j["started_at"] for j in runs if j.get("job_run") == job_run
                    and "started_at" in j), time.time())  # fmt: skip
    ended = [j for j in runs if j.get("job_run") == job_run - 1 and "ended_at" in j]
    earlier = [r for r in records if r.get("job_run", 0) < job_run]
    last = max((r["unix_time"] for r in earlier), default=None)
    how = ended[-1]["how"] if ended else "ended without a word (killed, or its machine lost)"
    return {
        "cause": f"job run {job_run - 1} {how}",
        "rank": None,
        "ranks": [],
        "failed_step": max((r["step"] for r in earlier), default=0) + 1,
        "failed_at": last,
        "detected_at": started,
        "detected_s": None,
        "gap_s": started - last if last is not None else None,
        "resumed_s": None,
    }


def mark_resumed(entry: dict[str, Any]) -> None:
    """Called after the first step of a restarted attempt: the recovery is complete."""
    if entry.get("detected_at"):
        entry["resumed_s"] = time.time() - entry["detected_at"]


def note_recovery(run_dir: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to DIR/logs/recoveries.jsonl (rank 0 does, when it resumes and again
    when the recovery completes). A checkpoint carries the recoveries before it, so a restart
    whose world failed again before its next checkpoint is in no checkpoint: this file keeps
    it for summary.json."""
    append_jsonl(run_dir / "logs" / "recoveries.jsonl", entry)


def run_recoveries(run_dir: Path, carried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every restart of the run, one entry per attempt in attempt order: those ``carried`` in
    the loop's progress and those only DIR/logs/recoveries.jsonl holds (the later line of an
    attempt wins: it has ``resumed_s``). Keyed by job run too: in place every job run's
    replicas start at attempt 0."""

    def key(entry: dict[str, Any]) -> tuple[int, int]:
        return entry.get("job_run", 0), entry["attempt"]

    by_attempt = {key(entry): entry for entry in carried}
    for entry in read_jsonl(run_dir / "logs" / "recoveries.jsonl"):
        by_attempt[key(entry)] = entry
    return [by_attempt[a] for a in sorted(by_attempt)]


def inplace_recoveries(deaths: list[Record], records: list[Record], world: int) -> list[Record]:
    """One entry per replica death (``deaths``: rank, attempt, died_at, cause, restarted and,
    when restarted, restarted_at), timed from the others' steps."""
    out = []
    for death in deaths:
        rank, died = death["rank"], death["died_at"]
        mine = attempt_records(records, rank, death["attempt"])
        # A death recorded after the replica had stopped stepping (its node lost the
        # network and noticed late) is timed from its last step.
        died = min(died, max((r["unix_time"] for r in mine), default=died) + 1.0)
        failed = failed_step(mine)
        # The world it left: that of its last step (not its largest: a replica that died
        # after an earlier death left a smaller world than it once trained in).
        before = max(mine, key=lambda r: r["step"])["participants"] if mine else world
        # The others' steps from the one it did not record: the first with fewer
        # participants is the first without it (it may have died after committing a
        # step, before writing its record; or the others may have committed the step it
        # failed, its last bytes lost with its network).
        later = sorted((r for r in records if r["rank"] != rank and r["step"] >= failed),
                       key=lambda r: r["unix_time"])  # fmt: skip
        after = [r for r in later if r["participants"] < before] or later
        entry: Record = {
            "kind": "inplace",
            "rank": rank,
            "cause": death["cause"],
            "failed_step": failed,
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
        # Local SGD in place: the steps of its round it had trained, lost with it (their
        # samples were trained again).
        lost = {(replica, rnd) for r in records for replica, rnd in r.get("lost", [])}
        if lost:
            entry["lost_work_steps"] = sum((rank, r.get("round")) in lost for r in mine)
        back = rejoin(records, death) if death["restarted"] else None
        if back is not None:
            entry["rejoined_step"] = back["step"]
            entry["rejoin_s"] = back["unix_time"] - death["restarted_at"]
            if back.get("healed_bytes"):  # the copy from a peer, within that step's quorum
                entry["healed_bytes"] = back["healed_bytes"]
                # The copy's own time where the record has it (else its quorum's wait).
                entry["heal_s"] = back.get("heal_copy_s", back["quorum_s"])
                entry["heal_GBps"] = back["healed_bytes"] / max(entry["heal_s"], 1e-9) / 1e9
        out.append(entry)
    return sorted(out, key=lambda e: e["failed_at"])


def ps_job_resumes(run_dir: Path, records: list[Record], events: list[Record],
                   num_workers: int) -> list[Record]:  # fmt: skip
    """One ``resume`` entry per later run of a parameter-server job (it continues after a
    preemption or a whole-job kill, launch/jobs.py): the version server 0 restored, what
    ended the run before it, and ``resumed_s``, the new run's start to its first step.
    ``lost_steps``: the updates server 0 applied in the run before after that version
    (server 0's ledger), trained again (none after a preemption: every server checkpointed
    its last)."""
    out: list[Record] = []
    ledger = read_jsonl(run_dir / "logs" / "ps_ledger.jsonl")
    for run in read_jsonl(run_dir / "logs" / "job_runs.jsonl"):
        number = run.get("job_run", 0)
        if number == 0 or "started_at" not in run:
            continue
        started = run["started_at"]
        restored = [e["version"] for e in events if e["event"] == "restored"
                    and e["server"] == 0 and e["unix_time"] >= started]  # fmt: skip
        first = min((r["unix_time"] for r in records if r.get("job_run") == number),
                    default=None)  # fmt: skip
        details = job_resume_details(run_dir, records, number)
        details["resumed_s"] = first - started if first is not None else None
        version = restored[0] if restored else 0
        redone = {e["version"] for e in ledger
                  if e.get("job_run") == number - 1 and e["version"] > version}  # fmt: skip
        out.append({"kind": "resume", "attempt": run.get("attempt_base", 0), "job_run": number,
                    "world_size": num_workers, "step": version, "lost_steps": len(redone),
                    **details})  # fmt: skip
    return out


def ps_recoveries(
    deaths: list[Record], events: list[Record], records: list[Record], num_workers: int
) -> list[Record]:
    """One entry per process death (ranks below ``num_workers`` are workers, the others
    servers), with what the servers saw of it and how long until the restarted process was
    serving or training again; then the workers a bsp barrier dropped without a death."""
    out: list[Record] = []
    for death in deaths:
        rank, died = death["rank"], death["died_at"]
        worker = rank < num_workers
        entry: Record = {
            "kind": "ps-worker" if worker else "ps-server",
            "rank": rank,
            "cause": death["cause"],
            "failed_at": died,
            "restarted": death["restarted"],
        }
        if worker:
            lost = [e for e in events if e["event"] == "worker_lost" and e["worker"] == rank
                    and e["unix_time"] >= died - 1.0]  # fmt: skip
            # The servers' links break at once; the launcher's poll may notice a little later.
            first = min((e["unix_time"] for e in lost), default=None)
            entry["detected_s"] = max(0.0, first - died) if first is not None else None
            entry["failed_step"] = failed_step(attempt_records(records, rank, death["attempt"]))
            entry["requeued_samples"] = sum(e.get("requeued", 0) for e in lost)
            entry["lost_steps"] = 0
            # The others did not stop: their first applied step after the death.
            after = [r for r in records if r["rank"] != rank and r["unix_time"] > died]
            entry["others_next_step_s"] = (
                min(r["unix_time"] for r in after) - died if after else None
            )
            back = rejoin(records, death)
            if back is not None:
                entry["rejoined_step"] = back["step"]
                entry["resumed_s"] = back["unix_time"] - died
        else:
            server = rank - num_workers
            # Restarted; or, lost for good under --ps-replicas, served by its backup's process
            # (a "restored" event naming that host).
            restored = [e for e in events if e["event"] == "restored" and e["server"] == server
                        and (e["attempt"] == death["attempt"] + 1
                             or ("host" in e and e["unix_time"] > died))]  # fmt: skip
            entry["server"] = server
            entry["restored_version"] = restored[0]["version"] if restored else None
            # --ps-replicas: from the backup's copy (nothing lost), else its checkpoint.
            entry["restored_from"] = restored[0].get("from", "checkpoint") if restored else None
            if restored and "host" in restored[0]:
                entry["taken_over_by"] = restored[0]["host"]
            entry["resumed_s"] = restored[0]["unix_time"] - died if restored else None
            entry["detected_s"] = 0.0  # a link breaks the moment its process dies
            # Its slice's next applied update: from the kill to training again.
            served = restored[0]["attempt"] if restored else death["attempt"] + 1
            updated = [e for e in events if e["event"] == "updated" and e["server"] == server
                       and e["attempt"] == served]  # fmt: skip
            entry["next_update_s"] = updated[0]["unix_time"] - died if updated else None
            # Updates its workers had seen acknowledged that the restored slice lacks
            # (strategies/param_server/exposure.py): 0 when it came back from its backup.
            entry["lost_acknowledged_updates"] = max(
                (e["updates"] for e in events if e["event"] == "acknowledged_lost"
                 and e["server"] == server and e["attempt"] == served), default=0,
            )  # fmt: skip
        out.append(entry)
    # Workers dropped without dying: from a bsp barrier, or (ssp) from the staleness bound
    # by every server alike (server 0's drop is the one that re-dealt the lease).
    causes = {
        "barrier timeout": "silent past --barrier-timeout-s",
        "silent at the bound": "silent past --hang-timeout-s at the staleness bound",
    }
    for e in events:
        if (
            e["event"] == "worker_lost"
            and e["how"] in causes
            and (e["how"] == "barrier timeout" or e["server"] == 0)
        ):
            out.append({"kind": "ps-drop", "rank": e["worker"], "server": e["server"],
                        "cause": causes[e["how"]], "failed_at": e["unix_time"],
                        "lost_steps": 0})  # fmt: skip
    return out
