from __future__ import annotations

import datetime
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from scaletrain.fault.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    load_latest,
    publish_dir,
    read_index,
    remove_unfinished,
    save_checkpoint,
    snapshot,
)
from scaletrain.fault.inject import CorruptCheckpoint, Hang, Kill, KillNode, Slow, parse_inject
from scaletrain.fault.recoveries import failure_details
from scaletrain.fault.watchdog import Beat, Watchdog, diagnose


def test_checkpoints_keep_the_newest_and_skip_damaged_ones(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((3,), float(step))}, keep=3)
    assert [e["step"] for e in read_index(tmp_path)] == [2, 3, 4]
    assert not (tmp_path / "step-00000001.pt").exists()
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 4 and skipped == []
    newest = tmp_path / "step-00000004.pt"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "step-00000003.pt").unlink()
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    assert len(skipped) == 2 and "sha256 differs" in skipped[0] and "unreadable" in skipped[1]
    assert load_latest(tmp_path / "none") == (None, [])


@pytest.mark.parametrize("damage", ["torn", "not-a-list", "bad-entry"])
def test_a_damaged_index_is_read_as_its_previous_generation(tmp_path, damage):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, keep=3)
    index = tmp_path / "index.json"
    text = index.read_text()
    index.write_text({"torn": text[: len(text) // 2], "not-a-list": '{"step": 3}',
                      "bad-entry": text.replace('"step": 3', '"step": "3"')}[damage])  # fmt: skip
    notes: list[str] = []
    assert [e["step"] for e in read_index(tmp_path, notes)] == [1, 2]  # index.prev.json
    assert len(notes) == 1 and "index.json" in notes[0]
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 2 and "index.json" in skipped[0]
    (tmp_path / "index.prev.json").write_text("")  # both generations damaged: none to trust
    assert load_latest(tmp_path)[0] is None


def test_per_rank_state_files_carry_their_own_checksum(tmp_path):
    from scaletrain.fault.checkpoint import DamagedFile, load_rank_state, save_rank_state

    path = tmp_path / "rng" / "step-00000002-rank1.pt"
    save_rank_state(path, {"rng": {"torch": torch.arange(4)}, "strategy": None})
    assert torch.equal(load_rank_state(path)["rng"]["torch"], torch.arange(4))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFile):
        load_rank_state(path)
    path.write_bytes(bytes(data[:40]))  # torn
    with pytest.raises(DamagedFile):
        load_rank_state(path)


def test_parse_inject():
    assert parse_inject("") == []
    assert parse_inject("kill:rank=1:step=7, killnode:rank=2:step=3") == [
        Kill(rank=1, step=7),
        KillNode(rank=2, step=3),
    ]
    assert parse_inject("slow:rank=2:factor=2.5,hang:rank=0:step=4,corrupt-checkpoint:step=3") == [
        Slow(rank=2, factor=2.5),
        Hang(rank=0, step=4),
        CorruptCheckpoint(step=3),
    ]
    # The parameter server's replication faults (strategies/param_server/replica.py).
    assert [type(f).__name__ for f in parse_inject(
        "kill-before-reply:rank=3:step=2,kill-during-copy:rank=3:step=2,"
        "break-backup-link:rank=3:step=2")] == [
        "KillBeforeReply", "KillDuringCopy", "BreakBackupLink"]  # fmt: skip
    with pytest.raises(
        ValueError, match="unknown fault 'explode'; known: break-backup-link, corrupt-checkpoint"
    ):
        parse_inject("explode:rank=1")
    with pytest.raises(ValueError, match="rank must be an integer, got 'one'"):
        parse_inject("kill:rank=one:step=2")
    with pytest.raises(ValueError, match="needs rank >= 0 and step >= 1"):
        parse_inject("kill:rank=0:step=0")
    with pytest.raises(ValueError, match="missing factor; slow takes rank, factor"):
        parse_inject("slow:rank=1")
    with pytest.raises(ValueError, match="needs rank >= 0 and factor >= 1"):
        parse_inject("slow:rank=1:factor=0.5")
    with pytest.raises(ValueError, match="unknown option 'node=1'; corrupt-checkpoint takes step"):
        parse_inject("corrupt-checkpoint:step=3:node=1")
    with pytest.raises(ValueError, match="missing step; corrupt-checkpoint takes step, rank"):
        parse_inject("corrupt-checkpoint:rank=1")  # rank is optional, step is not


