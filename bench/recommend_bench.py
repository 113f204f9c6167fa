"""`ttrank recommend` on one zoo network, leave-one-out, against MetaSchedule's own tuning curve.

    python bench/recommend_bench.py [--network resnet50] [--pause-background]

Runs the CLI as a user would (fresh data dir, so nothing is reused from earlier runs), with the
network's own schedules and measurements left out of both the candidates and the ranker.
Then reads MetaSchedule's convergence curve for the same network from its donor tuning log
(its long run, ttrank.bench.long_dir(<net>), when finished, else datasets/donors/<net>) and
finds the search seconds MetaSchedule needed to reach ttrank's latency. Both sides are compared
as the sum over kernels of weight x measured kernel latency, since MetaSchedule's log only has
kernel latencies along the way; the whole-model latencies are reported beside them.

Writes bench/results/recommend_<net>.json with speedup_vs_untuned, recommend_seconds and
metaschedule_seconds_to_match (the oracle bound: MetaSchedule's best possible split of time
among kernels; the as-run figure is kept beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tvm.s_tir import meta_schedule as ms

from ttrank.bench import metaschedule_dir, paused_background, ranker_id, results_dir, run_recommend
from ttrank.convergence import database_schedules, read_log, remeasure, remeasured_curves, seconds_to_match
from ttrank.donors import DonorStore
from ttrank.frontend import load
from ttrank.locations import data_home
from ttrank.measure import Measurer
from ttrank.pipeline import MEASURE_SECONDS
from ttrank.runtime import time_side_by_side
from ttrank.target import make_target, provenance, runtime_threads
from ttrank.util import atomic_write_json
from ttrank.workdir import open_database, read_manifest
from ttrank.zoo import export


def side_by_side(net: str, db_dir: Path, pause: bool) -> dict:
    """Re-measure, in one run, the untuned kernels, every step of MetaSchedule's curve and
    ttrank's chosen schedules; then time the whole model built each way."""
    d = metaschedule_dir(net)
    if d is None:
        return {"error": f"no finished MetaSchedule tuning log for {net} yet "
                         f"(python bench/tune_donors.py {net} finishes it)"}
    target = make_target()
    log = read_log(d)
    ours = database_schedules(db_dir)
    measurer = Measurer(target)
    with paused_background(pause):
        try:
            sbs = remeasure(log, {"ttrank": ours}, measurer,
                            on_progress=lambda i, n, name: print(f"  re-measured {i}/{n} {name}", flush=True))
        finally:
            measurer.close()
        with tempfile.TemporaryDirectory() as tmp:
            onnx = export(net, Path(tmp) / f"{net}.onnx")
            model = load(onnx, fast_math=False)
            whole = time_side_by_side(model, target, {
                "ttrank": ms.database.JSONDatabase(work_dir=str(db_dir)),
                "metaschedule": open_database(d)})
    curves, order = remeasured_curves(log, sbs.steps)
    w = log.weights
    goal = sbs.kernel_sum(w, "ttrank")
    untuned = {n: sbs.untuned[n] or 0.0 for n in w}
    return {"log": str(d.relative_to(data_home())), "trials": log.manifest.get("trials_done"),
            "trials_per_task": log.manifest.get("trials_per_task"),
            "search_seconds": log.manifest.get("search_seconds"),
            "kernel_sum_ms": {"untuned": 1e3 * sum(w[n] * untuned[n] for n in w),
                              "ttrank": 1e3 * goal, "metaschedule_final": 1e3 * sbs.kernel_sum(w)},
            "whole_model_ms": whole,
            "seconds_to_match": seconds_to_match(curves, order, w, untuned, goal),
            "kernels": {n: {"weight": w[n], "untuned_s": sbs.untuned.get(n),
                            "ttrank_s": sbs.others.get("ttrank", {}).get(n),
                            "metaschedule_steps": [(round(st.seconds, 1), lat) for st, lat in
                                                   zip(log.steps.get(n, []), sbs.steps.get(n, []))]}
                        for n in w}}


