"""A fleet of TVM RPC servers under one key: collect measures on all of them at once."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest

from ttrank import collect, donors, fleet, frontend, measure, runtime
from ttrank.cli import main
from ttrank.errors import DeviceError
from ttrank.target import make_target


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "tiny_cnn.jsonl").read_text().splitlines()]


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[int]:
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0] * len(x)
        for pos, i in enumerate(order):
            r[i] = pos
        return r

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def _fleet_collect(donor_dir: Path, tiny_cnn: Path, target, tmp_path: Path, **kw) -> tuple:
    """collect on tiny_cnn through a tracker and two servers on 127.0.0.1 (free ports)."""
    store = donors.DonorStore.load([donor_dir])
    with fleet.local_fleet(2, key=f"fleet-{uuid.uuid4().hex[:8]}", log_dir=tmp_path / "logs") as f:
        spec = measure.RunnerSpec.from_tracker(f.address, f.tracker.key, rounds=2)  # 2: both devices at once
        m = measure.Measurer(target, spec)
        try:
            stats = collect.collect("tiny_cnn", frontend.load(tiny_cnn), store, tmp_path / "out", target,
                                    m, **kw)
            runner = m.runner
            peak, devices_seen = runner.peak(), set(runner.answers)
        finally:
            m.close()
        served = f.sessions_served()
    assert stats.valid > 0
    rows = [r for r in _rows(tmp_path / "out") if r["record"] != collect.UNTUNED]
    keys = [collect.measurement_key(r) for r in rows]
    assert len(keys) == len(set(keys))  # every candidate measured once, no duplicates
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:  # built once, run once per pass, each pass on whichever device was free
        assert len(r["devices"]) == spec.rounds and set(r["devices"]) <= devices_seen
    used = {d for r in ok for d in r["devices"]}
    # both servers measured, at the same time, and their logs say they served sessions
    assert len(used) == 2 and peak == 2 and all(n > 0 for n in served), (used, peak, served)
    # the device's own CPU and target, as it reports them
    prov = ok[0]["provenance"]
    assert prov["device_key"] == spec.device_key and prov["mcpu"] == str(target.attrs["mcpu"])
    assert prov["device_triple"] and sorted(prov["devices"]) == sorted(devices_seen)
    return rows, ok


def test_fleet_collect_measures_on_both_servers(donor_dir, tiny_cnn, target, measurements, tmp_path):
    """The fast variant: a few candidates per kernel, checked against the local run's set."""
    rows, _ = _fleet_collect(donor_dir, tiny_cnn, target, tmp_path, max_per_kernel=2)
    local = {collect.measurement_key(r) for r in _rows(measurements) if r["record"] != collect.UNTUNED}
    assert {collect.measurement_key(r) for r in rows} <= local


@pytest.mark.slow
def test_fleet_collect_matches_the_local_ranking(donor_dir, tiny_cnn, target, measurements, tmp_path):
    """The whole local run again through the fleet (about 100 s on one shared core)."""
    rows, ok = _fleet_collect(donor_dir, tiny_cnn, target, tmp_path, max_per_kernel=12,
                              paper_donor="tiny_resnet")
    local = {collect.measurement_key(r): r for r in _rows(measurements) if r["record"] != collect.UNTUNED}
    assert {collect.measurement_key(r) for r in rows} == set(local)  # the same candidates
    # the ranking matches the local run's, within noise (microsecond kernels, one shared core)
    by_kernel: dict[str, list[tuple[float, float]]] = {}
    for r in ok:
        lr = local[collect.measurement_key(r)]
        if lr["status"] == "ok":
            by_kernel.setdefault(r["workload"], []).append((r["latency_s"], lr["latency_s"]))
    rhos = [_spearman([a for a, _ in v], [b for _, b in v]) for v in by_kernel.values() if len(v) >= 4]
    assert rhos and sum(rhos) / len(rhos) > 0.5, rhos


def test_a_key_whose_devices_report_different_cpus_is_refused():
    devices = {"10.0.0.1:9090": {"mcpu": "cortex-a72", "triple": "aarch64-linux-gnu", "threads": 4},
               "10.0.0.2:9090": {"mcpu": "cortex-a53", "triple": "aarch64-linux-gnu", "threads": 4}}
    with pytest.raises(DeviceError, match="report different CPUs"):
        fleet.one_cpu(devices, "rpi")
    same = fleet.one_cpu({k: {**v, "mcpu": "cortex-a72"} for k, v in devices.items()}, "rpi")
    assert same["mcpu"] == "cortex-a72" and len(same["devices"]) == 2


