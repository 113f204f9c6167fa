"""Measuring on every device behind one TVM RPC tracker key at once.

A key names one kind of device (``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``
on each). :class:`FleetRunner` is a MetaSchedule runner, like TVM's ``RPCRunner``, with three
differences that a fleet needs:

- its worker pool is sized to the servers the tracker lists under the key, and re-sized before
  each batch, so devices that join are used and devices that left are not waited for;
- each run says which device measured it and what that device reports about itself (its LLVM
  CPU name, triple and runtime threads, asked through the session), so rows record the
  device's CPU, never the host's, and a key whose devices disagree is refused;
- a run whose device disappears is given once more to the pool (the tracker hands it to
  another device, the dead one having left), then fails with both reasons.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.runner import (
    EvaluatorConfig,
    PyRunner,
    PyRunnerFuture,
    RunnerFuture,
    RunnerInput,
    RunnerResult,
)
from tvm.support.popen_pool import PopenPoolExecutor

from .errors import DeviceError

# What TVM's RPC says when the device's end of a session disappears (server killed, network)
DEVICE_LOST = re.compile(r"RPCCode|[Ss]ocket|[Cc]onnection|Broken pipe|closed|EOF|no device with key")
# How often an empty key is asked again while waiting for a device to register
WAIT_POLL_S = 1.0


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else text[:500]


# --------------------------------------------------------------------------------------------
# The tracker


def tracker_summary(host: str, port: int, timeout_s: float) -> dict:
    """The tracker's summary, through TVM's own client, in bounded time."""
    from tvm import rpc

    where = f"RPC tracker {host}:{port}"
    try:  # TVM's client retries a refused connection for 60 s; say it at once instead
        socket.create_connection((host, port), timeout=min(timeout_s, 5.0)).close()
    except OSError as e:
        raise DeviceError(f"{where} cannot be reached: {e.strerror or e}") from None
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["summary"] = rpc.connect_tracker(host, port).summary()
        except Exception as e:  # noqa: BLE001 - reported in the caller's thread
            box["error"] = f"{type(e).__name__}: {last_line(str(e))}"

    # the client has no timeout of its own: a silent peer would block it forever
    t = threading.Thread(target=ask, name="ttrank-tracker-query", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise DeviceError(f"{where} did not answer within {timeout_s:g} s (is it a TVM RPC tracker?)")
    if "error" in box:
        raise DeviceError(f"{where} did not answer as a TVM RPC tracker: {box['error']}")
    return box["summary"]


@dataclass(frozen=True)
class Tracker:
    """One key at one TVM RPC tracker: the devices a fleet run measures on."""

    host: str
    port: int
    key: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def servers(self, timeout_s: float = 10.0) -> list[str]:
        """Addresses (host:port) of the servers registered under the key, free or busy."""
        summary = tracker_summary(self.host, self.port, timeout_s)
        out = []
        for s in summary.get("server_info", []):
            if s.get("key") == f"server:{self.key}":
                addr = s.get("addr") or ["?", "?"]
                out.append(f"{addr[0]}:{addr[1]}")
        return out

    def devices(self, timeout_s: float = 10.0) -> int:
        return len(self.servers(timeout_s))

    def wait_for_device(self, wait_s: float, timeout_s: float = 10.0) -> int:
        """The number of devices under the key, waiting up to ``wait_s`` for a first one."""
        deadline = time.time() + wait_s
        while True:
            n = self.devices(timeout_s)
            if n or time.time() >= deadline:
                break
            time.sleep(WAIT_POLL_S)
        if not n:
            raise DeviceError(
                f"RPC tracker {self} lists no device with key {self.key!r} (waited {wait_s:g} s; "
                f"start one: python -m tvm.exec.rpc_server --tracker {self} --key {self.key})")
        return n

    def request(self, session_timeout_s: float = 0) -> tuple[Any, str]:
        """A session on one free device under the key, and that device's address.

        TVM's ``TrackerSession.request`` does the same but does not say which server it got;
        this speaks the tracker's protocol (one REQUEST, one answer) and connects itself.
        It waits as long as no device is free: callers bound that (:class:`FleetRunner`'s
        poll, :meth:`wait_for_device`).
        """
        from tvm import rpc
        from tvm.rpc import base

        sock = socket.create_connection((self.host, self.port))
        try:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
                raise RuntimeError(f"{self} is not a TVM RPC tracker")
            base.sendjson(sock, [base.TrackerCode.REQUEST, self.key, "", 1])
            value = base.recvjson(sock)
        finally:
            sock.close()
        if value[0] != base.TrackerCode.SUCCESS:
            raise RuntimeError(f"tracker {self} refused a session for {self.key!r}: {value}")
        host, port, matchkey = value[1]
        return rpc.connect(host, port, matchkey, session_timeout=session_timeout_s), f"{host}:{port}"


# --------------------------------------------------------------------------------------------
# What a device says about itself


def ask_device(session) -> dict[str, Any]:
    """The device's own answer: LLVM's name for its CPU, its triple, its runtime's threads.

    These are TVM's global functions, evaluated on the device through the session. A device
    that runs only TVM's runtime (no LLVM, e.g. the C++ ``tvm_rpc`` on a board) has no
    ``target.llvm_get_system_cpu``: its CPU is then None (unknown), not the host's.
    """

    def call(name: str):
        try:
            return session.get_function(name)()
        except Exception:  # noqa: BLE001 - a function the device's runtime does not have
            return None

    mcpu, triple, threads = (call("target.llvm_get_system_cpu"), call("target.llvm_get_system_triple"),
                             call("runtime.NumThreads"))
    return {"mcpu": str(mcpu) if mcpu is not None else None,
            "triple": str(triple) if triple is not None else None,
            "threads": int(threads) if threads is not None else None}


def probe(tracker: Tracker, devices: int, wait_s: float) -> dict[str, dict]:
    """Ask each of ``devices`` devices about itself: {address: answer}.

    The sessions are held until all are open (or ``wait_s`` passes), so the tracker hands out
    a different device to each. Devices busy for longer than that are asked later, by their
    first measurement.
    """
    found: dict[str, dict] = {}
    errors: list[str] = []
    barrier = threading.Barrier(devices)

    def one() -> None:
        try:
            sess, addr = tracker.request(session_timeout_s=wait_s + 30)
            found[addr] = ask_device(sess)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(last_line(str(e)))
            barrier.abort()
            return
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=wait_s)
        del sess

    threads = [threading.Thread(target=one, daemon=True, name="ttrank-probe") for _ in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s + 10)
    if not found:
        why = errors[0] if errors else f"no device was free within {wait_s:g} s"
        raise DeviceError(f"cannot open a session on any device with key {tracker.key!r} at "
                          f"RPC tracker {tracker}: {why}")
    return dict(found)


def one_cpu(devices: dict[str, dict], key: str) -> dict[str, Any]:
    """The one CPU the key's devices report, or :class:`DeviceError` when they disagree."""
    kinds: dict[tuple, list[str]] = {}
    for addr, info in sorted(devices.items()):
        kinds.setdefault((info.get("mcpu"), info.get("triple")), []).append(addr)
    if len(kinds) > 1:
        said = "; ".join(f"{', '.join(a)}: {m or 'unknown CPU'} ({t or '?'})" for (m, t), a in kinds.items())
        raise DeviceError(f"the devices under key {key!r} report different CPUs ({said}); a key "
                          "must name one kind of device: start each kind under its own --key")
    (mcpu, triple), _ = next(iter(kinds.items()))
    threads = {i.get("threads") for i in devices.values()} - {None}
    return {"mcpu": mcpu, "triple": triple, "threads": min(threads) if threads else None,
            "devices": sorted(devices)}


