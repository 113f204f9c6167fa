"""Faults and hostile inputs, tried for real.

Each scenario runs ttrank's command line in its own processes, injects one fault (kill -9, a
dead RPC server, a tracker that never answers, a read-only or full output folder, a hostile
file) and returns what the user saw and what was lost. ``tests/test_reliability.py`` asserts on
them; ``bench/reliability.py`` runs them all and writes ``bench/results/reliability.json``.

A scenario returns a dict: ``name``, ``survived`` (the user got a clear answer and nothing was
lost), ``lost`` (rows, records or files lost), ``answer`` (the user's last stderr line) and
what it checked.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import psutil
from onnx import TensorProto, helper, numpy_helper

from . import measure
from .collect import build_dataset, collect
from .donors import DonorStore
from .errors import DeviceError
from .fleet import local_fleet
from .frontend import load
from .fuzz import classify, run_cli
from .measure import Measurer, RunnerSpec
from .ranker import Ranker
from .target import make_target
from .util import finish_moves, read_jsonl
from .workdir import read_manifest
from .zoo import export

# Modules that load TVM (measure, collect, ...) are imported inside the scenarios that need
# them: the others drive ttrank in child processes and keep this one light.

# --------------------------------------------------------------------------------------------
# Running the CLI and reading its answer


@dataclass
class Answer:
    """What one ``ttrank`` process showed its user."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.strip()]

    @property
    def last(self) -> str:
        return self.lines[-1] if self.lines else ""

    @property
    def verdict(self) -> str:
        """ok, user_error (one ``ttrank: error:`` line), or what went wrong (see fuzz.VERDICTS)."""
        return classify(self.returncode, self.stdout, self.stderr, self.timed_out)

    def summary(self) -> dict:
        return {"returncode": self.returncode, "verdict": self.verdict,
                "seconds": round(self.seconds, 1), "answer": self.last[:300]}


def ttrank(*args: str, timeout: float = 600, env: dict | None = None,
           prefix: list[str] | None = None) -> Answer:
    """Run ``ttrank ARGS`` in a fresh process (optionally behind a command ``prefix``)."""
    return Answer(*run_cli(list(args), timeout, env=env, prefix=prefix))


def start_ttrank(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``ttrank ARGS`` in its own session (so a kill reaches everything it started)."""
    return subprocess.Popen([sys.executable, "-m", "ttrank.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def session_survivors(proc: subprocess.Popen, grace_s: float = 15.0) -> tuple[int, float]:
    """After ``proc`` (started by :func:`start_ttrank`, in a session of its own) was killed
    alone, as ``kill -9 PID`` does: how many processes it started are still running ``grace_s``
    later (its worker pools), and how long the last one took to end. The rest are killed."""
    start = time.time()
    alive: list[psutil.Process] = []
    while True:
        alive = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid != proc.pid and os.getsid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.time() - start > grace_s:
            break
        time.sleep(0.2)
    waited = time.time() - start
    kill_tree(proc)
    return len(alive), waited


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def tree_digest(folder: Path) -> str | None:
    """One hash of a folder's files (names and contents), or None if it is missing."""
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Hostile ONNX files


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def absurd_input_model(path: Path, dims=(100000, 100000, 1000)) -> Path:
    """A Relu on an input that declares ``dims`` (10^13 floats: 40 TB)."""
    v = helper.make_tensor_value_info
    path.write_bytes(_model([helper.make_node("Relu", ["x"], ["y"])],
                            [v("x", TensorProto.FLOAT, list(dims))],
                            [v("y", TensorProto.FLOAT, list(dims))]).SerializeToString())
    return path


def absurd_intermediate_model(path: Path) -> Path:
    """A small input, and a ConstantOfShape inside that makes a 10^12-element tensor."""
    v = helper.make_tensor_value_info
    shape = numpy_helper.from_array(np.array([1000000, 1000000], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"]),
             helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"])]
    path.write_bytes(_model(nodes, [v("x", TensorProto.FLOAT, [4])], [v("y", TensorProto.FLOAT, [4])],
                            [shape], opset=13).SerializeToString())
    return path


def absurd_initializer_model(path: Path) -> Path:
    """A weight that declares 10^12 elements (and holds a few bytes)."""
    v = helper.make_tensor_value_info
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1000000, 1000000], raw_data=b"\0" * 16)
    path.write_bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])],
                            [v("x", TensorProto.FLOAT, [1000000, 1000000])],
                            [v("y", TensorProto.FLOAT, [1000000, 1000000])], [w]).SerializeToString())
    return path


