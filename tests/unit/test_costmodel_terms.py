"""The cost model's terms, each against its formula written out again here from the docs
(docs/guides/predict-and-plan.md): every field of every method's prediction, on a flat
cluster and on nodes of several devices, with overlap, so a changed sign, bound or argument
in analysis/costmodel.py changes a number these tests compare."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from scaletrain.analysis import costmodel as cm

LAT, BW, INTRA = 20e-6, 1.25e9, 50e9
FLAT = cm.Calibration(compute_s=0.1, batch_size=32, grad_bytes=400_000_000, latency_s=LAT,
                      bandwidth_Bps=BW, overlap=0.25)  # fmt: skip
NODES = replace(FLAT, gpus_per_node=4, intra_bandwidth_Bps=INTRA)


def ring(m, n, lat, bw):
    return 0.0 if n <= 1 else 2 * (n - 1) * lat + 2 * (n - 1) / n * m / bw


def check(p, method, workers, step, compute, comm, groups=None, cal=FLAT):
    """Every field of a prediction; ``groups`` the replicas training a batch each (W)."""
    groups = workers if groups is None else groups
    rate = groups * cal.batch_size / step
    assert (p.method, p.workers) == (method, workers)
    assert p.step_s == pytest.approx(step, rel=1e-12)
    assert p.compute_s == pytest.approx(compute, rel=1e-12)
    assert p.comm_s == pytest.approx(comm, rel=1e-12)
    assert p.samples_per_s == pytest.approx(rate, rel=1e-12)
    assert p.efficiency == pytest.approx(rate / (workers * cal.batch_size / cal.compute_s))


def test_ddp_flat_and_hierarchical_ring_and_tree():
    m = FLAT.grad_bytes
    comm = ring(m, 8, LAT, BW)
    check(cm.predict_ddp(FLAT, 8), "ddp", 8, 0.1 + 0.75 * comm, 0.1, comm)
    tree = 2 * 3 * LAT + 2 * m / BW
    check(cm.predict_ddp(FLAT, 8, tree=True), "ddp tree", 8, 0.1 + 0.75 * tree, 0.1, tree)
    nodes = ring(m, 4, LAT, INTRA) + ring(m, 3, LAT, BW)  # 10 workers: 3 nodes
    check(cm.predict_ddp(NODES, 10), "ddp", 10, 0.1 + 0.75 * nodes, 0.1, nodes, cal=NODES)
    one = cm.predict_ddp(FLAT, 1, encode_s=0.5)
    check(one, "ddp", 1, 0.1, 0.1, 0.0)  # alone: no communication, no encoding


def test_compressed_gradients_all_reduce_or_all_gather_with_their_encoding():
    m = FLAT.grad_bytes / 16
    comm = ring(m, 8, LAT, BW)
    p = cm.predict_ddp(FLAT, 8, ratio=16, encode_s=0.01, compressor="powersgd")
    check(p, "ddp+powersgd", 8, 0.1 + 0.01 + 0.75 * comm, 0.1, comm + 0.01)
    gather = 7 * (LAT + m / BW)
    p = cm.predict_ddp(FLAT, 8, ratio=16, encode_s=0.01, compressor="topk")
    check(p, "ddp+topk", 8, 0.1 + 0.01 + 0.75 * gather, 0.1, gather + 0.01)
    across = 2 * (LAT + 4 * m / BW)  # 3 nodes: a node takes in the others' 4 payloads each
    gather = 3 * (LAT + m / INTRA) + across
    assert cm.allgather_s(m, 10, NODES) == pytest.approx(gather)
    assert cm.allgather_s(m, 1, NODES) == 0.0
    p = cm.predict_method(FLAT, "compressed:16:10", 8)
    assert p.method == "compressed:16:10"
    assert p.step_s == pytest.approx(0.1 + 0.01 + 0.75 * ring(m, 8, LAT, BW))


def test_local_sgd_all_reduces_every_h_steps():
    comm = ring(FLAT.grad_bytes, 8, LAT, BW) / 4
    check(cm.predict_local_sgd(FLAT, 8, 4), "local_sgd H=4", 8, 0.1 + comm, 0.1, comm)


def test_parameter_server_rounds_bound_by_the_busier_link():
    g, k = FLAT.grad_bytes, 2
    comm = 2 * LAT + max(2 * g / BW, 2 * 8 * g / k / BW)
    check(cm.predict_ps(FLAT, 8, k), "ps K=2", 8, 0.1 + comm, 0.1, comm)
    comm_r = comm + LAT + g / k / BW
    check(cm.predict_ps(FLAT, 8, k, 1), "ps K=2 R=1", 8, 0.1 + comm_r, 0.1, comm_r)
    # Nodes of 4: a worker has a quarter of its node's link.
    comm = 2 * LAT + max(2 * g / (BW / 4), 2 * 8 * g / 8 / BW)
    check(cm.predict_ps(NODES, 8, 8), "ps K=8", 8, 0.1 + comm, 0.1, comm, cal=NODES)


def test_colocated_parameter_server():
    m = NODES.grad_bytes
    within = ring(m, 4, LAT, INTRA)
    across = 2 * LAT + 2 * 2 / 3 * m / BW  # 12 workers: 3 nodes, 3 servers
    p = cm.predict_colocated_ps(NODES, 12)
    check(p, "ps co-located", 12, 0.1 + 0.75 * (within + across), 0.1, within + across,
          cal=NODES)  # fmt: skip
    across = 2 * LAT + 2 * 2 / 1 * m / BW
    p = cm.predict_method(NODES, "ps-colocated:1", 12)
    check(p, "ps co-located K=1", 12, 0.1 + 0.75 * (within + across), 0.1, within + across,
          cal=NODES)  # fmt: skip
    check(cm.predict_colocated_ps(FLAT, 1), "ps co-located", 1, 0.1, 0.1, 0.0)


def test_fsdp_and_hsdp():
    m = NODES.grad_bytes
    sharded = 3 * 7 * (LAT + m / 8 / BW)  # 8 ranks span 2 nodes of 4: the node's link
    check(cm.predict_fsdp(NODES, 8), "fsdp", 8, 0.1 + 0.75 * sharded, 0.1, sharded, cal=NODES)
    sharded = 3 * 3 * (LAT + m / 4 / INTRA)  # a group of 4 within a node
    replicated = ring(m / 4, 3, LAT, BW / 4)  # 3 replicas, 4 devices on each node's link
    comm = sharded + replicated
    p = cm.predict_fsdp(NODES, 12, 4)
    check(p, "hsdp S=4", 12, 0.1 + 0.75 * comm, 0.1, comm, cal=NODES)
    with pytest.raises(ValueError, match=r"hsdp's shard group \(5\) must divide the workers"):
        cm.predict_fsdp(NODES, 12, 5)


def test_tensor_parallel_within_a_node_and_data_parallel_across():
    m, a = NODES.grad_bytes, 8e6
    tp = ring(a, 4, LAT, INTRA)
    dp = ring(m / 4, 3, LAT, BW / 4)
    p = cm.predict_tensor(NODES, 12, 4, a)
    check(p, "tp T=4", 12, 0.1 / 4 + tp + 0.75 * dp, 0.1 / 4, tp + dp, groups=3, cal=NODES)
    tp = ring(a, 2, LAT, BW)  # a flat cluster: the one link
    dp = ring(FLAT.grad_bytes / 2, 3, LAT, BW)
    p = cm.predict_method(FLAT, "tp:2:8", 6)
    check(p, "tp T=2", 6, 0.1 / 2 + tp + 0.75 * dp, 0.1 / 2, tp + dp, groups=3)
    with pytest.raises(ValueError, match=r"tp's degree \(4\) must divide the workers \(6\)"):
        cm.predict_tensor(FLAT, 6, 4, a)
    with pytest.raises(ValueError, match="tp:8 spans nodes of 4 devices; tensor parallelism"):
        cm.predict_tensor(NODES, 16, 8, a)
    assert cm.predict_tensor(FLAT, 1, 1, a).step_s == pytest.approx(0.1)


def test_pipelines():
    p = cm.predict_pipeline(FLAT, 4, 12)
    per_stage = 0.1 / 4
    hops = 2 * (12 + 4 - 2) * LAT
    step = per_stage * 15 / 12 + hops
    assert (p.method, p.workers) == ("pipeline M=12", 4)
    assert (p.step_s, p.compute_s, p.comm_s) == pytest.approx((step, per_stage * 15 / 12, hops))
    assert p.samples_per_s == pytest.approx(32 / step)
    assert p.efficiency == pytest.approx(32 / step / (4 * 32 / 0.1))
    assert cm.predict_pipeline(FLAT, 1, 4).step_s == pytest.approx(0.1)
    a = 2e6
    # Two stages within a node of 4: the intra link; 8 workers: 4 pipelines.
    hop = LAT + a / INTRA
    dp = ring(NODES.grad_bytes / 2, 4, LAT, BW / 4)
    step = 0.1 / 2 * (6 + 1) / 6 + 2 * 6 * hop + dp
    p = cm.predict_method(NODES, "pp:2:6:2", 8)
    check(p, "pp P=2 M=6", 8, step, 0.1 / 2, 2 * 6 * hop + dp, groups=4, cal=NODES)
    # Eight stages over nodes of 4: a device's share of the node's link.
    hop = LAT + a / (BW / 4)
    step = 0.1 / 8 * (6 + 7) / 6 + 2 * 12 * hop
    p = cm.predict_pipeline_dp(NODES, 8, 8, 6, a)
    check(p, "pp P=8 M=6", 8, step, 0.1 / 8, 2 * 12 * hop, groups=1, cal=NODES)
    with pytest.raises(ValueError, match=r"pp's stages \(3\) must divide the workers \(8\)"):
        cm.predict_pipeline_dp(NODES, 8, 3, 6, a)
    with pytest.raises(ValueError, match="with M >= 1"):
        cm.predict_pipeline_dp(NODES, 8, 2, 0, a)


@pytest.mark.parametrize(
    "method", ["ddp:x", "local_sgd", "ps:2:3", "ps:1:1", "hsdp:0", "tp:0:1", "fsdp:2",
               "compressed", "pipeline:2", "pp:2:2", "ps-colocated:1:2", "nonsense"],
)  # fmt: skip
def test_a_method_it_cannot_read_is_refused_with_the_forms_it_can(method):
    with pytest.raises(ValueError, match=r"cannot read method .*use ddp, ddp:tree"):
        cm.predict_method(FLAT, method, 8)


def test_fit_link_recovers_latency_and_bandwidth_and_needs_two_sizes_and_workers():
    sizes = [1e6, 4e6, 16e6]
    seconds = [ring(n, 4, LAT, BW) for n in sizes]
    lat, bw = cm.fit_link(sizes, seconds, 4)
    assert (lat, bw) == pytest.approx((LAT, BW), rel=1e-9)
    assert cm.fit_link([1e6, 2e6], [0.5, 0.5], 2) == (pytest.approx(0.5 / 2), math.inf)
    assert cm.fit_link([1e6, 2e6], [0.5, 0.4], 2)[1] == math.inf  # no growth: no bound
    for sizes, workers in (([1e6], 4), ([1e6, 2e6], 1)):
        with pytest.raises(ValueError, match="fit_link: need at least two sizes and two workers"):
            cm.fit_link(sizes, [0.1] * len(sizes), workers)
    with pytest.raises(ValueError):
        cm.fit_link([1e6, 2e6], [0.1], 4)  # a time for each size


def test_the_host_probe_nearest_the_process_count_with_slowdowns_of_at_least_one():
    cal = replace(FLAT, cores=2, cpu_s=0.01,
                  host=((2, 0.001, 1.5), (8, 0.004, 0.8, 1.7, 0.02), (16, 0.01, 3.0)))  # fmt: skip
    assert cm._probed(cal, 1) == cm.HostProbe(1, 0.0, 1.0, 1.0, 0.0)
    assert cm._probed(replace(cal, host=()), 8) == cm.HostProbe(8, 0.0, 1.0, 1.0, 0.0)
    assert cm._probed(cal, 2) == cm.HostProbe(2, 0.001, 1.5, 1.5, 0.0)
    assert cm._probed(cal, 7) == cm.HostProbe(8, 0.004, 1.0, 1.7, 0.02)
    assert cm._probed(cal, 13) == cm.HostProbe(16, 0.01, 3.0, 3.0, 0.0)
    assert cm.host_cpu(cal, 7) == pytest.approx(0.01)
    assert cm.collective_cpu(cal, 13) == pytest.approx(0.01)
    low = replace(cal, host=((8, 0.0, 1.2, 0.5, 0.0),))
    assert cm._probed(low, 8).free_slowdown == 1.0


def test_bsp_rounds_on_a_shared_host_take_the_probe_nearest_their_workers_and_servers():
    probes = ((6, 2, 0.002, 0.001, 1.0), (10, 2, 0.004, 0.002, 1.0), (10, 4, 0.5, 0.5, 1.0))
    cal = replace(FLAT, cores=2, cpu_s=0.01, ps_host=probes)
    worker = 0.01 + 0.004  # the probe of 8 workers and 2 servers
    total = 8 * worker + 8 * 2 * 0.002
    assert cm.bsp_round(cal, 8, 2, 0.03) == pytest.approx(0.1 - 0.01 + total / 2 + 0.03)
    worker = 0.01 + 0.002  # 4 workers and 2 servers
    assert cm.bsp_round(cal, 4, 2, 0.0) == pytest.approx(0.09 + (4 * worker + 8 * 0.001) / 2)


def test_shared_host_steps():
    cal = replace(FLAT, overlap=0.0, cores=2, cpu_s=0.01, host=((8, 0.002, 2.0),))
    comm = ring(FLAT.grad_bytes, 8, LAT, BW)
    cpu = 0.01 * 2.0 + 0.002
    expected = 0.1 - 0.01 + max(cpu, 8 * cpu / 2) + comm
    check(cm.predict_ddp(cal, 8), "ddp", 8, expected, 0.1, comm, cal=cal)
    p = cm.predict_ps(cal, 6, 2)
    g = cal.grad_bytes
    comm = 2 * LAT + max(2 * g / BW, 2 * 6 * g / 2 / BW)
    push = 0.002 / 2
    expected = max(0.1 + comm, 6 * (0.01 * 2.0 + 2 * push) / 2)
    check(p, "ps K=2", 6, expected, 0.1, comm, cal=cal)


def test_oversubscribed_workers_pay_for_the_rings_cpu_on_shared_cores():
    cal = replace(FLAT, overlap=0.0, cores=2, colocated_slowdown=1.5,
                  collective_cpu_per_byte=1e-9)  # fmt: skip
    compute = 0.1 * 1.5 * (8 / 2)
    assert cm.compute_s(cal, 8) == pytest.approx(compute)
    assert cm.compute_s(cal, 1) == 0.1
    ring_cpu = 1e-9 * 2 * 7 / 8 * cal.grad_bytes
    step = max(compute + ring(cal.grad_bytes, 8, LAT, BW), compute + 4 * ring_cpu)
    assert cm.predict_ddp(cal, 8).step_s == pytest.approx(step)
    assert cm.oversubscribed_step(replace(cal, cores=16), 8, 0.3, 1e9) == 0.3


def test_failures_in_the_plan():
    plan = cm.plan_failures(32, 8, 3600 * 100, 10.0, 60.0, 5.0)
    mtbf = 3600 * 100 / 4
    interval = math.sqrt(2 * 10.0 * mtbf)
    restart = 10.0 / interval + interval / (2 * mtbf) + 60.0 / mtbf
    inplace = (5.0 + 60.0 * 8 / 32) / mtbf
    assert (plan.workers, plan.nodes) == (32, 4)
    assert (plan.job_mtbf_s, plan.checkpoint_interval_s) == pytest.approx((mtbf, interval))
    assert plan.goodput_restart == pytest.approx(1 - restart)
    assert plan.goodput_inplace == pytest.approx(1 - inplace)
    assert plan.lost_h_per_day_restart == pytest.approx(24 * restart)
    assert plan.lost_h_per_day_inplace == pytest.approx(24 * inplace)
    worst = cm.plan_failures(4, 1, 10.0, 100.0, 100.0, 100.0)
    assert (worst.goodput_restart, worst.goodput_inplace) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("text", "value"),
    [("25.6M", 25_600_000), ("7B", 7_000_000_000), ("1.5t", 1_500_000_000_000),
     ("350k", 350_000), ("1e8", 100_000_000), ("1_000_000", 1_000_000), ("3g", 3_000_000_000),
     (" 12 ", 12)],
)  # fmt: skip
def test_counts_as_written(text, value):
    assert cm.parse_count(text) == value


def test_counts_that_are_not_are_refused_naming_the_field():
    with pytest.raises(
        ValueError, match=r"params: expected a number such as 25.6M, 7B or 1e8, got 'x'"
    ):
        cm.parse_count("x", "params")
    with pytest.raises(ValueError, match=r"params: must be at least 1, got '0.4'"):
        cm.parse_count("0.4", "params")
    assert cm.parse_count("1") == 1


@pytest.mark.parametrize(
    ("text", "bps"),
    [("10gbit", 1.25e9), ("100Gb/s", 12.5e9), ("400Gbps", 50e9), ("900GB/s", 900e9),
     ("25GBps", 25e9), ("1.5TB/s", 1.5e12), ("8bit", 1.0), ("2kB", 2e3), ("1e3Mb", 125e6)],
)  # fmt: skip
def test_bandwidths_in_bits_or_bytes(text, bps):
    assert cm.parse_bandwidth(text) == pytest.approx(bps)


def test_bandwidths_that_are_not_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"link: expected bits \(10gbit, 100Gb/s\) or bytes"):
        cm.parse_bandwidth("fast", "link")
    with pytest.raises(ValueError, match="link: must be above 0, got '0gbit'"):
        cm.parse_bandwidth("0gbit", "link")


def test_a_cluster_table_needs_exactly_its_keys(tmp_path):
    table = {"description": "two nodes", "gpus_per_node": 8, "intra_bandwidth": "450GB/s",
             "bandwidth": "400gbit", "latency_us": 5, "sources": ["a datasheet"]}  # fmt: skip
    c = cm._cluster("lab", table)
    assert c == cm.Cluster("lab", "two nodes", 8, 450e9, 50e9, 5.0, ("a datasheet",))
    with pytest.raises(ValueError, match=r"cluster 'lab': expected the keys \['bandwidth'"):
        cm._cluster("lab", {k: v for k, v in table.items() if k != "sources"})
    with pytest.raises(ValueError, match="lab.bandwidth: expected bits"):
        cm._cluster("lab", table | {"bandwidth": "fast"})
    extra = tmp_path / "more.toml"
    extra.write_text('[lab]\ndescription = "x"\ngpus_per_node = 2\nintra_bandwidth = "1GB/s"\n'
                     'bandwidth = "8gbit"\nlatency_us = 1\nsources = []\n')  # fmt: skip
    clusters = cm.load_clusters(extra)
    assert clusters["lab"].bandwidth_Bps == 1e9 and len(clusters) > 1
    extra.write_text("[lab\n")
    with pytest.raises(ValueError, match="--cluster-file"):
        cm.load_clusters(extra)


def write_run(run, records, summary):
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_calibration_from_a_run_and_its_checkpoints(tmp_path):
    records = [{"rank": 0, "step": s, "compute_s": 0.01 * s, "data_s": 0.001, "cpu_s": 0.002,
                "checkpoint_s": 0.5 if s == 6 else 0.0} for s in range(1, 8)]  # fmt: skip
    records += [{"rank": 1, "step": s, "compute_s": 9.0, "data_s": 0.0} for s in range(1, 8)]
    records[5]["cpu_s"] = 0.05  # the save's CPU: not the step's
    summary = {"per_rank": [{"memory": {"param_bytes": 4000}}], "batch_size_per_worker": 16,
               "grad_accum": 2, "overlap": 0.3}  # fmt: skip
    write_run(tmp_path / "run", records, summary)
    cal = cm.calibrate_run(tmp_path / "run")
    assert cal == {"compute_s": pytest.approx(0.056), "cpu_s": pytest.approx(0.002),
                   "batch_size": 32, "grad_bytes": 4000, "overlap": 0.3}  # fmt: skip
    assert cm.calibrate_run(tmp_path / "run", warmup=6)["compute_s"] == pytest.approx(0.071)
    assert cm.measured_checkpoint_s(tmp_path / "run") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="has no steps after the first 7"):
        cm.calibrate_run(tmp_path / "run", warmup=7)
    write_run(tmp_path / "bare", records, {**summary, "per_rank": [{}]})
    with pytest.raises(ValueError, match="summary.json does not say the model's size"):
        cm.calibrate_run(tmp_path / "bare")
    plain = [r | {"checkpoint_s": 0.0} for r in records]
    write_run(tmp_path / "plain", plain, {**summary, "overlap": None})
    assert cm.measured_checkpoint_s(tmp_path / "plain") is None
    assert cm.calibrate_run(tmp_path / "plain")["overlap"] == 0.0


def test_published_rows_are_predicted_from_their_own_base(tmp_path):
    table = tmp_path / "published.toml"
    table.write_text(
        '[lab]\nmethod = "ddp"\nbytes_per_param = 4\nlatency_us = 10\nbandwidth = "80gbit"\n'
        'gpus_per_node = 1\nintra_bandwidth = "80gbit"\nper_gpu = false\n'
        '[[lab.rows]]\nmodel = "m"\nbatch = 32\nparams = 1e7\nbase_gpus = 2\nbase_rate = 640\n'
        "points = [[4, 1200, 0], [8, 2000, 0]]\n"
        '[[lab.rows]]\nmodel = "n"\nbatch = 32\nparams = 1e7\nbase_gpus = 2\nbase_rate = 640\n'
        'points = [[8, 3000, 0]]\nmiss = "why"\n'
    )
    rows = cm.check_published(table)
    assert [(r.source, r.model, r.gpus, r.published, r.unit) for r in rows] == [
        ("lab", "m", 4, 1200.0, "in all"), ("lab", "m", 8, 2000.0, "in all"),
        ("lab", "n", 8, 3000.0, "in all")]  # fmt: skip
    cal = cm.Calibration(compute_s=1.0, batch_size=32, grad_bytes=40_000_000, latency_s=1e-5,
                         bandwidth_Bps=1e10)  # fmt: skip
    compute = 32 / 320 - (cm.predict_ddp(cal, 2).step_s - 1.0)
    for row, gpus in zip(rows, (4, 8, 8), strict=True):
        step = cm.predict_ddp(replace(cal, compute_s=compute), gpus).step_s
        assert row.predicted == pytest.approx(32 / step * gpus)
        assert row.ratio == pytest.approx(row.predicted / row.published)
    assert [r.miss for r in rows] == ["", "", "why"]
    assert rows[0].within == (abs(rows[0].ratio - 1) <= 0.15)
    assert cm.PublishedCheck("s", "m", 1, 100.0, 115.0, "in all").within
    assert not cm.PublishedCheck("s", "m", 1, 100.0, 115.1, "in all").within