def test_a_fleet_key_with_no_device_waits_then_one_line(tmp_path):
    with fleet.local_fleet(0, key="nobody", log_dir=tmp_path) as f:
        spec = measure.RunnerSpec.from_tracker(f.address, "nobody", device_wait_s=2)
        with pytest.raises(DeviceError, match="lists no device with key 'nobody' \\(waited 2 s"):
            spec.check()


def test_a_port_taken_before_the_tracker_and_server_bind_it_is_replaced(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        # the tracker, then the server, are first handed a port some other program holds (the
        # server started beside the first tracker goes with it; the next pair gets the ports
        # after that)
        ports = iter([taken.getsockname()[1], None, None, taken.getsockname()[1]])
        real = fleet.free_port
        monkeypatch.setattr(fleet, "free_port", lambda: next(ports, None) or real())
        with fleet.local_fleet(1, key="taken", log_dir=tmp_path) as f:
            assert f.tracker.port != taken.getsockname()[1]
            assert f.tracker.devices() == 1
    assert "cannot bind" in (tmp_path / "tracker.log").read_text()
    assert "cannot bind" in (tmp_path / "server0.log").read_text()


def test_peak_concurrency():
    assert fleet.peak_concurrency([(0, 2), (1, 3), (2.5, 4)]) == 2
    assert fleet.peak_concurrency([]) == 0


def test_a_device_that_joins_with_another_cpu_stops_the_fleet():
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, RunnerInput

    r = fleet.FleetRunner(fleet.Tracker("127.0.0.1", 1, "rpi"), EvaluatorConfig())
    a72 = {"mcpu": "cortex-a72", "triple": "aarch64-linux-gnu", "threads": 4}
    r.record("a/kernel.so", {"device": "10.0.0.1:9090", "info": a72, "start": 0.0, "end": 1.0})
    r.record("b/kernel.so", {"device": "10.0.0.2:9090", "info": {**a72, "mcpu": "cortex-a53"},
                             "start": 0.5, "end": 2.0})
    assert "report different CPUs" in r.conflict and r.peak() == 2
    assert r.runs_of("a/kernel.so") == ["10.0.0.1:9090"]
    # through MetaSchedule (tune), each run then fails with the reason instead of running
    (fut,) = r.run([RunnerInput("a/kernel.so", "cpu", [])])
    assert "report different CPUs" in fut.result().error_msg


def test_the_whole_model_is_timed_only_where_its_kernels_were(target):
    # a cross-compiled target, or kernels measured on RPC devices: the host's clock is not theirs
    board = make_target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert "aarch64-linux-gnu" in runtime.host_cannot_time(board)
    assert "RPC devices" in runtime.host_cannot_time(target, remote=True)
    assert runtime.host_cannot_time(target) is None


@pytest.mark.slow
def test_tune_and_recommend_measure_through_the_fleet(trained, donor_dir, tiny_cnn, tmp_path, capsys):
    """The CLI as a team with a rack of boxes runs it: both commands under one tracker key."""
    with fleet.local_fleet(2, key=f"fleet-{uuid.uuid4().hex[:8]}", log_dir=tmp_path / "logs") as f:
        rpc = ["--rpc-tracker", f.address, "--device-key", f.tracker.key]
        assert main(["tune", str(tiny_cnn), "--out", str(tmp_path / "tuned"), "--trials-per-task", "8",
                     "--only", "fused_conv2d1_add_relu", "--no-progress", *rpc]) == 0
        manifest = json.loads((tmp_path / "tuned" / "tune_manifest.json").read_text())
        assert manifest["complete"] and manifest["provenance"]["device_key"] == f.tracker.key
        report = tmp_path / "report.json"
        assert main(["recommend", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--ranker", str(trained),
                     "--donors", str(donor_dir), "--json", str(report), "--data-dir", str(tmp_path / "data"),
                     "--top-k", "2", "--tune-missing", "0", "--no-progress", *rpc]) == 0, capsys.readouterr().err
        served = f.sessions_served()
    r = json.loads(report.read_text())
    assert any(k["status"] == "tuned" for k in r["kernels"])
    # every row recommend measured names the devices' key and CPU, for the ranker to learn from
    (table,) = (tmp_path / "data" / "measurements").glob("*.jsonl")
    rows = [json.loads(ln) for ln in table.read_text().splitlines()]
    assert rows and all(x["provenance"]["device_key"] == f.tracker.key for x in rows)
    assert sum(served) >= 2 and all(n > 0 for n in served), served  # both boxes measured