def external_data_model(folder: Path, location: str, name: str = "ext.onnx") -> Path:
    """An Add whose weight's bytes live in external data at ``location`` (relative to folder)."""
    v = helper.make_tensor_value_info
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[16])
    w.data_location = TensorProto.EXTERNAL
    for k, val in (("location", location), ("offset", "0"), ("length", "64")):
        e = w.external_data.add()
        e.key, e.value = k, val
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(_model([helper.make_node("Add", ["x", "w"], ["y"])],
                            [v("x", TensorProto.FLOAT, [16])], [v("y", TensorProto.FLOAT, [16])],
                            [w]).SerializeToString())
    return path


def hostile_files(work: Path) -> list[tuple[str, list[str], str]]:
    """(name, ttrank args, what the error must say) for each hostile file, written in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    secret = work / "secret.bin"
    secret.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    inside = work / "model_dir"
    link = inside / "link.bin"
    external_data_model(inside, "x")  # makes the folder
    if not link.is_symlink():
        link.symlink_to(secret)
    return [
        ("input declaring 100000x100000x1000", ["compile", str(absurd_input_model(work / "big_input.onnx")),
                                                "-o", str(work / "big.so")], "memory"),
        ("ConstantOfShape making 10^12 elements", ["kernels", str(absurd_intermediate_model(
            work / "big_inner.onnx"))], "memory"),
        ("initializer declaring 10^12 elements", ["kernels", str(absurd_initializer_model(
            work / "big_weight.onnx"))], "memory"),
        ("external data at ../secret.bin", ["kernels", str(external_data_model(
            inside, "../secret.bin", "up.onnx"))], "outside the model's folder"),
        ("external data at an absolute path", ["kernels", str(external_data_model(
            inside, str(secret), "abs.onnx"))], "outside the model's folder"),
        ("external data through a symlink leading out", ["kernels", str(external_data_model(
            inside, "link.bin", "link.onnx"))], "outside the model's folder"),
    ]


def hostile_file_scenarios(work: Path, env: dict | None = None) -> list[dict]:
    """Run each hostile file through the CLI: one clear line, non-zero exit, nothing written."""
    out = []
    for name, args, must_say in hostile_files(work):
        a = ttrank(*args, timeout=120, env=env)
        wrote = "-o" in args and Path(args[args.index("-o") + 1]).exists()
        out.append({"name": name, **a.summary(), "survived": a.verdict == "user_error"
                    and must_say in a.last and not wrote, "lost": 0})
    return out


# --------------------------------------------------------------------------------------------
# A malicious donor log


def malicious_donor_log(src: Path, dest: Path) -> Path:
    """A copy of a real MetaSchedule work_dir whose every record also annotates its first
    loop with ``pragma_import_llvm``: LLVM IR that TVM's code generator would link into the
    kernel (see ttrank.safety)."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.name != "database_tuning_record.json":
            shutil.copyfile(p, dest / p.name)
    lines = []
    for line in (src / "database_tuning_record.json").read_text().splitlines():
        idx, rec = json.loads(line)
        insts = rec[0][0]
        loop = next((i[3][0] for i in insts if i[0] == "GetLoops" and i[3]), None)
        if loop is not None:
            insts.append(["Annotate", [loop, '"define void @ttrank_evil() { ret void }"'],
                          ["pragma_import_llvm"], []])
        lines.append(json.dumps([idx, rec]))
    (dest / "database_tuning_record.json").write_text("\n".join(lines) + "\n")
    return dest