# --------------------------------------------------------------------------------------------
# The runner

def alloc_in_bounds(device, args_info, alloc_repeat: int, random_fill=None) -> list:
    """MetaSchedule's argument allocation (random floats) with integer tensors zero: they are
    indices more often than not (take, gather, embedding lookups), and random ones fall outside
    the table, so the kernel crashed instead of being timed. ``random_fill``: an RPC session's
    (default: this process's)."""
    import numpy as np
    import tvm
    from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common

    random_fill = random_fill or tvm.get_global_func("tvm.contrib.random.random_fill_for_measure")

    def fill(arr) -> None:
        if arr.dtype.startswith(("int", "uint", "bool")):
            arr.copyfrom(np.zeros(tuple(arr.shape), dtype=arr.dtype))
        else:
            random_fill(arr)

    return alloc_argument_common(fill, device, args_info, alloc_repeat)


# per worker process: what each device said about itself (asked once per device)
_ANSWERS: dict[str, dict] = {}


def run_on_device(tracker: Tracker, session_timeout_s: float, evaluator_config: EvaluatorConfig,
                  artifact_path: str, device_type: str, args_info: tuple) -> dict[str, Any]:
    """Measure one built candidate on whichever device the tracker hands out (pool worker)."""
    from tvm.s_tir.meta_schedule.runner.rpc_runner import (
        default_cleanup,
        default_run_evaluator,
        default_upload_module,
    )
    from tvm.s_tir.meta_schedule.utils import get_global_func_on_rpc_session

    session, addr = tracker.request(session_timeout_s)
    remote_path = None
    try:
        t0 = time.time()
        info = _ANSWERS.get(addr) or _ANSWERS.setdefault(addr, ask_device(session))
        device = session.device(device_type, 0)
        remote_path = os.path.basename(artifact_path)
        rt_mod = default_upload_module(session, artifact_path, remote_path)
        fill = get_global_func_on_rpc_session(session, "tvm.contrib.random.random_fill_for_measure",
                                              "the device's TVM runtime has no random fill")
        args = alloc_in_bounds(device, args_info, 1, fill)
        secs = default_run_evaluator(session, rt_mod, device, evaluator_config, args)
        return {"secs": [float(s) for s in secs], "device": addr, "info": info,
                "start": t0, "end": time.time()}
    except Exception as e:
        # the address is what tells a lost device from a failing candidate's later retry
        raise RuntimeError(f"on device {addr}: {last_line(str(e))}") from None
    finally:
        with contextlib.suppress(Exception):
            default_cleanup(session, remote_path)


