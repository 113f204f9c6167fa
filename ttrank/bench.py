"""What the benchmark scripts in bench/ share: where their results and MetaSchedule's long runs
live, the donor networks' order, pausing background work, and running ``recommend`` as a
user does. The scripts themselves only parse arguments, call these and the library, and write
their results."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from . import locations
from .collect import import_tables
from .convergence import finished_run
from .donors import DonorStore, donor_set_dir
from .kernels import model_kernels
from .programs import cost_model_path, cost_model_without
from .ranker import Ranker, meta_path
from .runtime import write_database
from .target import host_cores, host_mcpu, make_target
from .training import ranker_without
from .transfer import transfer
from .util import atomic_write_json
from .workdir import SET_SEPARATOR, read_manifest

# donors that the transfer tests need first, then the rest, smaller searches first
DONOR_ORDER = ["mobilenetv2", "vgg16", "resnet18", "bert", "alexnet", "resnet50", "googlenet",
               "mnasnet1_0", "efficientnetb0", "efficientnetb4", "mobilebert"]
# the networks whose max speedup must come from a long MetaSchedule run (>= 200 trials per task)
LONG = ("resnet18", "mobilenetv2", "resnet50", "bert")
LONG_TRIALS = 200


def results_dir() -> Path:
    """``bench/results`` of the data home (a checkout)."""
    return locations.data_home() / "bench" / "results"


def long_dir(net: str) -> Path:
    """Where ``net``'s long MetaSchedule run lives (>= 200 trials per task, NCHW, one runtime
    thread per core, from scratch): a donor set of the store, ``datasets/donors/NET@nchw-tT-CPU``,
    so its schedules are donors like any other. The one finished on any CPU, else this host's."""
    root = locations.shipped_donors(required=True)
    for d in sorted(root.glob(f"{net}{SET_SEPARATOR}nchw-t*")):
        if finished_run(d) and (read_manifest(d).get("trials_per_task") or 0) >= LONG_TRIALS:
            return d
    return donor_set_dir(root, net, "nchw", host_cores(), host_mcpu())


def metaschedule_dir(net: str) -> Path | None:
    """The longest finished MetaSchedule run for ``net``."""
    return finished_run(long_dir(net), locations.shipped_donors(required=True) / net)


def ranker_id() -> str:
    """The shipped ranker (and its second stage's cost model, if it has one) in a few
    characters: a result measured with another one is not current."""
    ranker = locations.shipped_ranker()
    meta = json.loads(meta_path(ranker).read_text())
    out = meta["model_sha256"][:12]
    st = meta.get("stage2") or {}
    if st.get("cost_model"):
        cm = json.loads(meta_path(cost_model_path(ranker)).read_text())
        out += f"+{cm['model_sha256'][:8]}" + (f"/w{st['weight']}/n{st['shortlist']}" if st.get("enabled") else "/draws")
    if own := (meta.get("own") or {}).get("cpus"):
        # the host's own ranker changes its picks too
        out += "+own" + hashlib.sha256("".join(sorted(v["model_sha256"] for v in own.values())).encode()).hexdigest()[:8]
    return out


WATCHDOG = """
import os, signal, sys, time
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while True:
    try:
        os.kill(parent, 0)
    except OSError:
        break
    time.sleep(1)
for p in pids:
    try:
        os.kill(p, signal.SIGCONT)
    except OSError:
        pass
"""


@contextlib.contextmanager
def paused_background(enabled: bool) -> Iterator[int]:
    """SIGSTOP other ttrank tune/collect processes (and their workers) for a clean measurement;
    yields how many were paused."""
    import psutil  # a dependency of MetaSchedule's, needed only here

    stopped = []
    if enabled:
        me = os.getpid()
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["pid"] != me and ("ttrank tune" in cmd or "ttrank collect" in cmd
                                        or "tune_donors.py" in cmd or "background.py" in cmd):
                for q in [p] + p.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        q.send_signal(signal.SIGSTOP)
                        stopped.append(q)
        if stopped:
            print(f"paused {len(stopped)} background processes", flush=True)
            # a dead-man switch: should this process die hard, the paused ones still resume
            subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()),
                              *[str(q.pid) for q in stopped]], start_new_session=True)
            time.sleep(2)
    try:
        yield len(stopped)
    finally:
        for q in stopped:
            with contextlib.suppress(Exception):
                q.send_signal(signal.SIGCONT)


