"""Reliability: quiet and true output, hostile files, concurrent writers, and faults survived.

Most tests run the real command line in processes of their own (``ttrank.reliability``), the
way a user meets a failure: one clear line and nothing lost, or a result.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
from onnx import TensorProto, helper

from ttrank import fleet, frontend, fuzz, kernels, measure, reliability, runtime, util
from ttrank.cli import main
from ttrank.errors import TooLargeError, UnsafeModelError


@pytest.fixture
def env(tmp_path) -> dict:
    """A process environment with its own cache (native logs, index caches)."""
    return {**os.environ, "TTRANK_CACHE": str(tmp_path / "cache")}


def _logs(env: dict) -> list[Path]:
    return sorted((Path(env["TTRANK_CACHE"]) / "logs").glob("*.log"))


# --- quiet, true output ---------------------------------------------------------------------

def test_a_recovered_import_is_one_note_and_the_importers_words_stay_in_the_native_log(paddle_style, env):
    a = reliability.ttrank("kernels", str(paddle_style), "--input-shape", "x:1,3,16,16", env=env)
    assert a.returncode == 0, a.stderr
    # TVM's importer prints "Error converting operator Reshape ..." on the first try: not here
    assert "Error converting" not in a.stdout + a.stderr
    assert len(a.lines) == 1 and a.lines[0].startswith("ttrank: note: simplified the graph")
    assert "Reshape" in a.lines[0]
    assert _logs(env) == []  # a run that succeeded leaves no log behind
    loud = reliability.ttrank("-v", "kernels", str(paddle_style), "--input-shape", "x:1,3,16,16", env=env)
    assert loud.returncode == 0 and "Error converting operator Reshape" in loud.stderr
    # -v goes before the subcommand or anywhere after it
    loud = reliability.ttrank("kernels", str(paddle_style), "--input-shape", "x:1,3,16,16", "-v", env=env)
    assert loud.returncode == 0 and "Error converting operator Reshape" in loud.stderr


def _unimportable(path: Path) -> Path:
    """A MatMul of a 1x4 input with a 5x3 weight: TVM's importer refuses it."""
    v = helper.make_tensor_value_info
    w = onnx.numpy_helper.from_array(np.ones((5, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bad",
                          [v("x", TensorProto.FLOAT, [1, 4])], [v("y", TensorProto.FLOAT, [1, 3])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


def test_the_native_log_is_named_only_when_it_explains_the_failure(tmp_path, env):
    junk = tmp_path / "notes.onnx"
    junk.write_text("not a model")
    a = reliability.ttrank("kernels", str(junk), env=env)
    assert a.verdict == "user_error" and a.returncode == 2 and len(a.lines) == 1, a.stderr
    assert "native log" not in a.stderr and _logs(env) == []  # TVM never ran: no pointer, no file
    a = reliability.ttrank("kernels", str(_unimportable(tmp_path / "mm.onnx")), env=env)
    assert a.verdict == "user_error" and "TVM's ONNX importer failed on MatMul" in a.last
    assert a.lines[0].startswith("ttrank: TVM's native log of this run: ")
    log = Path(a.lines[0].split(": ", 2)[-1])
    assert log in _logs(env) and "Error converting operator MatMul" in log.read_text()


# --- hostile files --------------------------------------------------------------------------

def test_absurd_shapes_are_refused_before_anything_is_imported_or_compiled(tmp_path, monkeypatch, capsys):
    def must_not_run(*a, **kw):
        raise AssertionError("an absurd model reached TVM")

    monkeypatch.setattr(frontend, "_import", must_not_run)
    monkeypatch.setattr(runtime, "compile_model", must_not_run)
    for make in (reliability.absurd_input_model, reliability.absurd_intermediate_model,
                 reliability.absurd_initializer_model):
        path = make(tmp_path / f"{make.__name__}.onnx")
        with pytest.raises(TooLargeError, match="more than this machine's memory"):
            frontend.load(path)
        assert main(["compile", str(path), "-o", str(tmp_path / "m.so")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ttrank: error: ") and "refused before" in err
    assert not (tmp_path / "m.so").exists()
    assert "1e+13 values, 40 TB" in str(pytest.raises(TooLargeError, frontend.load,
                                                      tmp_path / "absurd_input_model.onnx").value)


def test_external_data_must_stay_inside_the_models_folder(tmp_path, capsys):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    (folder / "weights.bin").parent.mkdir()
    (folder / "weights.bin").write_bytes(np.ones(16, np.float32).tobytes())
    (folder / "link.bin").symlink_to(secret)
    for location in ("../secret.bin", str(secret), "link.bin", "sub/../../secret.bin"):
        path = reliability.external_data_model(folder, location, "m.onnx")
        with pytest.raises(UnsafeModelError, match="outside the model's folder"):
            frontend.load(path)
        assert main(["kernels", str(path)]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    # data kept beside the model, as exporters write it, loads
    model = frontend.load(reliability.external_data_model(folder, "weights.bin", "ok.onnx"))
    assert model.inputs[0].shape == [16]


def test_a_malicious_donor_logs_records_are_never_replayed(donor_dir, tiny_cnn, tmp_path, env):
    res = reliability.malicious_donor_scenario(donor_dir, tiny_cnn, tmp_path, env=env)
    # every record carries the annotation: nothing is left to add
    assert res["verdict"] == "user_error" and "'unsafe annotation'" in res["answer"]
    assert res["compile_database_refused"], res["compile_answer"]
    assert "pragma_import_llvm" in res["compile_answer"]


def test_fuzzed_files_get_an_answer_not_a_crash(tiny_cnn, tmp_path, env):
    """A few mutations here; bench/reliability.py runs 300 (and the slow test below)."""
    outcomes = fuzz.fuzz(tiny_cnn.read_bytes(), 6, tmp_path, seed=17, env=env)
    bad = [o for o in outcomes if o.verdict not in ("ok", "user_error")]
    assert not bad, [o.to_json() for o in bad]
    assert {o.kind for o in outcomes} == {"bytes", "field"}


def test_a_name_that_is_not_utf8_is_named_not_a_crash(tiny_cnn, tmp_path, capsys):
    # found by the fuzz: protobuf hands back bytes for such a string field
    data = tiny_cnn.read_bytes()
    at = data.index(b"GlobalAveragePool")
    (tmp_path / "m.onnx").write_bytes(data[:at] + b"\xc7" + data[at + 1:])
    assert main(["kernels", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unsupported ONNX op(s)" in err and "lobalAveragePool" in err


def test_the_fuzz_verdicts():
    assert fuzz.classify(0, "table", "", False) == "ok"
    assert fuzz.classify(2, "", "ttrank: error: bad file\n", False) == "user_error"
    assert fuzz.classify(2, "", "ttrank: TVM's native log of this run: /x.log\nttrank: error: y\n",
                         False) == "user_error"
    assert fuzz.classify(2, "", "ttrank: error: a\nttrank: error: b\n", False) == "unclear"
    assert fuzz.classify(1, "", "ttrank: internal error: KeyError\n", False) == "internal_error"
    assert fuzz.classify(1, "", "Traceback (most recent call last):\n", False) == "traceback"
    assert fuzz.classify(-11, "", "", False) == "crash"
    assert fuzz.classify(None, "", "", True) == "hang"


# --- concurrent writers ---------------------------------------------------------------------

def test_two_processes_appending_to_one_log_lose_nothing(tmp_path):
    res = reliability.concurrent_appends(tmp_path / "measurements" / "tiny_cnn.jsonl")
    assert res["torn_lines"] == 0 and res["stray_lines"] == 0
    assert res["rows_found"] == res["rows_expected"] == 800 and res["lost"] == 0


def test_an_append_waits_while_another_process_holds_the_log(tmp_path):
    log = tmp_path / "log.jsonl"
    code = f"from ttrank.util import append_jsonl; append_jsonl({str(log)!r}, {{'row': 1}})"
    with util.file_lock(log):
        writer = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(2.0)
        assert writer.poll() is None and not log.exists()  # it waits for the lock
    assert writer.wait(timeout=60) == 0
    assert list(util.read_jsonl(log)) == [{"row": 1}]


def test_a_second_tuning_run_into_one_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "work_dir"
    with util.file_lock(out / "tune"):  # what a running `ttrank tune --out work_dir` holds
        assert main(["tune", "zoo:tiny_cnn", "--out", str(out), "--no-progress"]) == 2
    assert "another ttrank process is tuning into" in capsys.readouterr().err


# --- faults ---------------------------------------------------------------------------------

def test_a_kill_between_the_renames_of_the_outputs_is_finished_by_the_next_run(tmp_path):
    res = reliability.kill_between_renames(tmp_path)
    assert res["exit_code"] == -9 and res["state_at_kill"] == ["new", "old"]  # a mix, for now
    assert res["plan_left"] and res["finished"] and res["state_after"] == ["new", "new"]


POOL_SCRIPT = """
import time
from joblib import Parallel, delayed
from ttrank.util import orphan_safe
Parallel(n_jobs=2)(delayed(orphan_safe(time.sleep))(120) for _ in range(2))
"""


def test_a_killed_process_takes_its_pool_workers_with_it():
    proc = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT])
    workers: list[psutil.Process] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(psutil.Process(proc.pid).children()) < 2:
            time.sleep(0.2)
        time.sleep(2)  # the jobs have started
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.kill()  # kill -9 PID: no cleanup runs in the pool's owner
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        proc.kill()
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.parametrize("kind", ["read_only", "full"])
def test_export_that_cannot_write_keeps_the_previous_library(kind, tiny_cnn, tmp_path, env):
    if not reliability.can_use_mount_namespace() and (kind == "full" or os.geteuid() == 0):
        pytest.skip("no private mount namespace (unshare -rm) to make such a folder in")
    res = reliability.export_refused(kind, tiny_cnn, tmp_path, env=env)
    assert res["first_run"]["returncode"] == 0
    assert res["verdict"] == "user_error" and "cannot write" in res["answer"], res
    assert res["previous_library_intact"]


def test_mistakes_in_the_command_line_are_user_errors(tiny_cnn, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args, says in [
        (["compile", str(tiny_cnn), "-o", str(tmp_path)], "is a folder; -o takes a file name"),
        (["recommend", str(tiny_cnn), "--rpc-tracker", "localhost:abc", "--device-key", "k"],
         "expected HOST:PORT"),
        (["tune", str(tiny_cnn), "--out", str(blocker / "work_dir"), "--no-progress"],
         "cannot write into"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_write_failures_are_told_apart_from_other_errors():
    import errno

    assert util.write_failure(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
    # the system linker's words, inside TVM's error
    assert util.write_failure(RuntimeError("Compilation error:\n/usr/bin/ld: final link failed: "
                                           "No space left on device")) == "No space left on device"
    assert util.write_failure(RuntimeError("Check failed: x == y")) is None


def test_a_tracker_that_never_answers_is_one_line_in_bounded_time(tiny_cnn, monkeypatch, capsys):
    monkeypatch.setattr(measure, "TRACKER_TIMEOUT_S", 2.0)
    with reliability.silent_tracker() as address:
        t0 = time.time()
        rc = main(["recommend", str(tiny_cnn), "--rpc-tracker", address, "--device-key", "k",
                   "--no-progress"])
        took = time.time() - t0
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "did not answer within 2 s" in err
    assert took < 10
    port = fleet.free_port()  # nothing listens there
    assert main(["recommend", str(tiny_cnn), "--rpc-tracker", f"127.0.0.1:{port}",
                 "--device-key", "k", "--no-progress"]) == 2
    assert "cannot be reached" in capsys.readouterr().err


def _some_kernels(model_path: Path, target, n: int) -> list:
    model = frontend.load(model_path)
    return [k.mod for k in kernels.extract(model.mod, target) if k.tunable][:n]


def test_the_only_rpc_device_killed_mid_measure_is_one_clear_error(tiny_cnn, target):
    res = reliability.rpc_server_killed(_some_kernels(tiny_cnn, target, 3), target, devices=1)
    assert res["killed_server"] and res["devices_left"] == 0
    assert "no device with key" in res["error"] and "rerun to resume" in res["error"]
    # noticed within a few polls, not after a session timeout, and the runs still queued for
    # the lost device are dropped, not waited for (17 s on a 2-core Zen 1; 47 s before)
    assert res["seconds"] < 40


@pytest.mark.slow
def test_an_rpc_device_killed_mid_measure_leaves_the_others_to_finish(tiny_cnn, target):
    res = reliability.rpc_server_killed(_some_kernels(tiny_cnn, target, 6), target, devices=2)
    assert res["killed_server"] and res["devices_left"] == 1 and not res["error"]
    assert len(res["statuses"]) == 6
    # the candidate cut off is measured again on the other device, or says why it failed
    assert all(s == "ok" for s in res["statuses"]) or all(res["reasons"])


@pytest.mark.slow
def test_kill_9_during_recommend_then_rerun(trained, donor_dir, tiny_cnn, tmp_path, env):
    res = reliability.kill_during_recommend(str(tiny_cnn), donor_dir, trained, tmp_path, env=env)
    assert res["first_run"]["returncode"] == 0 and res["killed_before_finishing"]
    assert res["rows_when_killed"] >= 3 and res["old_outputs_intact_after_kill"]
    assert res["workers_left_running"] == 0, res  # no worker goes on using the cores
    assert res["rerun"]["returncode"] == 0, res["rerun"]
    assert res["rows_measured_twice"] == 0 and res["outputs_from_one_run"] and res["lost"] == 0


@pytest.mark.slow
def test_two_recommend_runs_at_once_on_one_data_dir(trained, donor_dir, tiny_cnn, tmp_path, env):
    res = reliability.concurrent_recommends(str(tiny_cnn), donor_dir, trained, tmp_path, env=env)
    assert res["exit_codes"] == [0, 0], res["answers"]
    assert res["torn_lines"] == 0 and res["measured_candidates"] > 0 and res["lost"] == 0


@pytest.mark.slow
def test_300_fuzzed_files_get_an_answer_not_a_crash(tiny_cnn, tmp_path, env):
    outcomes = fuzz.fuzz(tiny_cnn.read_bytes(), 300, tmp_path, seed=0, compile_every=10, env=env)
    s = fuzz.summarize(outcomes)
    assert s["cases"] == 300 and s["crashes"] == s["tracebacks"] == s["hangs"] == 0, s
    assert s["internal_errors"] == s["unclear"] == 0, [o.to_json() for o in outcomes
                                                        if o.verdict not in ("ok", "user_error")]


# --- worker pools --------------------------------------------------------------------------

def test_a_worker_stuck_with_the_gil_held_is_killed_not_waited_for():
    """A call that never returns while holding the GIL (a kernel that corrupted the heap hangs
    in malloc inside TVM's crash handler) starves TVM's own timeout, which is a thread in the
    worker: the guarded pool's watchdog kills the worker, the call fails, and the next call gets
    a new worker."""
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    from ttrank import workers

    pool = workers.guard(PopenPoolExecutor(max_workers=1, timeout=1.0), grace_s=2.0)
    try:
        t0 = time.time()
        # PyDLL keeps the GIL through the C call: pause() returns only on a signal
        [stuck] = pool.map_with_error_catching(lambda _: __import__("ctypes").PyDLL(None).pause(), [None])
        took = time.time() - t0
        assert stuck.status == StatusKind.EXCEPTION and isinstance(stuck.value, ChildProcessError)
        assert took < 2 * 1.0 + 2.0 + 3 * workers.WATCH_EVERY_S + 5.0  # twice the timeout, the grace
        [fine] = pool.map_with_error_catching(lambda x: x + 1, [41])
        assert fine.status == StatusKind.COMPLETE and fine.value == 42
    finally:
        pool.shutdown()


def test_a_stuck_worker_is_killed_with_the_processes_it_started(tmp_path):
    """A build worker links with a compiler it starts: a worker killed for overrunning takes
    such children with it, instead of leaving them to run on."""
    import psutil
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    from ttrank import workers

    def start_a_child_and_hang(path: str) -> None:  # in a worker (a local function goes by value)
        import ctypes
        import subprocess

        child = subprocess.Popen(["sleep", "600"])
        open(path, "w").write(str(child.pid))
        ctypes.PyDLL(None).pause()

    pool = workers.guard(PopenPoolExecutor(max_workers=1, timeout=1.0), grace_s=2.0)
    try:
        [stuck] = pool.map_with_error_catching(start_a_child_and_hang, [str(tmp_path / "child")])
        assert stuck.status == StatusKind.EXCEPTION and isinstance(stuck.value, ChildProcessError)
    finally:
        pool.shutdown()
    child = int((tmp_path / "child").read_text())
    deadline = time.time() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE \
            and time.time() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_guarded_worker_that_crashes_dies_without_a_crash_handler():
    """TVM installs a crash handler that prints a backtrace, which needs the heap a crash may
    have corrupted: a guarded pool's workers leave fatal signals to the system, so such a
    worker dies at once, and its call fails long before its timeout."""
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    from ttrank import workers

    def segv_handler(_) -> int:  # in a worker (a local function goes by value): its SIGSEGV handler
        import ctypes
        import signal

        old = ctypes.create_string_buffer(256)  # a struct sigaction: the handler is its first field
        ctypes.CDLL(None).sigaction(signal.SIGSEGV, None, old)
        return int.from_bytes(old.raw[:8], "little")  # 0: the system's default

    plain, guarded = PopenPoolExecutor(max_workers=1), workers.guard(PopenPoolExecutor(max_workers=1, timeout=60.0))
    try:
        [tvms] = plain.map_with_error_catching(segv_handler, [None])
        [ours] = guarded.map_with_error_catching(segv_handler, [None])
        assert tvms.value != 0 and ours.value == 0
        t0 = time.time()
        [crashed] = guarded.map_with_error_catching(
            lambda _: __import__("os").kill(__import__("os").getpid(), __import__("signal").SIGSEGV), [None])
        assert crashed.status == StatusKind.EXCEPTION and isinstance(crashed.value, ChildProcessError)
        assert time.time() - t0 < 30.0
    finally:
        plain.shutdown()
        guarded.shutdown()


def _doubling(reads_past: int = 0, writes_past: int = 0):
    """``out = 2 * a`` over 256 floats, as a kernel's untuned program, or with loops that run
    past the buffers' ends (as a transferred tile over an extent it does not divide did)."""
    import tvm
    from tvm.script import tirx as T

    n = 256

    @T.prim_func(s_tir=True)
    def main(a: T.Buffer((n,), "float32"), out: T.Buffer((n,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in range(n + writes_past):
            with T.sblock("double"):
                v = T.axis.spatial(n + writes_past, i)
                out[v] = a[v] * T.float32(2) + a[v + reads_past] * T.float32(1e-30)

    return tvm.IRModule({"main": main})


@pytest.mark.parametrize("stray", ["writes_past", "reads_past"])
def test_a_candidate_that_runs_past_its_buffers_is_a_wrong_result(stray, target):
    """A schedule whose loops overrun a buffer by a few elements computes every in-bounds
    output right: the check runs each candidate on arguments fenced with NaN, so a stray write
    is seen in the fence and a stray read spoils the outputs, and neither is ever measured."""
    m = measure.Measurer(target)
    try:
        ok, strayed = m.measure([_doubling(), _doubling(**{stray: 4})], reference=_doubling(),
                                reference_key="doubling")
        assert ok.ok
        assert strayed.status == "wrong_result"
        assert ("wrote outside argument 1 " if stray == "writes_past" else "max abs error nan") in strayed.error
    finally:
        m.close()