def malicious_donor_scenario(donor_dir: Path, model: Path, work: Path, env: dict | None = None) -> dict:
    """A log whose records carry code for TVM's code generator: ``ttrank donors add`` skips
    every such record (so none is ever replayed) and says so, and ``ttrank compile --database``
    refuses the log outright."""
    evil = malicious_donor_log(donor_dir, work / "evil_donor")
    a = ttrank("donors", "add", str(evil), "--name", "evil", timeout=300, env=env)
    added = "unsafe annotation" in a.stdout + a.stderr
    c = ttrank("compile", str(model), "-o", str(work / "evil.so"), "--database", str(evil),
               timeout=300, env=env)
    refused = c.verdict == "user_error" and "reads as code" in c.last and not (work / "evil.so").exists()
    return {"name": "donor log with pragma_import_llvm annotations", **a.summary(),
            "donors_add_skipped_them": added, "compile_database_refused": refused,
            "compile_answer": c.last[:300], "survived": added and refused, "lost": 0,
            "outcome": f"donors add: {a.last or a.stdout.strip()[-120:]} / compile --database: {c.last}"}


# --------------------------------------------------------------------------------------------
# Concurrency


APPEND_SCRIPT = """
import sys
from ttrank.util import append_jsonl
path, tag, n, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for i in range(n):
    # rows of many kilobytes, two per call: a write that is not one locked step would tear
    append_jsonl(path, [{"writer": tag, "i": i, "half": h, "pad": tag * width} for h in (0, 1)])
"""


def concurrent_appends(path: Path, writers: int = 2, rows: int = 200, width: int = 20000) -> dict:
    """Several processes append to one new JSON-lines log at once through ttrank's own code."""
    if path.exists():
        raise ValueError(f"{path} exists: the scenario counts every line of a new log")
    procs = [subprocess.Popen([sys.executable, "-c", APPEND_SCRIPT, str(path), chr(ord("a") + w),
                               str(rows), str(width)]) for w in range(writers)]
    codes = [p.wait(timeout=600) for p in procs]
    bad: list[str] = []
    got = list(read_jsonl(path, bad))
    seen = {(r["writer"], r["i"], r["half"]) for r in got}
    expected = {(chr(ord("a") + w), i, h) for w in range(writers) for i in range(rows) for h in (0, 1)}
    lines = path.read_bytes().count(b"\n")
    # unlocked writers also leave stray blank lines: one sees another's row half-written and
    # starts its own with a newline
    return {"name": f"{writers} processes appending {rows} x 2 rows of {width // 1000} KB to one log",
            "exit_codes": codes, "lines": lines, "torn_lines": len(bad),
            "stray_lines": lines - len(got) - len(bad),
            "rows_expected": len(expected), "rows_found": len(seen & expected),
            "lost": len(expected - seen), "survived": not bad and seen == expected
            and lines == len(expected) and codes == [0] * writers,
            "outcome": f"{len(seen & expected)}/{len(expected)} rows, {len(bad)} torn lines, "
                       f"{lines - len(got) - len(bad)} stray lines"}


