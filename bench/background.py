"""Keep the machine busy on the long, resumable data jobs, in dependency order, and commit
what finishes.

    nohup python bench/background.py --budget-minutes 170 [--commit] > /work/logs/bg.log 2>&1 &

Steps (each resumes where the last session stopped; a finished step is skipped quickly):
  1. donors    the 11 zoo networks tuned at 64 trials per task   (bench/tune_donors.py)
  2. collect   cross-measurements, every network as target       (ttrank collect), then
               retraining, bench/ranker_eval.py and bench/program_features.py
               (on a CPU other than the tables', only the retraining and the reports run;
               --collect-here collects this CPU's own rows, which takes hours)
  3. long      MetaSchedule runs of >= 200 trials per task for the paper's max speedup,
               from scratch, one runtime thread per core, as donor sets (ttrank.bench.long_dir)
  4. evaluate  the side-by-side measurement runs behind bench/results/paper_table.*
  5. recommend `recommend --leave-one-out` on ResNet-50 and every zoo network, with the
               shipped ranker (rerun when it, the donors or the threads change; #6 is
               resolved, so the open issues' runs go first)
  6. builder   bench/builder_speed.py again on an idle machine (for #3, already resolved)
Run one copy at a time (it refuses to start when another is running).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ttrank.bench import DONOR_ORDER as ORDER
from ttrank.bench import LONG, LONG_TRIALS, long_dir
from ttrank.target import host_mcpu
from ttrank.util import read_jsonl
from ttrank.workdir import read_manifest

# this script's own checkout: the steps run in it, and it commits what they write
ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], deadline: float) -> int:
    left = (deadline - time.time()) / 60
    if left < 3:
        return -1
    cmd = [c.replace("{left}", f"{left:.1f}") for c in cmd]
    print(time.strftime("%H:%M:%S"), " ".join(cmd), flush=True)
    # The steps import ttrank from this checkout even when the installed copy points elsewhere.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.call(cmd, cwd=ROOT, env=env)


def commit(message: str, enabled: bool, extra: list[str] | None = None) -> None:
    if not enabled:
        return
    paths = ["datasets", "bench/results", *(extra or [])]
    for _ in range(5):  # someone else may hold the index lock for a moment
        if subprocess.call(["git", "add", *paths], cwd=ROOT) == 0:
            break
        time.sleep(3)
    if subprocess.call(["git", "diff", "--cached", "--quiet", "--", *paths], cwd=ROOT) == 0:
        return
    for _ in range(5):
        if subprocess.call(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT) == 0:
            return
        time.sleep(3)


def donors_complete(names: list[str]) -> bool:
    for n in names:
        m = read_manifest(ROOT / "datasets" / "donors" / n)
        if not (m.get("complete") and m.get("model_latency_ms")):
            return False
    return True


def reports_current() -> bool:
    """bench/results/ranker_eval.json was computed from the data the shipped ranker learned."""
    try:
        model = json.loads((ROOT / "models" / "ranker.meta.json").read_text())
        report = json.loads((ROOT / "bench" / "results" / "ranker_eval.json").read_text())
    except (OSError, ValueError):
        return False
    return report.get("training_data_hash") == model.get("training_data_hash") is not None


def dataset_cpus() -> set[str]:
    """The CPUs (mcpu) the cross-measurement tables were collected on."""
    return {(r.get("provenance") or {}).get("mcpu")
            for p in (ROOT / "datasets" / "measurements").glob("*.jsonl") for r in read_jsonl(p)} - {None}


def retrain_and_report(py: str, deadline: float, enabled: bool) -> None:
    """Retrain on everything collected (exit 3: already current), and regenerate the evaluation
    reports unless they were made from the shipped model's data."""
    if run([py, "train.py", "--skip-if-current"], deadline) not in (0, 3):
        return
    commit("Ranker retrained on all cross-measurements", enabled, extra=["models"])
    if not reports_current() and run([py, "bench/ranker_eval.py"], deadline) >= 0:
        commit("Ranker evaluation report", enabled)
        # does MetaSchedule's per-store program feature help? (answer in bench/results)
        if run([py, "bench/program_features.py"], deadline) >= 0:
            commit("Program-feature evaluation", enabled)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-minutes", type=float, required=True)
    ap.add_argument("--commit", action="store_true", help="git-commit datasets/ after each step")
    ap.add_argument("--steps", nargs="+", default=["donors", "collect", "long", "evaluate", "recommend", "builder"])
    ap.add_argument("--collect-here", action="store_true",
                    help="collect cross-measurements on this CPU even when the tables were collected on "
                         "another one (hours; the collector keeps each CPU's rows apart)")
    args = ap.parse_args()
    others = [p for p in psutil.process_iter(["pid", "cmdline"])
              if p.pid != psutil.Process().pid and "background.py" in " ".join(p.info["cmdline"] or [])
              and "python" in " ".join(p.info["cmdline"] or [])]
    if others:
        print(f"another background.py is running (pid {others[0].pid})")
        return 1
    deadline = time.time() + 60 * args.budget_minutes
    py = sys.executable

    if "donors" in args.steps:
        for net in ORDER:
            if run([py, "bench/tune_donors.py", "--budget-minutes", "{left}", net], deadline) < 0:
                return 0
            commit(f"Donor tuning: {net}", args.commit)
    if not donors_complete(ORDER):
        print("donors incomplete; later steps wait for them", flush=True)
        return 0
    here, have = host_mcpu(), dataset_cpus()
    if "collect" in args.steps and have and here not in have and not args.collect_here:
        # a session on another CPU would start the whole collection over for that CPU; the open
        # issues need the long runs and the paper runs first (--collect-here to do it anyway)
        print(f"collect: the tables were measured on {', '.join(sorted(have))}, this host is {here}; "
              "skipped (--collect-here collects for this CPU)", flush=True)
        args.steps = [s for s in args.steps if s != "collect"]
        retrain_and_report(py, deadline, args.commit)
    if "collect" in args.steps:
        for net in ORDER:
            if run(["ttrank", "collect", net, "--max-per-kernel", "24", "--budget-minutes", "{left}",
                    "--quiet"], deadline) < 0:
                return 0
            commit(f"Cross-measurements: {net}", args.commit)
        retrain_and_report(py, deadline, args.commit)
    if "long" in args.steps:
        for net in LONG:
            work = long_dir(net)
            if run(["ttrank", "tune", f"zoo:{net}", "--out", str(work), "--name", net,
                    "--trials-per-task", str(LONG_TRIALS), "--budget-minutes", "{left}",
                    "--no-progress", "--measure-model"], deadline) < 0:
                return 0
            commit(f"MetaSchedule long run: {net}", args.commit)
    if "evaluate" in args.steps:
        if run([py, "bench/paper_table.py", "--measure", "--budget-minutes", "{left}"], deadline) >= 0:
            commit("Paper table measurements", args.commit)
    if "recommend" in args.steps:
        # the product on every network, with all donors (each run is skipped once current)
        if run([py, "bench/recommend_bench.py", "--network", "resnet50", "--skip-if-current"], deadline) < 0:
            return 0
        commit("recommend benchmark: resnet50", args.commit)
        if run([py, "bench/recommend_zoo.py", "--budget-minutes", "{left}"], deadline) < 0:
            return 0
        commit("recommend on every zoo network", args.commit)
    if "builder" in args.steps:
        # the builder benchmark of #3 (resolved), again on a machine with nothing else running;
        # last, because the open issues need the compute first
        if run([py, "bench/builder_speed.py", "--skip-if-current"], deadline) >= 0:
            commit("builder speed benchmark", args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
