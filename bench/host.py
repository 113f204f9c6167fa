"""Native speed on this CPU (issue #19): ttrank against onnxruntime on the zoo's CNNs, with the
shipped data only and after `ttrank adapt`, in one resumable run.

    python bench/host.py [--adapt-minutes 60] [--adapt-seeds N] [--adapt-plan P] [--adapt-trials T]
                         [--networks NET ...] [--budget-minutes M] [--force] [--layout nchwc|auto]

1. **shipped**: `ttrank recommend zoo:NET --leave-one-out` per network, with a user cache that
   holds nothing of this machine (no native donors, no adapted ranker): what a new user gets.
2. **adapt**: `ttrank adapt --budget-minutes M` into a second user cache (resumable; its wall
   time is the adaptation's cost).
3. **adapted**: the same recommends with that cache: native donors and the ranker that learned
   this CPU's rows (a network's own natively tuned kernels stay left out, as its donors are).

``--native`` runs one more phase, ``native@L``: the same recommends with every shipped donor set
and row, this CPU's too, and without ``--leave-one-out``, so a network whose donors were tuned
here (bench/tune_donors.py, hours of MetaSchedule search) can pick its own kernels. It is what
MetaSchedule's schedule space reaches on this CPU at the donors' depth: the reference that the
60-minute adaptation of a CPU never seen approaches.

Each recommend times its compiled model in alternation with onnxruntime (its own
``model_latency_ms``). Results go to bench/results/host.json after every step; a rerun skips what
is done for this CPU; other CPUs' results are kept under ``other_cpus``. The caches live under
bench/work/host/<mcpu>/.

The CPU is held out of the shipped data first (:func:`ttrank.holdout.hold_out_cpu`): donor sets
tuned on it, its measurement rows and the ranker's knowledge of it are left out of the data home
every step uses (bench/work/host/<mcpu>/shipped-home), so a machine whose rows were published by
an earlier run is still a CPU the data has never seen. What was left out is in ``held_out``.

``--layout L`` runs the recommends with ``--layout L`` and adapts in the packed layout (for
``nchwc`` and ``auto``); its phases are kept beside the NCHW ones, as ``shipped@L``,
``adapted@L`` and ``adaptation@L``, with caches of their own.

A rerun given a larger ``--adapt-minutes`` than the recorded adaptation continues it (``ttrank
adapt`` resumes its plan) with the minutes left, adds its wall time to the adaptation's, and
measures the adapted phase again (the earlier one kept under its ``earlier`` list).

``--label X`` keeps a rerun after
the shipped data changed (new donors), or an A/B of adapt's settings (``--adapt-*``), beside the
earlier one, as ``shipped@L+X`` and so on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ttrank.adapt import adapted
from ttrank.holdout import hold_out_cpu
from ttrank.locations import using_home
from ttrank.bench import head_commit, ranker_id, results_dir, run_recommend
from ttrank.target import host_mcpu, make_target, provenance
from ttrank.util import atomic_write_json, environ
from ttrank.zoo import PAPER_NETWORKS, ZOO

OUT = results_dir() / "host.json"
CNNS = [n for n in PAPER_NETWORKS if ZOO[n].family == "cnn"]


@contextlib.contextmanager
def user_cache(path: Path):
    """Run with ``path`` as the user's cache (TTRANK_CACHE), for this process and its children.

    The donor records' program features (derived from the shipped records alone, ~15 min to
    compute on 2 cores) are shared by both phases' caches, as one user's cache would hold them.
    """
    shared = path.parent / "program_features"
    shared.mkdir(parents=True, exist_ok=True)
    link = path / "program_features"
    if not link.exists():
        path.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared.resolve(), target_is_directory=True)
    with environ("TTRANK_CACHE", path):
        yield


def one(net: str, layout: str = "nchw", phase: str = "", leave_one_out: bool = True) -> dict:
    # each phase's report is kept apart (bench/work/reports/host-<mcpu>-<phase>-<net>.json): why a
    # network got slower after the adaptation is in the kernels both phases chose
    with tempfile.TemporaryDirectory(prefix="ttrank-host-") as tmp:
        # --no-refine: "shipped" and "adapted" are what the data gives, not recommend's own search
        report, wall, _, cmd = run_recommend(net, Path(tmp), extra=("--layout", layout, "--no-refine"),
                                             report_name=f"host-{host_mcpu()}-{phase}-{net}",
                                             leave_one_out=leave_one_out)
    lat = report["model_latency_ms"]
    return {"ttrank_ms": lat["tuned"], "onnxruntime_ms": lat.get("onnxruntime"),
            "ort_ratio": lat["tuned"] / lat["onnxruntime"] if lat.get("onnxruntime") else None,
            "recommend_seconds": round(wall, 1), "phases_seconds": report.get("search_seconds"),
            "fast_math": (report.get("provenance") or {}).get("fast_math"), "ranker": ranker_id(),
            "layout": (report.get("provenance") or {}).get("layout"),
            "max_abs_error_vs_onnxruntime": report["max_abs_error_vs_onnxruntime"],
            # what else ran while its candidates were measured (the worst batch) and while it was timed
            "foreign_load": {"measuring": (report.get("provenance") or {}).get("foreign_load_max"),
                             "timing": lat.get("foreign_load")},
            "command": " ".join(cmd[:4]) + " ...", "commit": head_commit(), "provenance": provenance(),
            **({} if leave_one_out else {"own_kernels_chosen": sum(
                (k.get("chosen") or {}).get("donor_network") == net for k in report["kernels"])})}


def run_of(report: dict | None, **kw) -> dict:
    """One sitting of an adaptation, for its ``_runs`` list: the plan, the same for every
    sitting, stays in the last report only."""
    return {**kw, "report": {k: v for k, v in (report or {}).items() if k not in ("plan", "plan_for")}}


def summary(phase: dict) -> dict:
    """Averages of a phase's per-network ratios."""
    ratios = [r["ort_ratio"] for r in phase["networks"].values() if r.get("ort_ratio")]
    return {"ort_ratio_cnn_avg": float(np.mean(ratios)) if ratios else None,
            "networks_faster_than_ort": sum(r < 1.0 for r in ratios), "networks_measured": len(ratios)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--networks", nargs="+", default=CNNS)
    ap.add_argument("--adapt-minutes", type=float, default=60.0)
    ap.add_argument("--adapt-seeds", type=int, default=None, help="adapt's --seeds (default: its own)")
    ap.add_argument("--adapt-plan", default=None, help="adapt's --plan (default: its own)")
    ap.add_argument("--adapt-trials", type=int, default=None, help="adapt's --trials (default: its own)")
    ap.add_argument("--budget-minutes", type=float, default=None, help="start no step after this")
    ap.add_argument("--force", action="store_true", help="redo this CPU's steps")
    ap.add_argument("--shipped-only", action="store_true", help="stop after the shipped phase")
    ap.add_argument("--label", default="",
                    help="phases of their own (shipped@L+LABEL, ...): the same steps after the shipped "
                         "data changed, beside the earlier ones")
    ap.add_argument("--layout", choices=["nchw", "nchwc", "auto"], default="nchw")
    ap.add_argument("--native", action="store_true",
                    help="only the native phase: every shipped donor set and row, this CPU's too, no leave-one-out")
    ap.add_argument("--retime", choices=["shipped", "adapted"], default=None,
                    help="run that phase's recommends again with the same caches (after the code or the shipped "
                         "donors changed); the earlier results are kept under its 'earlier' list")
    args = ap.parse_args()
    tag = ("" if args.layout == "nchw" else f"@{args.layout}") + (f"+{args.label}" if args.label else "")
    shipped, adapted_phase = f"shipped{tag}", f"adapted{tag}"

    mcpu = host_mcpu()
    work = Path(__file__).resolve().parent / "work" / "host" / mcpu
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    # the top level is this CPU's; every other CPU's results stay, under other_cpus
    others = old.pop("other_cpus", {})
    if old.get("cpu") and old["cpu"] != mcpu:
        others[old["cpu"]] = old
        old = others.pop(mcpu, {})
    res = old if old.get("cpu") == mcpu and not args.force else {"cpu": mcpu}
    res["other_cpus"] = others
    deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
    if args.native:
        return run_native(args, res, f"native{tag}", work / f"native-cache{tag}", deadline)
    res.setdefault(shipped, {"networks": {}})
    res.setdefault(adapted_phase, {"networks": {}})
    if args.retime:  # a retime interrupted at this commit goes on where it stopped
        phase = shipped if args.retime == "shipped" else adapted_phase
        if res[phase].get("retimed_at") != head_commit():
            old_phase = res[phase]
            res[phase] = {"networks": {}, "retimed_at": head_commit(),
                          "earlier": [*old_phase.pop("earlier", []), old_phase]}
    held = hold_out_cpu(mcpu, work / "shipped-home")
    print(f"held out of the shipped data: {held.rows} rows and {len(held.sets)} donor sets of {mcpu}"
          f"{', ranker refitted without them' if held.retrained else ''}", flush=True)
    # the phases' record of it: a later rerun (new shipped data) may hold out something else
    res.setdefault(f"held_out{tag}", {k: v for k, v in held.to_json().items() if k != "home"})
    with using_home(held.home):
        return run(args, res, tag, mcpu, work, deadline)


def run_native(args: argparse.Namespace, res: dict, phase: str, cache: Path, deadline: float | None) -> int:
    """The native phase: the shipped data home as it is, a user cache of its own."""
    res.setdefault(phase, {"networks": {}})
    with user_cache(cache):
        for net in args.networks:
            if net in res[phase]["networks"]:
                continue
            if deadline and time.time() > deadline:
                print("budget spent; rerun to continue")
                return 0
            print(f"{phase}: {net}", flush=True)
            try:
                res[phase]["networks"][net] = one(net, args.layout, phase, leave_one_out=False)
            except RuntimeError as e:
                res[phase]["networks"][net] = {"ort_ratio": None, "error": str(e)[-1500:]}
            res[phase].update(summary(res[phase]))
            res["provenance"] = provenance()
            atomic_write_json(OUT, res)
    print(phase, {k: v for k, v in res[phase].items() if k != "networks"})
    return 0


def run(args: argparse.Namespace, res: dict, tag: str, mcpu: str, work: Path, deadline: float | None) -> int:
    """The three phases, with the data home that holds this CPU out."""
    shipped, adapted_phase, adaptation = f"shipped{tag}", f"adapted{tag}", f"adaptation{tag}"

    def save() -> None:
        for phase in (shipped, adapted_phase):  # a retimed phase's summary is of its new runs
            res[phase].update(summary(res[phase]))
        res["provenance"] = provenance()
        atomic_write_json(OUT, res)

    def run_phase(phase: str, cache: Path) -> bool:
        with user_cache(cache):
            for net in args.networks:
                if net in res[phase]["networks"]:
                    continue
                if deadline and time.time() > deadline:
                    return False
                print(f"{phase}: {net}", flush=True)
                try:
                    res[phase]["networks"][net] = one(net, args.layout, phase)
                except RuntimeError as e:  # recommend failed: say so in the table, go on
                    res[phase]["networks"][net] = {"ort_ratio": None, "error": str(e)[-1500:]}
                save()
        return True

    if not run_phase(shipped, work / f"shipped-cache{tag}"):
        print("budget spent; rerun to continue")
        return 0
    if args.shipped_only:
        return 0
    adapted_cache = work / f"adapted-cache{tag}"
    spent = res.get(f"{adaptation}_seconds", 0.0)
    asked = 60 * args.adapt_minutes
    # the budget the recorded adaptation was given (before this key existed: its one run's)
    given = 60 * res.get(f"{adaptation}_budget_minutes", (res.get(adaptation) or {}).get("budget_s", 0) / 60)
    more = asked - spent if spent and given < asked and not (res.get(adaptation) or {}).get("complete") else 0
    if not spent or more >= 60:
        # one adaptation of the given budget is the step measured; a rerun given a larger budget
        # continues it (adapt resumes its plan) with what is left, and the adapted phase is redone
        if deadline and time.time() > deadline:
            print("budget spent; rerun to continue")
            return 0
        with user_cache(adapted_cache):
            t0 = time.time()
            layout = "nchw" if args.layout == "nchw" else "nchwc"
            cmd = ["ttrank", "adapt", "--budget-minutes", str(round((more or asked) / 60, 2)), "--layout", layout]
            # an A/B of adapt's settings: give each arm its --label
            for flag, value in (("--seeds", args.adapt_seeds), ("--plan", args.adapt_plan),
                                ("--trials", args.adapt_trials)):
                if value is not None:
                    cmd += [flag, str(value)]
            proc = subprocess.run(cmd, text=True, capture_output=True)
            print(proc.stdout[-3000:])
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            runs = res.get(f"{adaptation}_runs") or ([run_of(res[adaptation], seconds=spent,
                                                             command=res.get(f"{adaptation}_command"))]
                                                      if spent else [])
            res[f"{adaptation}_seconds"] = round(spent + time.time() - t0, 1)
            res[f"{adaptation}_budget_minutes"] = args.adapt_minutes
            res[adaptation] = adapted(make_target(), layout)
            res[f"{adaptation}_command"] = " ".join(cmd)
            res[f"{adaptation}_runs"] = [*runs, run_of(res[adaptation], seconds=round(time.time() - t0, 1),
                                                       command=" ".join(cmd), commit=head_commit())]
        if spent:  # the adapted phase measured the shorter adaptation: kept, and measured again
            old_phase = res[adapted_phase]
            res[adapted_phase] = {"networks": {}, "earlier": [*old_phase.pop("earlier", []), old_phase]}
        save()
    if not run_phase(adapted_phase, adapted_cache):
        print("budget spent; rerun to continue")
        return 0
    save()
    for phase in (shipped, adapted_phase):
        print(phase, {k: v for k, v in res[phase].items() if k != "networks"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