def concurrent_recommends(model: str, donor_dir: Path, ranker: Path, work: Path,
                          env: dict | None = None) -> dict:
    """Two ``ttrank recommend`` runs at once on one data dir: every line of the shared
    measurement table parses, and every candidate either run measured is in it."""
    data = work / "data"
    procs = [start_ttrank("recommend", model, "-o", str(work / f"out{i}" / "m.so"), "--donors",
                          str(donor_dir), "--ranker", str(ranker), "--data-dir", str(data),
                          "--json", str(work / f"report{i}.json"), "--top-k", "2", "--no-progress",
                          "--tune-missing", "0", env=env) for i in range(2)]
    results = [p.communicate(timeout=1800) for p in procs]
    codes = [p.returncode for p in procs]
    table = next((data / "measurements").glob("*.jsonl"), None)
    bad: list[str] = []
    rows = list(read_jsonl(table, bad)) if table else []
    have = {(r["kernel"], r["record"]) for r in rows}
    wanted = set()
    for i in range(2):
        rep = work / f"report{i}.json"
        if rep.exists():
            for k in json.loads(rep.read_text())["kernels"]:
                wanted |= {(k["name"], m["donor"]) for m in k["measured"]}
    missing = wanted - have
    return {"name": "two recommend runs at once on one data dir", "exit_codes": codes,
            "answers": [(err.strip().splitlines() or [""])[-1][:200] for _, err in results],
            "table_lines": len(rows) + len(bad), "torn_lines": len(bad),
            "measured_candidates": len(wanted), "lost": len(missing),
            "survived": codes == [0, 0] and not bad and not missing and bool(wanted),
            "outcome": f"exit codes {codes}; {len(rows)} rows, {len(bad)} torn; "
                       f"{len(wanted) - len(missing)}/{len(wanted)} measured candidates in the table"}


# --------------------------------------------------------------------------------------------
# kill -9 during recommend, and during the replacement of its outputs


def recommend_args(model: str, out: Path, donor_dir: Path, ranker: Path, data: Path,
                   top_k: int = 2) -> list[str]:
    # no tuning of uncovered kernels: the faults here are about measuring and outputs. A fixed
    # k: a confident ranker would otherwise measure one candidate per kernel whatever k says,
    # and a run asking for more would have nothing new to measure (nothing to kill)
    return ["recommend", model, "-o", str(out / "m.so"), "--donors", str(donor_dir), "--ranker",
            str(ranker), "--data-dir", str(data), "--top-k", str(top_k), "--fixed-k", "--no-progress",
            "--tune-missing", "0", "--json", str(out / "report.json")]


def _table_keys(data: Path) -> list[tuple[str, str]]:
    return [(r["workload"], r["record"]) for t in (data / "measurements").glob("*.jsonl")
            for r in read_jsonl(t)]


def kill_during_recommend(model: str, donor_dir: Path, ranker: Path, work: Path,
                          env: dict | None = None, kill_after_rows: int = 3) -> dict:
    """A first run completes (old outputs); a second one, asking for more candidates, is
    killed with SIGKILL once it has appended measurements (the process alone, as ``kill -9 PID``
    does, not its process group); a third completes. ``work``: a new folder (the measurements of
    an earlier run there would leave nothing to kill).

    Checks: the killed run's worker processes end with it (within a few seconds); after the
    kill the old database and library are intact (byte for byte); the rerun measures nothing
    the killed run finished (no (kernel, record) twice in the table) and completes; its outputs
    come from one run (the report's database holds what it chose).
    """
    out, data = work / "out", work / "data"
    first = ttrank(*recommend_args(model, out, donor_dir, ranker, data, top_k=1), env=env)
    old_lib, old_db = sha256(out / "m.so"), tree_digest(out / "m")
    rows_before = len(_table_keys(data))
    proc = start_ttrank(*recommend_args(model, out, donor_dir, ranker, data, top_k=3), env=env)
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None \
            and len(_table_keys(data)) < rows_before + kill_after_rows:
        time.sleep(0.2)
    finished_first = proc.poll() is not None
    proc.kill()
    proc.wait(timeout=30)
    left_running, waited = session_survivors(proc)
    after_kill = len(_table_keys(data))
    intact = sha256(out / "m.so") == old_lib and tree_digest(out / "m") == old_db
    rerun = ttrank(*recommend_args(model, out, donor_dir, ranker, data, top_k=3), env=env)
    keys = _table_keys(data)
    duplicates = len(keys) - len(set(keys))
    consistent = _outputs_agree(out)
    lost = (0 if intact else 1) + max(0, after_kill - len(set(keys)))
    return {"name": "kill -9 PID during recommend, then rerun", "first_run": first.summary(),
            "killed_before_finishing": not finished_first,
            "rows_when_killed": after_kill - rows_before, "workers_left_running": left_running,
            "workers_ended_within_s": round(waited, 1), "old_outputs_intact_after_kill": intact,
            "rerun": rerun.summary(), "rows_measured_twice": duplicates,
            "outputs_from_one_run": consistent, "lost": lost,
            "survived": first.returncode == 0 and rerun.returncode == 0 and intact
            and duplicates == 0 and consistent and not finished_first and left_running == 0,
            "outcome": f"killed after {after_kill - rows_before} new rows; {left_running} of its "
                       f"workers still running after {waited:.0f} s; old database and library "
                       f"{'intact' if intact else 'DAMAGED'}; rerun exit {rerun.returncode}, "
                       f"{duplicates} rows measured twice, outputs from one run: {consistent}"}


