"""scaletrain plan's ranking (analysis/planner.py): time to train and GPU-hours from the cost
model's step and the failure model's goodput, the limits that set configurations aside, a
fixed global batch, and the reason each ranked configuration gives for its place."""

import math

import pytest

from scaletrain.analysis import costmodel, planner
from scaletrain.analysis.costmodel import Calibration

WORKERS = [8, 16, 32, 64, 128, 256, 512]
FAILURES = planner.Failures(node_mtbf_s=1000 * 3600, checkpoint_s=10.0, restart_s=300.0,
                            pause_s=5.0)  # fmt: skip


def cluster(grad_mb: float = 100.0, bandwidth_gbit: float = 400.0) -> Calibration:
    """8 devices a node on 300 GB/s, nodes at ``bandwidth_gbit``; 100 ms a step at 32."""
    return Calibration(compute_s=0.1, batch_size=32, grad_bytes=round(grad_mb * 1e6),
                       latency_s=10e-6, bandwidth_Bps=bandwidth_gbit * 1e9 / 8,
                       gpus_per_node=8, intra_bandwidth_Bps=300e9)  # fmt: skip


def test_time_to_train_is_the_samples_over_the_predicted_rate_times_goodput():
    cal = cluster()
    opts = planner.options(cal, ["ddp", "fsdp"], WORKERS, 1e8, FAILURES, planner.Limits(),
                           price=2.0)  # fmt: skip
    # ddp is recovered in place as well as by restart; fsdp only by restart.
    assert len(opts) == len(WORKERS) * 3
    assert {o.recovery for o in opts if o.method == "fsdp"} == {"restart"}
    for o in opts:
        p = costmodel.predict_method(cal, o.method, o.workers)
        f = costmodel.plan_failures(o.workers, 8, FAILURES.node_mtbf_s, 10.0, 300.0, 5.0)
        goodput = f.goodput_inplace if o.recovery == "inplace" else f.goodput_restart
        assert o.goodput == goodput and o.checkpoint_interval_s == f.checkpoint_interval_s
        assert o.time_s == pytest.approx(1e8 / (p.samples_per_s * goodput))
        assert o.gpu_hours == pytest.approx(o.time_s * o.workers / 3600)
        assert o.cost == pytest.approx(2.0 * o.gpu_hours)
        assert o.global_batch == 32 * o.workers and not o.excluded


def test_ranked_by_time_more_devices_win_by_cost_the_efficient_ones():
    """On links fast enough, 512 devices train soonest; ranked by GPU-hours, the fewest
    devices (least communication a step) come first. Each ranked configuration says why it
    is behind the one above, by the factor that moved most."""
    opts = planner.options(cluster(), ["ddp"], WORKERS, 1e8, FAILURES, planner.Limits())
    by_time = planner.rank(opts, "time")
    assert (by_time[0].workers, by_time[0].recovery) == (512, "inplace")
    assert not by_time[0].loses_because
    assert [o.time_s for o in by_time] == sorted(o.time_s for o in by_time)
    behind = next(o for o in by_time if o.workers == 256)
    assert "256 devices against 512" in behind.loses_because
    restart = next(o for o in by_time if o.workers == 512 and o.recovery == "restart")
    assert "goodput" in restart.loses_because and "restart against inplace" in \
        restart.loses_because  # fmt: skip
    by_cost = planner.rank(opts, "cost")
    assert by_cost[0].workers == 8
    assert [o.gpu_hours for o in by_cost] == sorted(o.gpu_hours for o in by_cost)
    more = next(o for o in by_cost if o.workers == 16 and o.recovery == "inplace")
    assert "communication leaves" in more.loses_because
    with pytest.raises(ValueError, match="rank by time or cost"):
        planner.rank(opts, "speed")


def test_limits_set_configurations_aside_each_with_its_reason():
    cal = cluster()
    free = planner.options(cal, ["ddp"], WORKERS, 1e8, FAILURES, planner.Limits())
    by_workers = {(o.workers, o.recovery): o for o in free}
    # A deadline between the times of 64 and 128 devices keeps 128 and more.
    deadline = (by_workers[64, "inplace"].time_s + by_workers[128, "inplace"].time_s) / 2
    budget = by_workers[256, "inplace"].gpu_hours * 0.999
    opts = planner.options(cal, ["ddp"], WORKERS, 1e8, FAILURES,
                           planner.Limits(deadline_s=deadline, budget_gpu_hours=budget,
                                          max_global_batch=32 * 256))  # fmt: skip
    kept = {o.workers for o in planner.rank(opts)}
    assert kept == {128}
    reasons = {o.workers: o.excluded for o in opts if o.recovery == "inplace"}
    assert "past the deadline" in reasons[64]
    assert "over the budget" in reasons[256]
    assert reasons[512] == "global batch 16,384 above 8,192"
    # Nothing fits: nothing is ranked.
    none = planner.options(cal, ["ddp"], WORKERS, 1e8, FAILURES, planner.Limits(deadline_s=1))
    assert planner.rank(none) == [] and all(o.excluded for o in none)


def test_a_fixed_global_batch_splits_over_the_devices():
    """--global-batch 1024: each of W devices trains 1024 / W samples a step, its compute in
    proportion; more devices than samples is no configuration."""
    cal = cluster()
    opts = planner.options(cal, ["ddp"], [8, 64, 2048], 1e8, FAILURES, planner.Limits(),
                           global_batch=1024)  # fmt: skip
    assert {o.workers for o in opts} == {8, 64}
    at64 = next(o for o in opts if o.workers == 64)
    assert at64.global_batch == 1024
    scaled = Calibration(**{**cal.__dict__, "compute_s": 0.1 * 16 / 32, "batch_size": 16})
    assert at64.step_s == pytest.approx(costmodel.predict_method(scaled, "ddp", 64).step_s)
    # Strong scaling: fewer samples a device at more devices is the rest of the ratio.
    ranked = planner.rank(opts)
    assert ranked[0].workers == 64


def test_durations():
    assert planner.parse_duration("7d") == 7 * 86400
    assert planner.parse_duration("36h") == 36 * 3600
    assert planner.parse_duration("90m") == 5400
    assert planner.parse_duration("45") == 45
    for bad in ("soon", "0h", "-1d", "inf"):
        with pytest.raises(ValueError, match="deadline"):
            planner.parse_duration(bad, "deadline")
    assert planner.duration_text(math.inf) == "never"
    assert planner.duration_text(3 * 86400) == "3.0 days"
    assert planner.duration_text(5400) == "1.5 h"
