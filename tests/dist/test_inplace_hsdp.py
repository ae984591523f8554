"""Fault-tolerant HSDP (--recovery inplace --strategy fsdp --replica-size R): replica groups
of R ranks each shard the model with FSDP2, torchft's quorum and gradient all-reduce run
across the groups. A SIGKILLed rank takes its whole group out (the launcher ends its mates),
the other groups train on with nothing rolled back, and the restarted group heals its
shards, rank by rank, from a live group; every sample is trained once per epoch. Real
processes, real SIGKILLs, a real lighthouse, gloo on loopback."""

from __future__ import annotations

from tests.conftest import assert_no_orphans, run_cli
from tests.dist.test_inplace import DIGITS, assert_exactly_once, load


def test_a_killed_rank_takes_its_group_out_and_the_group_heals_from_a_live_one(tmp_path):
    """3 groups x 2 ranks; rank 3 (group 1's second) is SIGKILLed at step 6. Its mate is
    ended with it, groups 0 and 2 train on (4 processes), and group 1 comes back at a later
    step with each rank's shards copied from the same rank of a live group."""
    out = tmp_path / "run"
    # Rank 0 is slowed (and its group with it) so the run outlasts the group's restart.
    result = run_cli("run", "--recovery", "inplace", "--strategy", "fsdp", "--replica-size", "2",
                     "--nproc-per-node", "6", "--model", "mlp", "--width", "32",
                     "--batch-size", "8", "--epochs", "3", "--max-restarts", "1",
                     "--log-sample-ids", "--num-threads", "1",
                     "--inject", "kill:rank=3:step=6,slow:rank=0:factor=4",
                     "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary, records = load(out)
    assert summary["hsdp"] == {"replica_size": 2, "replica_groups": 3}
    by_rank = {r["rank"]: r for r in summary["recoveries"]}
    assert by_rank.keys() == {2, 3}, summary["recoveries"]
    assert by_rank[3]["cause"] == "killed by SIGKILL"
    assert by_rank[2]["cause"].startswith("stopped with its replica group: rank 3")
    for rank in (2, 3):
        recovery = by_rank[rank]
        assert recovery["lost_steps"] == 0 and recovery["world_size"] == 4
        assert recovery["rejoined_step"] > 6 and recovery["healed_bytes"] > 0
    # Group 0 never restarted and never went back: every step once, in order.
    survivor = [r for r in records if r["rank"] == 0]
    assert {r["attempt"] for r in survivor} == {0}
    assert [r["step"] for r in survivor] == list(range(1, summary["steps"] + 1))
    participants = {r["step"]: r["participants"] for r in survivor}
    assert 4 in (participants[6], participants[7])
    assert participants[summary["steps"]] == 6
    # Each rank of the restarted group healed its own shards (half the model each).
    rejoined = [r for r in records if r["rank"] in (2, 3) and r["attempt"] == 1]
    first = {r["rank"]: r for r in sorted(rejoined, key=lambda r: -r["step"])}
    assert first.keys() == {2, 3}
    assert first[2]["healed_bytes"] == first[3]["healed_bytes"] > 0
    assert summary["replicas_agree"]
    assert_exactly_once(records, 3)
    assert summary["samples"] == 3 * DIGITS
    assert summary["test_accuracy"] > 0.85
    assert_no_orphans(out)