@derived_object
class FleetFuture(PyRunnerFuture):
    """One candidate's run; a run lost with its device is submitted once more."""

    def __init__(self, runner: FleetRunner, args: tuple) -> None:
        super().__init__()
        self.runner = runner
        self.args = args
        self.future = runner.submit(args)
        self.lost: str = ""  # why the first attempt failed, when its device went away
        self.device: str = ""  # who measured it
        self._result: RunnerResult | None = None

    def done(self) -> bool:
        if self._result is not None:
            return True
        if not self.future.done():
            return False
        try:
            out = self.future.result()
        except Exception as e:  # noqa: BLE001 - a failed run is a result, not a crash
            msg = last_line(str(e)) or type(e).__name__
            if not self.lost and not self.runner.stopped and DEVICE_LOST.search(msg):
                self.lost = msg  # retried once: the tracker no longer lists the dead device
                self.future = self.runner.submit(self.args)
                return False
            if self.lost:
                msg = f"RPC device lost mid-measure ({self.lost}); retried on another device: {msg}"
            self._result = RunnerResult(None, "RPCRunner: An exception occurred\n" + msg)
            return True
        self.device = out["device"]
        self.runner.record(self.args[0], out)
        self._result = RunnerResult(out["secs"], None)
        return True

    def result(self) -> RunnerResult:
        while not self.done():
            time.sleep(0.01)
        assert self._result is not None
        return self._result


@derived_object
class _Failed(PyRunnerFuture):
    """A run that could not start."""

    def __init__(self, msg: str) -> None:
        super().__init__()
        self.msg = msg

    def done(self) -> bool:
        return True

    def result(self) -> RunnerResult:
        return RunnerResult(None, self.msg)