def warm_leave_one_out(net: str) -> None:
    """Fit (and cache) the ranker and the second stage's cost model without ``net`` before the
    clock starts. Only a leave-one-out run needs them: a user's recommend loads the shipped ones
    in a second."""
    ranker = Ranker.load()
    store = DonorStore.load()
    ranker_without(net, ranker, store)
    if (ranker.metadata.get("stage2") or {}).get("cost_model"):
        cost_model_without([net], [Path(r.work_dir) for r in store.reports], make_target())


def run_recommend(net: str, tmp: Path, top_k: int | None = None, pause: bool = False,
                  extra: tuple[str, ...] = (), report_name: str | None = None,
                  leave_one_out: bool = True, path: Path | None = None
                  ) -> tuple[dict, float, int, list[str]]:
    """``ttrank recommend zoo:NET --leave-one-out`` as a user runs it, with a fresh data dir in
    ``tmp``: (the --json report, wall seconds, processes paused, the command). The whole report
    is kept as bench/work/reports/``report_name``.json (default: NET). ``leave_one_out=False``:
    the network's own donors and rows are candidates too (a user whose model is in the store).
    ``path``: an ONNX file instead of the zoo's (named ``net``; nothing is left out)."""
    rep_path = tmp / "report.json"
    leave_one_out = leave_one_out and path is None
    cmd = ["ttrank", "recommend", str(path) if path else f"zoo:{net}",
           *(["--leave-one-out"] if leave_one_out else []),
           "--no-progress", "--data-dir", str(tmp / "data"), "-o", str(tmp / f"{net}.so"),
           "--json", str(rep_path)]
    if top_k:
        cmd += ["--top-k", str(top_k)]
    cmd += list(extra)
    if path is None:
        # the zoo model is exported before the clock starts: a user already has their file
        subprocess.run(["ttrank", "zoo", "export", net, str(tmp / "warm.onnx")], check=True,
                       capture_output=True)
    if leave_one_out:
        warm_leave_one_out(net)
    with paused_background(pause) as paused:
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
    print(proc.stdout[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    keep_measurements(tmp / "data" / "measurements")
    report = json.loads(rep_path.read_text())
    # the whole report (per kernel: candidates, rejections, tuning) outlives the temp dir: the
    # summaries in bench/results say what happened, this says why
    atomic_write_json(kept_measurements_dir().parent / "reports" / f"{report_name or net}.json", report)
    return report, wall, paused, cmd


def kept_measurements_dir() -> Path:
    """Where benchmark runs leave what they measured (bench/work/measurements, not committed):
    every CPU a benchmark runs on is training data; ``ttrank import-measurements`` this folder
    into datasets/measurements to keep it (the ranker's data changes only when you choose)."""
    return locations.data_home() / "bench" / "work" / "measurements"


def keep_measurements(src: Path) -> None:
    """Add a run's measurement tables to :func:`kept_measurements_dir` (rows already there
    are skipped)."""
    if any(src.glob("*.jsonl")):
        import_tables(src, kept_measurements_dir())


def head_commit() -> str | None:
    """The checkout's short commit (None outside a git checkout): which code produced a row."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    return proc.stdout.strip() or None



def report_database(report: dict, model, target, store: DonorStore, db_dir: Path, split_rows: bool = True):
    """A database of the donor records a ``recommend --json`` report chose, transferred afresh
    onto ``model``'s kernels (``split_rows``: as :func:`ttrank.transfer.transfer`), and how many
    of them split their rows. Kernels whose record is not in ``store`` stay untuned."""
    kernels = {k.name: k for k in model_kernels(model, target)}
    by_id = store.by_record_id()
    chosen = {}
    for k in report["kernels"]:
        rid = (k.get("chosen") or {}).get("record")
        if k["name"] in kernels and rid in by_id:
            w, r = by_id[rid]
            t = transfer(r, kernels[k["name"]], w, target, split_rows=split_rows)
            if t.ok:
                chosen[k["name"]] = t
    db = write_database(db_dir, list(kernels.values()), chosen, target)
    return db, sum(t.thread_split == "rows" for t in chosen.values())