def _outputs_agree(out: Path) -> bool:
    """The library and the database in ``out`` are one run's: the report written with them
    names the kernels it tuned, and the database holds exactly those workloads."""
    report = out / "report.json"
    if not (report.exists() and (out / "m.so").exists() and (out / "m").is_dir()):
        return False
    r = json.loads(report.read_text())
    tuned = sum(1 for k in r["kernels"] if k["status"] != "untuned")
    records = (out / "m" / "database_tuning_record.json")
    return records.exists() and len(records.read_text().splitlines()) == tuned


COMMIT_SCRIPT = """
import os, sys
from pathlib import Path
from ttrank import util
real, calls = util._move, []
def dying(src, dst):
    real(src, dst)
    calls.append(dst)
    if len(calls) == 1:
        os.kill(os.getpid(), 9)   # killed between the database's rename and the library's
util._move = dying
work = Path(sys.argv[1])
util.commit_moves([(work / ".db.staged", work / "db"), (work / ".lib.staged", work / "lib.so")],
                  work / ".db.commit.json")
"""


def kill_between_renames(work: Path) -> dict:
    """A process replacing a database folder and a library is killed after the first rename.

    Checks: right after the kill the plan is on disk; :func:`ttrank.util.finish_moves` (which
    every recommend run calls first) completes it: both outputs are then the new ones.
    """
    work.mkdir(parents=True, exist_ok=True)
    for name, text in (("db", "old"), (".db.staged", "new")):
        (work / name).mkdir(exist_ok=True)
        (work / name / "records.json").write_text(text)
    (work / "lib.so").write_text("old")
    (work / ".lib.staged").write_text("new")
    code = subprocess.run([sys.executable, "-c", COMMIT_SCRIPT, str(work)]).returncode
    mixed = ((work / "db" / "records.json").read_text(), (work / "lib.so").read_text())
    plan_left = (work / ".db.commit.json").exists()
    finished = finish_moves(work / ".db.commit.json")
    after = ((work / "db" / "records.json").read_text(), (work / "lib.so").read_text())
    return {"name": "kill -9 between the renames of database and library", "exit_code": code,
            "state_at_kill": list(mixed), "plan_left": plan_left, "finished": finished,
            "state_after": list(after), "lost": 0 if after == ("new", "new") else 1,
            "survived": code == -9 and plan_left and after == ("new", "new"),
            "outcome": f"at the kill: database {mixed[0]}, library {mixed[1]}; after finish_moves: "
                       f"database {after[0]}, library {after[1]}"}


# --------------------------------------------------------------------------------------------
# Output folders that refuse writes


@functools.lru_cache(maxsize=1)
def can_use_mount_namespace() -> bool:
    """Whether ``unshare -rm`` works here (a private mount namespace, no root needed)."""
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_namespace(setup: str, after: str) -> list[str]:
    # runs: setup (mounts), then ttrank, then `after` (to read what only this namespace sees)
    return ["unshare", "-rm", "sh", "-c", f'{setup} || exit 97; "$@"; rc=$?; {after}; exit $rc', "sh"]


