"""summary.json's recoveries for the modes whose launcher builds them, from records alone:
in-place recovery (from the death to the survivors' first quorum without it) and the
parameter server (what the servers saw). Pure functions, no process started."""

from __future__ import annotations

from scaletrain.fault.recoveries import inplace_recoveries, ps_recoveries


def step(rank, step_, at, participants, attempt=0, step_s=0.2, quorum_s=0.05):
    return {"rank": rank, "step": step_, "attempt": attempt, "unix_time": at,
            "participants": participants, "step_s": step_s, "quorum_s": quorum_s}  # fmt: skip


def test_inplace_death_is_timed_to_the_first_quorum_without_it_and_its_rejoin():
    records = [step(0, s, 100.0 + s, 2) for s in range(1, 6)]
    records += [step(1, s, 100.0 + s, 2) for s in range(1, 5)]  # rank 1 dies before step 5
    # Rank 0 goes on alone from step 6 (its quorum took 0.8 s: the heartbeat timeout).
    records += [step(0, s, 106.0 + s, 1, step_s=1.0, quorum_s=0.8) for s in range(6, 9)]
    records += [step(0, 9, 115.5, 2), step(1, 9, 115.5, 2, attempt=1)]  # rank 1 is back
    death = {"rank": 1, "attempt": 0, "died_at": 104.5, "cause": "killed by SIGKILL",
             "restarted": True, "restarted_at": 105.0}  # fmt: skip
    [entry] = inplace_recoveries([death], records, world=2)
    assert entry["failed_step"] == 5 and entry["world_size"] == 1 and entry["step"] == 5
    # First step without it: step 6, done at 112.0, began at 111.0, its quorum ended 111.8.
    assert abs(entry["detected_s"] - (111.8 - 104.5)) < 1e-9
    assert abs(entry["resumed_s"] - (112.0 - 111.8)) < 1e-9
    assert entry["rejoined_step"] == 9 and abs(entry["rejoin_s"] - 10.5) < 1e-9
    assert entry["lost_steps"] == 0


def test_inplace_second_death_is_timed_from_the_world_it_left_not_the_largest():
    """Three replicas; rank 2 dies after step 8, then rank 1's cable is cut mid-all-reduce of
    step 29: rank 0 got rank 1's bytes and committed step 29 with 2 participants, rank 1 never
    got rank 0's and recorded nothing more. The entry is rank 0's first step without rank 1
    (step 30, alone), not step 29: rank 1 left a world of 2, though it once trained in 3.
    (Times as a stress round recorded them.)"""
    records = [step(r, s, 100.0 + s, 3) for r in range(3) for s in range(1, 9)]
    records += [step(r, s, 100.0 + s, 2) for r in (0, 1) for s in range(9, 29)]
    records += [step(0, 29, 129.1, 2), step(0, 30, 129.7, 1, step_s=0.6, quorum_s=0.58)]
    records += [step(0, s, 129.7 + s / 100, 1) for s in range(31, 40)]
    deaths = [
        {"rank": 2, "attempt": 0, "died_at": 108.5, "cause": "left", "restarted": False},
        {"rank": 1, "attempt": 0, "died_at": 128.6, "cause": "left", "restarted": False},
    ]  # fmt: skip
    killed, cut = inplace_recoveries(deaths, records, world=3)
    assert killed["rank"] == 2 and killed["world_size"] == 2 and killed["step"] == 8
    assert cut["rank"] == 1 and cut["failed_step"] == 29
    assert cut["world_size"] == 1 and cut["step"] == 29
    # Step 30 began at 129.1, its quorum ended at 129.68: 1.08 s after the cut.
    assert abs(cut["detected_s"] - (129.68 - 128.6)) < 1e-9


def test_ps_worker_and_server_deaths_and_a_bsp_drop():
    records = [step(w, s, 10.0 + s, 0) for w in (0, 1) for s in range(1, 4)]
    records += [step(1, 7, 19.0, 0, attempt=1)]
    events = [
        {"event": "worker_lost", "worker": 1, "server": 0, "how": "link", "requeued": 32,
         "unix_time": 13.6},
        {"event": "restored", "server": 1, "version": 20, "attempt": 1, "unix_time": 16.0},
        {"event": "worker_lost", "worker": 0, "server": 1, "how": "barrier timeout",
         "unix_time": 18.0},
    ]  # fmt: skip
    deaths = [
        {"rank": 1, "attempt": 0, "died_at": 13.5, "cause": "killed by SIGKILL",
         "restarted": True, "restarted_at": 14.0},
        {"rank": 3, "attempt": 0, "died_at": 15.0, "cause": "killed by SIGKILL",
         "restarted": True, "restarted_at": 15.1},
    ]  # fmt: skip
    worker, server, drop = ps_recoveries(deaths, events, records, num_workers=2)
    assert worker["kind"] == "ps-worker" and worker["failed_step"] == 4
    assert abs(worker["detected_s"] - 0.1) < 1e-9 and worker["requeued_samples"] == 32
    assert worker["rejoined_step"] == 7 and abs(worker["resumed_s"] - 5.5) < 1e-9
    assert server["kind"] == "ps-server" and server["server"] == 1
    assert server["restored_version"] == 20 and server["resumed_s"] == 1.0
    assert drop["kind"] == "ps-drop" and drop["rank"] == 0 and drop["server"] == 1
