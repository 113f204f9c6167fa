"""Measuring through TVM's own RPC tracker and server, started on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from ttrank import frontend, kernels, measure
from ttrank.target import make_target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_registered(port: int, key: str) -> bool:
    from tvm import rpc

    try:
        summary = rpc.connect_tracker("127.0.0.1", port).summary()
    except Exception:
        return False
    return any(q == key and info["free"] > 0 for q, info in summary["queue_info"].items())


@pytest.fixture
def tracker():
    tport, sport, key = _free_port(), _free_port(), "ttrank-test"
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                               "--port", str(tport), "--port-end", str(tport + 1)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    time.sleep(1.0)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tport}", "--key", key,
         "--host", "127.0.0.1", "--port", str(sport), "--port-end", str(sport + 1)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.time() + 60
        while not _server_registered(tport, key):
            assert time.time() < deadline, "the RPC server did not register with the tracker"
            time.sleep(0.5)
        yield f"127.0.0.1:{tport}", key
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_measure_through_rpc_tracker(tracker, tiny_cnn):
    address, key = tracker
    target = make_target()
    model = frontend.load(tiny_cnn)
    ks = [k for k in kernels.extract(model.mod, target) if k.tunable][:2]
    m = measure.Measurer(target, measure.RunnerSpec.from_tracker(address, key))
    try:
        res = m.measure([k.mod for k in ks], reference=ks[0].mod, reference_key="rpc-ref")
        assert res[0].ok and res[0].latency_s > 0  # the reference against itself
        assert res[1].status == "wrong_result"  # a different kernel is caught before running
        res = m.measure([ks[1].mod])
        assert res[0].ok and len(res[0].all_secs) == m.spec.repeat * m.spec.rounds
    finally:
        m.close()
    assert m.spec.describe() == f"rpc://{address}/{key}"
