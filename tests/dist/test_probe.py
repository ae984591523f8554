"""The host probes that calibrate the cost model at scale (analysis/probe.py), run for real
at a small size: W processes on loopback, a bsp parameter server's rounds over its own links."""

from __future__ import annotations

from scaletrain.analysis.probe import probe_host, probe_ps
from tests.conftest import stress_only


@stress_only  # 18-24 s; every make stress round runs it, and make scale the probes themselves
def test_the_probes_measure_the_cpu_of_collectives_and_of_parameter_server_rounds():
    [probed] = probe_host(0.002, [2], pieces=4)
    assert probed.world == 2 and 0 < probed.collective_cpu_s < 1 and probed.slowdown > 0
    assert probed.free_slowdown > 0 and 0 <= probed.free_wait_s < 1
    [(world, servers, exchange, per_push, slowdown)] = probe_ps(0.002, [(3, 1)])
    assert (world, servers) == (3, 1)
    assert 0 < exchange < 1 and 0 < per_push < 1 and slowdown > 0


def test_a_probe_that_fails_says_which_rank_and_why():
    """The probe's processes are forked (as the workers are); one that raises exits 1 and
    its traceback is the error's text, none is left behind."""
    import pytest

    from scaletrain.analysis.probe import _local

    with pytest.raises(RuntimeError, match=r"(?s)rank 0 exited 1: .*ValueError"):
        _local(1, ("not-a-size",))