@derived_object
class FleetRunner(PyRunner):
    """A MetaSchedule runner over every device under one tracker key, sized to the fleet."""

    def __init__(self, tracker: Tracker, evaluator_config: EvaluatorConfig,
                 session_timeout_s: float = 30.0, device_wait_s: float = 30.0) -> None:
        super().__init__()
        self.tracker = tracker
        self.evaluator_config = evaluator_config
        self.session_timeout_s = session_timeout_s
        self.device_wait_s = device_wait_s
        self.pool: PopenPoolExecutor | None = None
        self.workers = 0
        self.answers: dict[str, dict] = {}  # device -> what it reported
        self.sessions: list[tuple[str, float, float]] = []  # (device, start, end) per run
        # artifact -> the device of each of its runs (futures that come back through TVM's FFI
        # are plain RunnerFutures, so this is where the caller looks)
        self.runs: dict[str, list[str]] = {}
        self.stopped = False  # abandoned: lost runs are not retried
        self._pending: list = []  # the pool's futures of runs not yet done, for stop() to cancel
        self.conflict = ""  # the devices report different CPUs: nothing more runs
        self._lock = threading.Lock()

    def resize(self) -> int:
        """One worker per device the tracker lists now (asked before every batch)."""
        n = self.tracker.wait_for_device(self.device_wait_s)
        if n != self.workers:
            old, self.pool, self.workers = self.pool, PopenPoolExecutor(max_workers=n), n
            if old is not None:  # the previous batch's runs have all been collected
                old.shutdown(wait=True)
        return n

    def submit(self, args: tuple):
        assert self.pool is not None
        fut = self.pool.submit(run_on_device, self.tracker, self.session_timeout_s,
                               self.evaluator_config, *args)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        try:
            if self.conflict:
                raise DeviceError(self.conflict)
            self.resize()
        except DeviceError as e:
            # raised through TVM's FFI it would lose its type: each run fails with the reason
            # (ttrank's Measurer resizes first, and so raises it as it is)
            return [_Failed(str(e)) for _ in runner_inputs]
        return [FleetFuture(self, (str(ri.artifact_path), str(ri.device_type),
                                   tuple(a.as_json() for a in ri.args_info)))
                for ri in runner_inputs]

    def record(self, artifact: str, out: dict) -> None:
        """Keep who measured a run; a device reporting another CPU than the rest is refused."""
        with self._lock:
            self.sessions.append((out["device"], out["start"], out["end"]))
            self.runs.setdefault(artifact, []).append(out["device"])
            if out["device"] not in self.answers:
                self.answers[out["device"]] = out["info"]
                try:  # a device that joined later with another CPU
                    one_cpu(self.answers, self.tracker.key)
                except DeviceError as e:  # kept, not raised: this runs inside TVM's FFI calls
                    self.conflict = str(e)

    def runs_of(self, artifact: str) -> list[str]:
        return self.runs.pop(artifact, [])

    def peak(self) -> int:
        """The most devices that measured at the same moment."""
        return peak_concurrency([(s, e) for _, s, e in self.sessions])

    def stop(self) -> None:
        """Retry nothing more, and start nothing more: the caller is abandoning this runner's
        runs. A run still queued for a worker would wait for a session forever once no device
        is left (with one device and three queued, that was 30 s of the caller's cleanup)."""
        self.stopped = True
        with self._lock:
            for f in self._pending:
                f.cancel()  # only what has not started: the caller kills the running ones

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool, self.workers = None, 0


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = now = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


# --------------------------------------------------------------------------------------------
# A fleet on this machine (tests, benchmarks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalFleet:
    """A TVM RPC tracker and its servers, all processes of this machine."""

    tracker: Tracker
    procs: list[subprocess.Popen] = field(default_factory=list)  # every one started, to kill
    logs: list[Path] = field(default_factory=list)  # one per server
    servers: list[subprocess.Popen] = field(default_factory=list)  # the ones that registered

    @property
    def address(self) -> str:
        return str(self.tracker)

    def sessions_served(self) -> list[int]:
        """Per server, how many sessions its log says it served."""
        return [p.read_text().count("start serving") if p.exists() else 0 for p in self.logs]