def test_corrupt_checkpoint_fault_breaks_the_sha256_only_in_the_first_attempt(tmp_path):
    path = tmp_path / "step-3.pt"
    original = bytes(range(256)) * 8
    path.write_bytes(original)
    fault = CorruptCheckpoint(step=3)
    fault.after_checkpoint(3, path, attempt=1)
    fault.after_checkpoint(2, path, attempt=0)
    assert path.read_bytes() == original
    fault.after_checkpoint(3, path, attempt=0)
    damaged = path.read_bytes()
    assert len(damaged) == len(original) and damaged != original


def beat(step, phase, collective="", since=100.0, published=130.0):
    return Beat(step, phase, collective, since, published)


def test_diagnose_names_the_rank_that_did_not_reach_the_collective():
    beats = {
        0: beat(7, "train step", "gradient all-reduce", since=101.0),
        1: beat(7, "starting the step", since=100.0),
        2: beat(7, "train step", "gradient all-reduce", since=101.5),
    }
    d = diagnose(beats, now=131.0, timeout_s=30)
    assert d.culprits == [1] and d.step == 7 and d.collective == "gradient all-reduce"
    assert d.since == 100.0
    assert d.message.startswith(
        "hang detected: rank 1 did not reach the gradient all-reduce of step 7 while ranks 0, 2 "
        "wait in it: rank 1 has been in 'starting the step' of step 7 for 31 s"
    )


def test_diagnose_names_frozen_and_missing_ranks():
    beats = {
        0: beat(3, "train step", "gradient all-reduce"),
        1: beat(3, "train step", "gradient all-reduce", published=110.0),  # frozen since 110
        2: None,
    }
    d = diagnose(beats, now=131.0, timeout_s=30)
    assert d.culprits == [1, 2]
    assert "rank 1 stopped sending heartbeats 21 s ago (at step 3, train step)" in d.message
    assert "rank 2 never sent a heartbeat" in d.message


def test_a_heartbeat_store_that_fails_is_unreachable_not_a_silent_rank(tmp_path):
    """A host whose cable is cut gets an error from the store at once (its network is down),
    not a timeout. That must read as "the store is unreachable" (a guess), never as "every
    other rank stopped sending heartbeats", which would name the healthy ranks as culprits."""
    import gc

    from scaletrain.net import loopback_store

    server, listener = loopback_store(5.0)
    watchdog = Watchdog(rank=1, world_size=2, attempt=0, timeout_s=1.0, run_dir=tmp_path)
    watchdog._store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=False,
                                    timeout=datetime.timedelta(seconds=5))  # fmt: skip
    watchdog._publish()
    beats = watchdog._beats_within(5.0)
    assert beats is not None and beats[0] is None and beats[1] is not None  # read, rank 0 silent
    del server  # the store's host is gone: its connections are closed
    gc.collect()
    assert watchdog._beats_within(5.0) is None


def test_diagnose_without_a_missing_rank_blames_the_collective():
    beats = {r: beat(5, "evaluation", "evaluation all-reduce", since=90.0) for r in range(2)}
    d = diagnose(beats, now=131.0, timeout_s=30)
    assert d.culprits == []
    assert "ranks 0, 1 have waited 41 s in the evaluation all-reduce of step 5" in d.message
    assert "no rank is missing from it" in d.message


