"""Measuring through TVM's own RPC tracker and server, started on 127.0.0.1."""

from __future__ import annotations

import pytest

from ttrank import fleet, frontend, kernels, measure
from ttrank.target import make_target


@pytest.fixture
def tracker():
    # fleet.local_fleet kills each process group: TVM's tracker and server each run in a child
    with fleet.local_fleet(1, key="ttrank-test") as f:
        yield f.address, f.tracker.key


def test_measure_through_rpc_tracker(tracker, tiny_cnn, lookup_kernel):
    address, key = tracker
    target = make_target()
    model = frontend.load(tiny_cnn)
    ks = [k for k in kernels.extract(model.mod, target) if k.tunable][:2]
    m = measure.Measurer(target, measure.RunnerSpec.from_tracker(address, key))
    try:
        res = m.measure([k.mod for k in ks], reference=ks[0].mod, reference_key="rpc-ref")
        assert res[0].ok and res[0].latency_s > 0  # the reference against itself
        assert res[1].status == "wrong_result"  # a different kernel is caught before running
        res = m.measure([ks[1].mod, lookup_kernel])
        assert res[0].ok and len(res[0].all_secs) == m.spec.repeat * m.spec.rounds
        assert res[1].ok, res[1].error  # its indices in bounds on the device too
    finally:
        m.close()
    assert m.spec.describe() == f"rpc://{address}/{key}"