def ms_layout(work_dir: Path | None) -> str:
    """The activation layout MetaSchedule's run tuned (its manifest's; runs before layouts: nchw)."""
    return (read_manifest(work_dir).get("layout") if work_dir else None) or "nchw"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", default="resnet50")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--pause-background", action="store_true",
                    help="pause background tuning/collection during the run (2 cores)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-if-current", action="store_true",
                    help="do nothing if the result was measured with the donor networks there are now")
    args = ap.parse_args()
    net = args.network
    root = data_home()
    path = Path(args.out) if args.out else results_dir() / f"recommend_{net}.json"
    available = sorted(n for n in DonorStore.load().networks if n != net)
    ms_dir = metaschedule_dir(net)
    # a result is current while the donors, the runtime's threads, recommend's measuring budget
    # and MetaSchedule's run are
    state = {"donor_networks_available": available, "threads": runtime_threads(),
             "measure_seconds": MEASURE_SECONDS, "ranker": ranker_id(),
             "metaschedule_run": str(ms_dir.relative_to(root)) if ms_dir else None}
    if args.skip_if_current and path.exists():
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in state} == state:
            print(f"{path} is current ({state})")
            return 0

    with tempfile.TemporaryDirectory(prefix="ttrank-bench-") as tmp:
        try:
            # exact math and MetaSchedule's layout on both sides: its run tuned libm's exp/erf
            # kernels, and kernel sums compare only over the same kernels. --no-refine: the
            # paper's experiment is transfer, not transfer and then search
            report, wall, paused, cmd = run_recommend(net, Path(tmp), args.top_k, args.pause_background,
                                                      extra=("--exact-math", "--layout", ms_layout(ms_dir),
                                                             "--no-refine"))
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        ms = side_by_side(net, Path(report["database"]), args.pause_background)
    lat = report["model_latency_ms"]
    match = (ms.get("seconds_to_match") or {}).get("oracle")
    whole = ms.get("whole_model_ms", {})
    out = {
        "network": net, "command": " ".join(cmd[:4]) + " ...",
        "recommend_seconds": round(wall, 1),
        "speedup_vs_untuned": lat["untuned"] / lat["tuned"],
        "model_latency_ms": lat, "search_seconds": report["search_seconds"],
        "max_abs_error_vs_onnxruntime": report["max_abs_error_vs_onnxruntime"],
        "kernels": len(report["kernels"]),
        "kernels_tuned": sum(1 for k in report["kernels"] if k["status"] != "untuned"),
        "donor_networks": sorted({k["chosen"]["donor_network"] for k in report["kernels"] if k.get("chosen")}),
        **state,
        "metaschedule_seconds_to_match": match,
        "metaschedule_seconds_to_match_as_run": (ms.get("seconds_to_match") or {}).get("as_run"),
        "metaschedule_time_ratio": (match / wall) if match else None,
        # when MetaSchedule never got there, its whole run is a lower bound on the time it needs
        "metaschedule_seconds_to_match_lower_bound": match or ms.get("search_seconds"),
        "metaschedule_time_ratio_lower_bound": (match or ms.get("search_seconds") or 0) / wall,
        "side_by_side_ms": whole,
        "metaschedule": ms,
        "background_paused": paused,
        "provenance": provenance(),
        "note": ("recommend ran with background work paused" if paused else
                 "recommend ran as the machine's only measuring job (background_paused 0: nothing was "
                 "running, or it was a step of bench/background.py itself)") +
                " and a fresh data dir. Afterwards, in one "
                "run, the untuned kernels, every step of MetaSchedule's curve (the trial that set "
                "each batch's new best) and ttrank's chosen schedules were re-measured kernel by "
                "kernel, and both whole models timed in alternation (side_by_side_ms). Time to "
                "match compares kernel sums (weight x latency). 'oracle' is MetaSchedule's best "
                "possible split of its search time among kernels; None means its logged run never "
                "reached ttrank's latency.",
    }
    atomic_write_json(path, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("metaschedule", "model_latency_ms")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