def test_async_checkpoint_saves_the_state_of_submit_time(tmp_path):
    weights = torch.zeros(1000)
    saver = AsyncCheckpointer()
    frozen = snapshot({"w": weights})
    saver.submit(lambda: save_checkpoint(tmp_path, 1, frozen, keep=2))
    weights += 1  # training goes on while the write is in flight
    saver.wait()
    state, skipped = load_latest(tmp_path)
    assert skipped == [] and torch.equal(state["w"], torch.zeros(1000))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs: a real full disk (root only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("background", [False, True])
def test_full_disk_keeps_the_previous_checkpoint_and_says_so(tiny_disk, background):
    save_checkpoint(tiny_disk, 1, {"w": torch.ones(100)}, keep=3)
    big = {"w": torch.ones(200_000)}  # 800 KB
    with pytest.raises(CheckpointError) as error:
        if background:
            saver = AsyncCheckpointer()
            saver.submit(lambda: save_checkpoint(tiny_disk, 2, big, keep=3))
            saver.wait()
        else:
            save_checkpoint(tiny_disk, 2, big, keep=3)
    assert "cannot write the checkpoint of step 2" in str(error.value)
    assert "No space left on device" in str(error.value)
    assert "the previous checkpoint (step 1) is intact" in str(error.value)
    state, skipped = load_latest(tiny_disk)
    assert skipped == [] and torch.equal(state["w"], torch.ones(100))
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["index.json", "step-00000001.pt"]


def test_slow_fault_stretches_only_its_rank_in_every_attempt():
    slow = Slow(rank=1, factor=3.0)
    assert slow.after_step(5, 0, 0, compute_s=0.01) == 0.0
    assert slow.after_step(5, 1, 2, compute_s=0.01) == pytest.approx(0.02)


def test_failure_details_prefer_the_hang_that_caused_the_deaths():
    records = [
        {"attempt": 0, "rank": 0, "step": 4, "unix_time": 50.0},
        {"attempt": 0, "rank": 1, "step": 4, "unix_time": 50.5},
        {"attempt": 0, "rank": 0, "step": 5, "unix_time": 51.0},
    ]
    death = {"kind": "death", "attempt": 0, "ranks": [1], "detected_at": 60.0}
    hang = {"kind": "hang", "attempt": 0, "ranks": [1], "step": 5, "stalled_since": 50.5,
            "detected_at": 58.0}  # fmt: skip
    got = failure_details([death, hang], records, attempt=0)
    assert got["cause"] == "hang" and got["rank"] == 1 and got["failed_step"] == 5
    assert got["detected_s"] == pytest.approx(7.5)
    got = failure_details([death], records, attempt=0)
    # A death: the rank's last record is its last sign of life; it died in the step after.
    assert got["cause"] == "death" and got["failed_step"] == 5
    assert got["detected_s"] == pytest.approx(9.5)
    assert failure_details([death], records, attempt=1)["cause"] == "unknown"


def test_a_death_is_the_rank_that_stopped_first_not_those_that_ran_on():
    """local SGD between synchronizations: rank 1 is SIGKILLed before step 2 while ranks 0
    and 2 run on to step 3 before the agent stops them with SIGTERM; none of the three left
    an error file, so the agent's report names all three, the survivor it saw first first."""
    records = [{"attempt": 0, "rank": r, "step": s, "unix_time": 50.0 + s}
               for r, last in ((0, 3), (1, 1), (2, 3)) for s in range(1, last + 1)]  # fmt: skip
    death = {"kind": "death", "attempt": 0, "ranks": [0, 1, 2], "detected_at": 55.0}
    got = failure_details([death], records, attempt=0)
    assert got["rank"] == 1 and got["ranks"] == [1] and got["failed_step"] == 2
    assert got["detected_s"] == pytest.approx(4.0)  # from rank 1's last step
    lockstep = [
        {"attempt": 0, "rank": r, "step": s, "unix_time": 50.0 + s}
        for r in (0, 1, 2)
        for s in (1, 2)
    ]  # ddp: every rank stopped after step 2
    assert failure_details([death], lockstep, attempt=0)["ranks"] == [0, 1, 2]


def test_a_hang_seen_without_the_heartbeat_store_is_only_a_guess():
    """A cut cable: rank 1, cut off, cannot read the heartbeats and names rank 0 (silent to
    it); rank 0 reads every heartbeat and names rank 1. Whichever was written first, rank 0's
    account is the recovery's."""
    records = [{"attempt": 0, "rank": r, "step": 9, "unix_time": 50.0} for r in (0, 1)]
    guess = {"kind": "hang", "attempt": 0, "ranks": [0], "step": 10, "stalled_since": 50.0,
             "detected_at": 57.0, "store_unreachable": True}  # fmt: skip
    seen = {**guess, "ranks": [1], "detected_at": 57.5, "store_unreachable": False}
    for incidents in ([guess, seen], [seen, guess]):
        assert failure_details(incidents, records, attempt=0)["ranks"] == [1]
    assert failure_details([guess], records, attempt=0)["ranks"] == [0]  # all there is


def test_a_node_that_reported_nothing_while_the_others_saw_symptoms_is_lost():
    records = [{"attempt": 0, "rank": r, "step": 6, "unix_time": 40.0 + r} for r in range(4)]
    # Nodes holding ranks 0-1 and 2 saw only broken collectives; rank 3's node said nothing.
    symptoms = [
        {"kind": "death", "attempt": 0, "ranks": [0], "collateral": True, "node_ranks": [0, 1],
         "detected_at": 45.0},
        {"kind": "death", "attempt": 0, "ranks": [2], "collateral": True, "node_ranks": [2],
         "detected_at": 44.0},
    ]  # fmt: skip
    got = failure_details(symptoms, records, attempt=0)
    assert got["cause"] == "node-lost" and got["ranks"] == [3] and got["failed_step"] == 7
    assert got["detected_s"] == pytest.approx(44.0 - 43.0)
    # One node naming a cause of its own (its rank was killed) is that cause, not a lost node.
    own = {**symptoms[1], "ranks": [2], "collateral": False}
    assert failure_details([symptoms[0], own], records, attempt=0)["cause"] == "death"


def test_sharded_checkpoint_dir_is_published_hashed_and_checked(tmp_path):
    for step in (1, 2):
        tmp = tmp_path / f".step-{step:08d}.dcp.attempt0.tmp"
        tmp.mkdir()
        (tmp / "__0_0.distcp").write_bytes(bytes([step]) * 100)
        (tmp / ".metadata").write_bytes(b"meta")
        digest = publish_dir(tmp, tmp_path / f"step-{step:08d}.dcp")
        save_checkpoint(tmp_path, step, {"step": step}, keep=3,
                        shards={"dir": f"step-{step:08d}.dcp", "sha256": digest})  # fmt: skip
    state, skipped = load_latest(tmp_path)
    assert skipped == [] and state["strategy"] == {"dcp": str(tmp_path / "step-00000002.dcp")}
    (tmp_path / "step-00000002.dcp" / "__0_0.distcp").write_bytes(b"torn")
    state, skipped = load_latest(tmp_path)
    assert state["step"] == 1 and "shards missing or sha256 differs" in skipped[0]
    save_checkpoint(tmp_path, 3, {"step": 3}, keep=1)  # dropping entries removes their shards
    assert not (tmp_path / "step-00000001.dcp").exists()
    (tmp_path / ".step-00000004.dcp.attempt0.tmp").mkdir()  # a save cut short by a crash
    remove_unfinished(tmp_path)
    assert not list(tmp_path.glob(".step-*.tmp"))


def test_error_files_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    """The agent reads a worker's error file as soon as the worker is gone: a worker killed
    while writing must leave no file rather than a torn one."""
    import json

    from scaletrain.metrics.logs import AtomicErrorHandler

    path = tmp_path / "rank0.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    handler = AtomicErrorHandler()
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        handler.record_exception(e)
    assert json.loads(path.read_text())["message"]["message"] == "RuntimeError: boom"
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]

    path.unlink()

    def dies(fd):  # the process dies after the bytes went out, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr("scaletrain.io.os.fsync", dies)
    with pytest.raises(KeyboardInterrupt):
        handler.record_exception(RuntimeError("boom"))
    assert not path.exists()