def export_refused(kind: str, model: Path, work: Path, env: dict | None = None) -> dict:
    """``ttrank compile`` into a folder holding an earlier library, when the folder is
    read-only (``kind="read_only"``) or its disk is full (``kind="full"``).

    Checks: one clear line, non-zero exit, and the earlier library byte for byte intact.
    Uses a private mount namespace (a read-only bind mount, a full tmpfs) where the system
    allows one; else, for a read-only folder, its mode (which root ignores). A file-size limit
    cannot stand in for a full disk: LLVM ends the process when a write fails.
    """
    if not can_use_mount_namespace() and (kind == "full" or os.geteuid() == 0):
        raise RuntimeError("no private mount namespace here (unshare -rm): cannot make a "
                           f"{kind.replace('_', '-')} folder without touching the system's")
    out = work / f"out_{kind}"
    out.mkdir(parents=True, exist_ok=True)
    first = ttrank("compile", str(model), "-o", str(out / "m.so"), "--no-check", env=env)
    old = sha256(out / "m.so")
    args = ["compile", str(model), "-o", str(out / "m.so")]
    how = ""
    if can_use_mount_namespace():
        copy = work / f"old_{kind}.so"
        shutil.copyfile(out / "m.so", copy)
        if kind == "read_only":
            how = "read-only bind mount"
            setup = f"mount --bind '{out}' '{out}' && mount -o remount,bind,ro '{out}'"
        else:
            how = "full tmpfs"
            size = (out / "m.so").stat().st_size + 64 * 1024
            setup = (f"mount -t tmpfs -o size={size} tmpfs '{out}' && cp '{copy}' '{out}/m.so' && "
                     f"(dd if=/dev/zero of='{out}/filler' bs=4096 2>/dev/null; true)")
        after = f"echo; echo \"sha256 $(sha256sum '{out}/m.so' | cut -d' ' -f1)\""
        a = ttrank(*args, env=env, timeout=600, prefix=_in_namespace(setup, after))
        seen = [ln.split()[1] for ln in a.stdout.splitlines() if ln.startswith("sha256 ")]
        kept = bool(seen) and seen[-1] == old
    else:
        how = "chmod a-w"
        out.chmod(0o555)
        try:
            a = ttrank(*args, env=env, timeout=600)
        finally:
            out.chmod(0o755)
        kept = sha256(out / "m.so") == old
    return {"name": f"export into a {'read-only folder' if kind == 'read_only' else 'full disk'}",
            "how": how, "first_run": first.summary(), **a.summary(), "previous_library_intact": kept,
            "lost": 0 if kept else 1, "survived": first.returncode == 0 and a.verdict == "user_error"
            and "cannot write" in a.last and kept}


# --------------------------------------------------------------------------------------------
# RPC: a tracker and servers on 127.0.0.1


def busy_server(servers: list[subprocess.Popen]) -> subprocess.Popen | None:
    """A server in a session now: TVM's server keeps one worker process, which starts another
    for each session."""
    for s in servers:
        if s.poll() is None:
            with contextlib.suppress(psutil.Error):
                if len(psutil.Process(s.pid).children(recursive=True)) > 1:
                    return s
    return None