def _kill_group(proc: subprocess.Popen) -> None:
    # TVM's tracker and server each run in a child process: the whole group goes
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _tail(log: Path, lines: int = 4) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return f"{log.name}: " + (" | ".join(text[-lines:]) or "(empty)")


# A process that has not answered by then is started again on fresh ports: TVM's server gives up
# on a tracker it cannot reach within 60 s but stays alive, and a port picked free may be taken
# by the time the process binds it.
RESTART_AFTER_S = 45.0


@contextlib.contextmanager
def local_fleet(devices: int, key: str = "ttrank-fleet", cores: list[str] | None = None,
                log_dir: str | Path | None = None, env: dict | None = None,
                register_s: float = 180.0) -> Iterator[LocalFleet]:
    """Start a tracker and ``devices`` servers under ``key`` on 127.0.0.1 (free ports); server
    ``i`` runs under ``taskset -c cores[i]`` when given. Everything is killed afterwards."""
    own_logs = log_dir is None  # removed afterwards; a given folder is the caller's to read
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ttrank-fleet-"))
    logs.mkdir(parents=True, exist_ok=True)
    fleet = LocalFleet(Tracker("127.0.0.1", 0, key))
    fleet.logs = [logs / f"server{i}.log" for i in range(devices)]
    tracker_log = logs / "tracker.log"
    deadline = time.time() + register_s

    def start(cmd: list[str], log: Path, core: str | None) -> subprocess.Popen:
        pin = ["taskset", "-c", core] if core else []
        with open(log, "a") as f:  # appended: a restart keeps what the last try said
            proc = subprocess.Popen(pin + [sys.executable, "-m", *cmd], stdout=f, stderr=f,
                                    start_new_session=True, env=env)
        fleet.procs.append(proc)
        return proc

    def give_up(what: str) -> None:
        tails = "; ".join(_tail(p) for p in [tracker_log, *fleet.logs])
        raise RuntimeError(f"{what} within {register_s:g} s ({tails})")

    def reachable() -> bool:
        try:
            fleet.tracker.servers(timeout_s=5.0)
            return True
        except DeviceError:
            return False

    servers: dict[int, tuple[int, subprocess.Popen, float]] = {}  # index -> port, process, start

    def start_server(i: int) -> None:
        port = free_port()
        servers[i] = (port, start(["tvm.exec.rpc_server", "--tracker", fleet.address, "--key", key,
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--port-end", str(port + 1)],
                                  fleet.logs[i], cores[i % len(cores)] if cores else None),
                      time.time())

    try:
        while True:  # the tracker, on a fresh port each try
            port = free_port()
            fleet.tracker = Tracker("127.0.0.1", port, key)
            proc = start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                          "--port-end", str(port + 1)], tracker_log, cores[0] if cores else None)
            # the servers start beside it: each process imports TVM first (seconds, as long as
            # the tracker's), then connects, retrying until the tracker listens
            for i in range(devices):
                start_server(i)
            began = time.time()
            while proc.poll() is None and not reachable() and time.time() - began < RESTART_AFTER_S \
                    and time.time() < deadline:
                time.sleep(0.5)
            if proc.poll() is None and reachable():
                break
            for p in [proc, *(sp for _, sp, _ in servers.values())]:  # they know its old port
                _kill_group(p)
            if time.time() >= deadline:
                give_up("the RPC tracker did not start")
        while True:
            with contextlib.suppress(DeviceError):
                ports = {int(a.rsplit(":", 1)[1]) for a in fleet.tracker.servers(timeout_s=5.0)}
                missing = [i for i, (port, _, _) in servers.items() if port not in ports]
                if not missing:
                    break
                for i in missing:
                    _, proc, began = servers[i]
                    if proc.poll() is not None or time.time() - began > RESTART_AFTER_S:
                        _kill_group(proc)
                        start_server(i)
            if time.time() > deadline:
                give_up("the RPC servers did not register with the tracker")
            time.sleep(0.5)
        fleet.servers = [servers[i][1] for i in range(devices)]
        yield fleet
    finally:
        for p in reversed(fleet.procs):
            _kill_group(p)
        if own_logs:
            shutil.rmtree(logs, ignore_errors=True)