def test_jsonl_readers_skip_a_torn_last_line(tmp_path):
    """A writer killed mid-append leaves half a line; every reader takes the whole ones."""
    from scaletrain.io import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_bytes(b'{"step": 1}\n\xff\xfe[1, 2]\n')
    assert read_jsonl(path) == [{"step": 1}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_pruning_keeps_per_rank_files_newer_than_the_index(tmp_path):
    """A rank ahead of rank 0 (local SGD between synchronizations) writes its file for a
    checkpoint rank 0 has not recorded yet: pruning must leave it."""
    from scaletrain.fault.checkpoint import prune_rng_files, rng_path, save_rank_state

    for step in (1, 2, 3, 4, 5):
        save_rank_state(rng_path(tmp_path, step, 1), {"step": step})
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    prune_rng_files(tmp_path)
    left = sorted(p.name for p in (tmp_path / "rng").iterdir())
    assert left == [f"step-{s:08d}-rank1.pt" for s in (2, 3, 4, 5)]


def test_a_one_shot_fault_fires_once_per_job(tmp_path):
    """With the run's directory named, the first time a rank reaches the step (whatever the
    attempt: a later kill of the spec fires after a restart); without, the first attempt."""
    from scaletrain.fault import inject

    try:
        inject.record_fired_in(tmp_path / "faults")
        assert inject.first_time("kill", 1, 14, attempt=1)
        assert not inject.first_time("kill", 1, 14, attempt=1)  # the restarted group goes on
        assert not inject.first_time("kill", 1, 14, attempt=2)
        assert inject.first_time("kill", 2, 14, attempt=2)  # another rank's, another marker
        assert (tmp_path / "faults" / "kill-rank1-step14").exists()
    finally:
        inject._FIRED_IN.clear()
    assert inject.first_time("kill", 1, 14, attempt=0)
    assert not inject.first_time("kill", 1, 14, attempt=1)


def test_a_self_watchdog_has_beaten_when_it_has_started(tmp_path):
    """A supervisor ends a process whose heartbeat file stopped moving, once it has beaten:
    the first beat is start()'s own, so a process frozen right after start() (before its
    thread's first turn) is not taken for one still starting."""
    from scaletrain.fault.watchdog import SelfWatchdog

    beat = tmp_path / "beats" / "rank4"
    watchdog = SelfWatchdog(rank=4, timeout_s=60.0, beat_path=beat)
    watchdog.start()
    try:
        assert beat.exists()
    finally:
        watchdog.stop()