@contextlib.contextmanager
def silent_tracker() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: a hung or foreign service
    where a tracker should be."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def rpc_server_killed(kernel_mods: list, target, devices: int, work: Path | None = None) -> dict:
    """Measure candidates through a tracker; the server measuring one is killed mid-session.

    With another device left, the run completes: the lost candidate is measured again by the
    next pass, or fails with a reason. With none left, one DeviceError, in bounded time.
    """
    with local_fleet(devices, key="ttrank-test") as fleet:
        # slow enough per candidate (~1 s) that the kill lands inside a session
        # a device that does not come back within 5 s is taken as gone (the default waits 30 s)
        spec = RunnerSpec.from_tracker(fleet.address, fleet.tracker.key, min_repeat_ms=300, repeat=2,
                                       rounds=2, device_wait_s=5)
        m = Measurer(target, spec)
        killed: list[int] = []

        def killer() -> None:
            deadline = time.time() + 120
            while time.time() < deadline and not killed:
                s = busy_server(fleet.servers)
                if s is not None:
                    kill_tree(s)
                    killed.append(s.pid)
                time.sleep(0.05)

        spec.check()  # the devices answer their probe first: the kill is for a measuring session
        threading.Thread(target=killer, daemon=True).start()
        t0 = time.time()
        error, res = "", []
        try:
            res = m.measure(kernel_mods)
        except DeviceError as e:
            error = str(e)
        finally:
            m.close()
        secs = time.time() - t0
        left = fleet.tracker.devices()
    statuses = [r.status for r in res]
    reasons = [r.error for r in res if not r.ok]
    expect_complete = devices > 1
    survived = bool(killed) and (
        (len(res) == len(kernel_mods) and not error and all(reasons)) if expect_complete
        else bool(error) and "no device" in error)
    return {"name": f"RPC server killed mid-measure ({devices} device(s), {devices - 1} left)",
            "killed_server": bool(killed), "devices_left": left, "seconds": round(secs, 1),
            "statuses": statuses, "reasons": reasons, "error": error, "lost": 0,
            "survived": survived,
            "outcome": error or f"{statuses.count('ok')}/{len(statuses)} candidates measured in "
                                f"{secs:.0f} s" + (f"; failed: {'; '.join(reasons)}" if reasons else "")}


def silent_tracker_scenario(model: str, env: dict | None = None) -> dict:
    """``ttrank recommend --rpc-tracker`` pointed at a port that never answers: one clear line,
    in bounded time (the tracker query's timeout, not forever)."""
    bound = measure.TRACKER_TIMEOUT_S  # read at call time: tests shorten it
    with silent_tracker() as address:
        a = ttrank("recommend", model, "--rpc-tracker", address, "--device-key", "nobody",
                   "--no-progress", timeout=bound + 120, env=env)
    return {"name": "RPC tracker that never answers", **a.summary(),
            "bound_s": bound, "lost": 0,
            "survived": a.verdict == "user_error" and "did not answer" in a.last
            and a.seconds < bound + 60}


# --------------------------------------------------------------------------------------------
# A tiny donor store and ranker, for the scenarios that run recommend


def tiny_setup(work: Path, env: dict | None = None) -> tuple[Path, Path, Path]:
    """(tiny_cnn ONNX, a donor work_dir of three tiny_resnet kernels, a ranker fit on them),
    built once in ``work`` (about two minutes on one core), as the test suite's fixtures are."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny_cnn.onnx"
    if not model.exists():
        export("tiny_cnn", model)
    donor = work / "donors" / "tiny_resnet"
    if not read_manifest(donor).get("complete"):
        a = ttrank("tune", "zoo:tiny_resnet", "--out", str(donor), "--trials-per-task", "6", "--only",
                   "fused_conv2d1_add1_relu1", "fused_conv2d4_add3", "fused_matmul_add8",
                   "--no-progress", env=env, timeout=1800)
        if a.returncode != 0:
            raise RuntimeError(f"tuning the tiny donors failed: {a.last}")
    ranker = work / "ranker.json"
    if not ranker.exists():
        target = make_target()
        store = DonorStore.load([donor])
        m = Measurer(target)
        try:
            collect("tiny_cnn", load(model), store, work / "measurements", target, m,
                    max_per_kernel=12, paper_donor="tiny_resnet")
        finally:
            m.close()
        ds = build_dataset([work / "measurements"], store)
        Ranker(objective="rank:pairwise", n_estimators=40).fit(ds.X, ds.y, ds.groups).save(
            ranker, note="reliability scenarios")
    return model, donor, ranker
