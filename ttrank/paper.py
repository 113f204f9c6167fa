"""The paper's experiment side by side: ttrank vs transfer-tuning (paper) vs MetaSchedule vs
onnxruntime, for each zoo network as the target, leave-one-out.

Each network that has what it needs (its cross-measurement table and its MetaSchedule tuning
log) gets one *evaluation run* (:func:`evaluation_run`), cached in
bench/results/paper_runs/<net>.json. In that run, kernel by kernel and in one batch each, these
are measured side by side: the untuned kernel; every step of MetaSchedule's convergence curve
(the longest log: the long run ttrank.bench.long_dir(<net>), a donor set, if finished, else the
64-trial donor run);
ttrank's ranks 1 to 5, as `recommend --leave-one-out` ranks the whole donor pool of the other
networks (the shipped ranker refitted without <net>, its second stage with a cost model that
never saw <net>); the fastest of the collected cross-measurement sample; and the paper's
choice (the one paired donor network, exact fused-op class, its tile sizes left as they are,
the fastest of all its candidates as the collector measured them). ttrank top-k is the fastest
of ranks 1..k in this run, as `recommend` keeps the fastest it measured; "exhaustive" the
fastest of the top 5 and the sample (a lower bound on measuring the whole pool, which its
search time assumes). Then the whole model is built with ttrank's top-3 schedules and with
MetaSchedule's, and timed in alternation with onnxruntime.

The table (:func:`build_table`, :func:`write_outputs`) is built from the cached runs:
bench/results/paper_table.md, paper_table.json (``average`` holds pct_max_speedup_top3,
metaschedule_time_ratio_top3 and ort_latency_ratio_top3; ``networks`` one row per network) and
paper_table.png.

Latency per method is the sum over kernels of weight x kernel latency (all measured in the same
run); the whole-model numbers are reported beside it. Search time: MetaSchedule's from its log;
ttrank's and the paper's = candidates measured x the measured cost of one candidate in the
evaluation run (build + correctness check + timing), plus the untuned kernels and compiling;
ttrank's also counts its ranking (second stage and transfers included).

The driver is ``bench/paper_table.py``.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bench import LONG_TRIALS, ranker_id, results_dir
from .bench import metaschedule_dir as ms_dir
from .convergence import TaskCurve, model_curve, read_log, remeasure, seconds_to_match
from .donors import shipped_work_dirs
from .frontend import load
from .kernels import extract
from .locations import data_home, shipped_measurements
from .measure import Measurer
from .measurements import UNTUNED
from .ranking import AdaptiveK, Pick, SecondStage, rank_kernel, shortlist
from .runtime import compile_in_parallel, time_side_by_side, write_database
from .space import space_candidates
from .target import host_cores, make_target, provenance, runtime_threads, target_cpu
from .training import ranker_without
from .transfer import postprocessors, transfer
from .util import atomic_write_json, atomic_write_text, read_jsonl
from .workdir import database_files, open_database
from .zoo import export


KS = (1, 3, 5)
TRANSFORMERS = ("bert", "mobilebert")
METHODS = ("top1", "top3", "top5", "exhaustive", "paper")
RANKS = tuple(f"rank{i}" for i in range(1, max(KS) + 1))
MEASURED = (*RANKS, "sample_best", "paper")  # what one evaluation run measures per kernel
RUN_VERSION = 4  # 2: ttrank's top-k ranked over the whole donor pool and measured in the run;
# 3: its transfers and final compile timed as recommend runs them (in parallel); 4: a kernel no
# donor covers gets samples of MetaSchedule's design space, as recommend gives it
# recommend's default measuring policy, with the shipped ranker's k (5) as its bound: per kernel,
# the ranks its scores and share of the model ask for (ttrank.ranking.AdaptiveK)
POLICY = AdaptiveK(max(KS))


def runs_dir() -> Path:
    """``bench/results/paper_runs``: one evaluation run per network, ``<net>.json``."""
    return results_dir() / "paper_runs"


def inputs_hash(net: str) -> str:
    """Changes when the run's inputs grow (the measurement table, the MetaSchedule log or the
    donor store), the runtime's thread count changes, or the shipped ranker (or its second
    stage) changes."""
    h = hashlib.sha256(f"v{RUN_VERSION} threads={runtime_threads()} ranker={ranker_id()}".encode())
    donors = [p for d in shipped_work_dirs() for p in database_files(d)]
    for p in (shipped_measurements() / f"{net}.jsonl", (ms_dir(net) or Path("/nonexistent")) / "trials.jsonl",
              *donors):
        h.update(str(p.stat().st_size if p.exists() else 0).encode())
    return h.hexdigest()[:12]


@dataclass
class Picks:
    """Per kernel (workload hash), what the run measures: ttrank's ranks 1..5 over the whole
    donor pool of the other networks (as `recommend --leave-one-out` ranks them, second stage
    included), the fastest candidate of the collected sample, and the paper's choice."""

    chosen: dict[str, dict[str, Pick]]  # workload -> label (MEASURED) -> the pick, transferred
    pool: dict[str, int]  # workload -> compatible donor schedules (what exhaustive would measure)
    paper_measured: dict[str, int]  # workload -> the paper's candidates (all measured)
    ranking_seconds: float  # ranking + second stage + transferring the top 5, every kernel


def choose(net: str, kernels: list, store, ranker, target) -> Picks:
    """ttrank's picks with ``ranker`` (which never saw ``net``), and the collected sample's and
    the paper's fastest, transferred onto ``net``'s kernels."""
    stage = SecondStage.of(ranker, store, target, {net})  # a leave-one-out fit: not search time
    t0 = time.time()
    out = Picks({}, {}, {}, 0.0)
    cpu = target_cpu(target)
    ranked = {}
    for k in kernels:
        ranked[k.workload_hash] = rank_kernel(k, store, ranker, {net}, cpu)
        out.pool[k.workload_hash] = len(ranked[k.workload_hash])
        if not ranked[k.workload_hash]:  # as recommend: MetaSchedule's design space stands in
            ranked[k.workload_hash] = space_candidates(k, target, max(len(RANKS), stage.shortlist if stage else 0))
    # as recommend: in rank order until k transfers apply, the kernels' shortlists transferred
    # on one thread per core (TVM's C++ releases the GIL)
    postprocessors(target)
    with ThreadPoolExecutor(host_cores()) as ex:
        lists = ex.map(lambda k: shortlist(k, ranked[k.workload_hash], len(RANKS), target, stage), kernels)
        for k, picks in zip(kernels, lists):
            out.chosen[k.workload_hash] = dict(zip(RANKS, picks))
    out.ranking_seconds = time.time() - t0

    rec_of = store.by_record_id()
    best: dict[tuple[str, str], dict] = {}
    for r in read_jsonl(shipped_measurements() / f"{net}.jsonl"):
        if r["record"] == UNTUNED or r["record"] not in rec_of:
            continue
        label = "paper" if r.get("pool") == "paper" else "sample_best"
        if label == "paper":
            out.paper_measured[r["workload"]] = out.paper_measured.get(r["workload"], 0) + 1
        if r["status"] == "ok" and r.get("latency_s"):
            key = (r["workload"], label)
            if key not in best or r["latency_s"] < best[key]["latency_s"]:
                best[key] = r
    by_hash = {k.workload_hash: k for k in kernels}
    for (wh, label), r in best.items():
        if wh in by_hash:
            w, rec = rec_of[r["record"]]
            t = transfer(rec, by_hash[wh], w, target, adapt=r.get("adapt") or "ttrank")
            if t.ok:
                out.chosen.setdefault(wh, {})[label] = Pick(None, t)
    return out


def _chosen_json(pick: Pick) -> dict:
    t, c = pick.transferred, pick.candidate
    return {"donor_network": t.donor.network, "donor_kernel": t.donor.kernel.name, "record": t.record.id,
            "score": c.score if c else None, "cost_score": c.cost_score if c else None}


def evaluation_run(net: str, store, shipped,
                   on_progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Everything measured for ``net`` in one run (see the module docstring). ``on_progress(i,
    n, kernel)``: called as each of the n kernels is measured."""
    target = make_target()
    log = read_log(ms_dir(net))
    ranker = ranker_without(net, shipped, store, [shipped_measurements()])
    with tempfile.TemporaryDirectory() as tmp:
        # exact math: MetaSchedule's runs tuned libm's exp/erf, and its log names those kernels
        model = load(export(net, Path(tmp) / f"{net}.onnx"), fast_math=False)
        kernels = extract(model.mod, target)  # injective kernels too, as recommend
        picks = choose(net, kernels, store, ranker, target)
        others = {label: {wh: got[label].transferred.mod for wh, got in picks.chosen.items() if label in got}
                  for label in MEASURED}
        measurer = Measurer(target)
        t0 = time.time()
        try:
            sbs = remeasure(log, others, measurer, on_progress=on_progress)
        finally:
            measurer.close()
        wall = time.time() - t0
        n_measured = sum(len(v) for v in others.values()) + sum(len(s) for s in log.steps.values())
        n_measured += len(log.kernels)
        # whole model: ttrank top-3 (the fastest of ranks 1-3 in this run) and MetaSchedule's
        # final database, timed in alternation with onnxruntime
        # the run's results are keyed by the log's task names, the database by the kernels'
        name_of = {k.workload_hash: n for n, k in log.kernels.items()}
        top3 = {}
        for k in kernels:
            got = picks.chosen.get(k.workload_hash, {})
            lat = [(sbs.others.get(r, {}).get(name_of.get(k.workload_hash)), got[r]) for r in RANKS[:3] if r in got]
            lat = [(x, c) for x, c in lat if x is not None]
            if lat:
                top3[k.name] = min(lat, key=lambda xc: xc[0])[1].transferred
        db3 = write_database(Path(tmp) / "top3", kernels, top3, target)
        # compiled as recommend compiles: the kernels in parts on one build worker per core
        t1 = time.time()
        compile_in_parallel(model, target, db3, Path(tmp) / "top3.so")
        compile_s = time.time() - t1
        whole = time_side_by_side(model, target, {"ttrank_top3": db3,
                                                   "metaschedule": open_database(log.work_dir)})
    return {"network": net, "version": RUN_VERSION, "inputs": inputs_hash(net),
            "log": str(log.work_dir.relative_to(data_home())),
            "log_trials": log.manifest.get("trials_done"), "log_trials_per_task": log.manifest.get("trials_per_task"),
            "log_search_seconds": log.manifest.get("search_seconds"),
            # the CPUs MetaSchedule searched on (its schedules are re-measured here, on this one)
            "log_cpus": log.manifest.get("cpus") or [(log.manifest.get("provenance") or {}).get("mcpu")],
            "log_threads": (log.manifest.get("provenance") or {}).get("threads", 1),
            "weights": log.weights, "steps_seconds": {n: [s.seconds for s in st] for n, st in log.steps.items()},
            "global_seconds": {n: [s.global_s for s in st] for n, st in log.steps.items()},
            "measured": sbs.to_json(), "whole_model_ms": whole,
            "seconds_per_candidate": wall / max(1, n_measured), "compile_seconds": compile_s,
            "ranking_seconds": picks.ranking_seconds,
            "pool": {name_of[wh]: n for wh, n in picks.pool.items() if wh in name_of},
            "paper_measured": {name_of[wh]: n for wh, n in picks.paper_measured.items() if wh in name_of},
            "ranker": {"left_out": net, "stage2": (shipped.metadata.get("stage2") or {}).get("enabled", False)},
            "chosen": {label: {name_of[wh]: _chosen_json(got[label])
                               for wh, got in picks.chosen.items() if label in got and wh in name_of}
                       for label in MEASURED},
            "provenance": provenance(target)}


# --------------------------------------------------------------------------------------------
# the table


def row_of(run: dict) -> dict:
    """One network's row of the table from its evaluation run: each method's kernel-sum latency,
    speedup, share of MetaSchedule's max speedup, search seconds and time ratio."""
    w = run["weights"]
    m = json.loads(json.dumps(run["measured"]))
    untuned = {n: m["untuned"].get(n) or 0.0 for n in w}
    meas = m["others"]
    # a schedule picked under two labels (the sample's fastest is also ranked 2nd, say) was
    # measured twice in the run: both get the faster time
    for n in w:
        by_rec: dict[str, list[str]] = {}
        for label in MEASURED:
            rec = run["chosen"].get(label, {}).get(n, {}).get("record")
            if rec and meas.get(label, {}).get(n) is not None:
                by_rec.setdefault(f"{rec}@{label == 'paper'}", []).append(label)
        for labels in by_rec.values():
            best = min(meas[x][n] for x in labels)
            for x in labels:
                meas[x][n] = best

    def fastest(labels, n):
        return min((v for x in labels if (v := meas.get(x, {}).get(n)) is not None), default=None)

    # top-k: the fastest of ranks 1..k (recommend keeps the fastest it measured); exhaustive:
    # the fastest of everything ttrank-transferred that was measured (the top 5 and the sample)
    others = {f"top{k}": {n: fastest(RANKS[:k], n) for n in w} for k in KS}
    others["exhaustive"] = {n: fastest((*RANKS, "sample_best"), n) for n in w}
    others["paper"] = {n: meas.get("paper", {}).get(n) for n in w}
    # the adaptive policy: each kernel's k from the ranker's scores of its ranks (the run keeps
    # those of ranks 1..5; a run without scores reads as a flat list) and its untuned share
    u_all = sum(w[n] * untuned[n] for n in w)
    policy_k = {}
    for n in w:
        scores = sorted((c["score"] for r in RANKS if (c := run["chosen"].get(r, {}).get(n))
                         and c.get("score") is not None), reverse=True) or [0.0] * len(RANKS)
        policy_k[n] = POLICY.k(scores, w[n] * untuned[n] / u_all if u_all else 1.0)
    others["adaptive"] = {n: fastest(RANKS[:policy_k[n]], n) for n in w}
    m["others"] = {k: {n: v for n, v in d.items() if v is not None} for k, d in others.items()}
    curves, order = {}, []
    for n in w:
        c = curves[n] = TaskCurve(n, "")
        best = None
        for t, g, lat in zip(run["steps_seconds"].get(n, []), run["global_seconds"].get(n, []),
                             m["steps"].get(n, [])):
            best = lat if lat is not None and (best is None or lat < best) else best
            c.points.append((t, best))
            order.append((g, n, best))
    order.sort(key=lambda x: x[0])

    def ksum(label: str | None) -> float:
        tot = 0.0
        for n in w:
            if label is None:
                lat = min((x for x in m["steps"].get(n, []) if x is not None), default=None)
            else:
                lat = m["others"].get(label, {}).get(n)
                lat = lat if lat is not None and lat < untuned[n] else None  # recommend keeps untuned
            tot += w[n] * (lat if lat is not None else untuned[n])
        return 1e3 * tot

    u = 1e3 * sum(w[n] * untuned[n] for n in w)
    lat = {"untuned": u, "metaschedule_max": ksum(None)}
    # a method with no schedule for any kernel (e.g. the paper's donor is not tuned yet) has no row
    lat.update({meth: ksum(meth) if m["others"].get(meth) else None for meth in METHODS})
    s_max = u / lat["metaschedule_max"]
    per_cand = run["seconds_per_candidate"]
    n_kernels = len(w)
    have = {n: sum(1 for r in RANKS if r in run["chosen"] and n in run["chosen"][r]) for n in w}
    measured = {f"top{k}": sum(min(k, have[n]) for n in w) for k in KS}
    measured["exhaustive"] = sum(run["pool"].get(n, 0) for n in w)  # every compatible schedule
    measured["paper"] = sum(run["paper_measured"].get(n, 0) for n in w)
    adaptive_measured = sum(min(policy_k[n], have[n]) for n in w)
    # ttrank's ranking time (with the second stage and the transfers of its top 5) counts for
    # every ttrank method; the paper's hand-picked pairing is free
    search = {meth: (measured.get(meth, adaptive_measured) + n_kernels) * per_cand + run["compile_seconds"]
              + (run["ranking_seconds"] if meth != "paper" else 0.0) for meth in (*METHODS, "adaptive")}
    lat_adaptive = ksum("adaptive") if m["others"].get("adaptive") else None
    row = {"latency_ms": lat, "speedup": {k: u / v if v else None for k, v in lat.items()},
           "pct_max_speedup": {meth: (u / lat[meth] - 1) / (s_max - 1) if s_max > 1 and lat[meth] else None
                               for meth in METHODS},
           "search_seconds": {meth: search[meth] for meth in METHODS}, "candidates_measured": measured, "metaschedule_search_seconds": run["log_search_seconds"],
           "metaschedule_trials": run["log_trials"], "metaschedule_trials_per_task": run["log_trials_per_task"],
           "metaschedule_seconds_to_match": {}, "metaschedule_time_ratio": {},
           "whole_model_ms": run["whole_model_ms"],
           "cpu": (run.get("provenance") or {}).get("mcpu"), "metaschedule_cpus": run.get("log_cpus") or [],
           # a fair reference: MetaSchedule's max speedup needs a long run, and its search seconds
           # compare with ttrank's only when it searched on this CPU with the same threads
           "metaschedule_reference": same_machine(run) and (run["log_trials_per_task"] or 0) >= LONG_TRIALS,
           "ort_latency_ratio_top3": run["whole_model_ms"]["ttrank_top3"] / run["whole_model_ms"]["onnxruntime"],
           "curve": [(t, 1e3 * v) for t, v in model_curve(curves, order, w, untuned)],
           # recommend's default policy (kept apart: the fixed top-k columns stay as they were)
           "adaptive": {"policy": POLICY.to_json(), "k": policy_k, "candidates_measured": adaptive_measured,
                        "latency_ms": lat_adaptive, "speedup": u / lat_adaptive if lat_adaptive else None,
                        "pct_max_speedup": (u / lat_adaptive - 1) / (s_max - 1)
                        if s_max > 1 and lat_adaptive else None,
                        "search_seconds": search["adaptive"], "metaschedule_time_ratio": None}}
    for meth in (*METHODS, "adaptive"):
        value = lat[meth] if meth != "adaptive" else lat_adaptive
        ratio = {"value": None, "lower_bound": False}
        if value is not None:
            st = seconds_to_match(curves, order, w, untuned, value / 1e3)
            t = st["oracle"]
            if meth != "adaptive":
                row["metaschedule_seconds_to_match"][meth] = st
            # not reached within the log: the whole log is a lower bound
            ratio = {"value": (t if t is not None else run["log_search_seconds"]) / search[meth],
                     "lower_bound": t is None}
        if meth == "adaptive":
            row["adaptive"]["metaschedule_time_ratio"] = ratio
        else:
            row["metaschedule_time_ratio"][meth] = ratio
    return row


def same_machine(run: dict) -> bool:
    """Whether MetaSchedule's search ran on this run's CPU, with its runtime threads."""
    prov = run.get("provenance") or {}
    cpus = [c for c in run.get("log_cpus") or [] if c]
    return bool(cpus) and set(cpus) == {prov.get("mcpu")} and run.get("log_threads") == prov.get("threads")


def geomean(vals) -> float | None:
    """The geometric mean of the positive values (None, zero and negatives left out); None if none."""
    vals = [v for v in vals if v is not None and v > 0]
    return float(np.exp(np.mean(np.log(vals)))) if vals else None


def build_table(nets: list[str]) -> dict:
    """The table from the cached runs: a row per network whose run is of version 2 on, the
    averages over them, the networks missing, and the product's rows (:func:`product_rows`)."""
    rows = {}
    for net in nets:
        p = runs_dir() / f"{net}.json"
        run = json.loads(p.read_text()) if p.exists() else {}
        # version 1 chose top-k among the sample only; a version-2 run still holds, with the
        # serial transfers and single-process compile of its day in its search seconds
        if run.get("version", 0) >= 2:
            rows[net] = row_of(run)
    avg = {}
    if rows:
        def mean(vals):
            vals = [v for v in vals if v is not None]
            return float(np.mean(vals)) if vals else None

        for meth in METHODS:
            avg[f"speedup_{meth}"] = mean([r["speedup"][meth] for r in rows.values()])
            # the second over the networks whose MetaSchedule reference is a long run on this
            # machine (elsewhere S_max is a short run's, and its seconds another CPU's)
            for suffix, keep in (("", lambda r: True), ("_reference", lambda r: r["metaschedule_reference"])):
                avg[f"pct_max_speedup_{meth}{suffix}"] = mean(
                    [r["pct_max_speedup"][meth] for r in rows.values() if keep(r)])
                ratios = [r["metaschedule_time_ratio"][meth] for r in rows.values() if keep(r)]
                avg[f"metaschedule_time_ratio_{meth}{suffix}"] = geomean(x["value"] for x in ratios)
                avg[f"metaschedule_time_ratio_{meth}{suffix}_is_lower_bound"] = any(x["lower_bound"] for x in ratios)
        # the adaptive policy, and the candidates each method measures per network
        for suffix, keep in (("", lambda r: True), ("_reference", lambda r: r["metaschedule_reference"])):
            ad = [r["adaptive"] for r in rows.values() if keep(r)]
            avg[f"pct_max_speedup_adaptive{suffix}"] = mean([a["pct_max_speedup"] for a in ad])
            avg[f"metaschedule_time_ratio_adaptive{suffix}"] = geomean(
                a["metaschedule_time_ratio"]["value"] for a in ad)
            avg[f"metaschedule_time_ratio_adaptive{suffix}_is_lower_bound"] = any(
                a["metaschedule_time_ratio"]["lower_bound"] for a in ad)
            for k in ("top1", "top3", "top5"):
                avg[f"candidates_{k}{suffix}"] = mean([r["candidates_measured"][k] for r in rows.values() if keep(r)])
            avg[f"candidates_adaptive{suffix}"] = mean([a["candidates_measured"] for a in ad])
        avg["speedup_adaptive"] = mean([r["adaptive"]["speedup"] for r in rows.values()])
        avg["ort_latency_ratio_top3"] = mean([r["ort_latency_ratio_top3"] for r in rows.values()])
        # the target for onnxruntime is on the CNNs: the transformers have their own row
        avg["ort_latency_ratio_top3_cnn"] = mean([r["ort_latency_ratio_top3"] for n, r in rows.items()
                                                  if n not in TRANSFORMERS])
        avg["speedup_metaschedule_max"] = mean([r["speedup"]["metaschedule_max"] for r in rows.values()])
        avg["networks"] = len(rows)
        avg["networks_reference"] = [n for n, r in rows.items() if r["metaschedule_reference"]]
    return {"networks": rows, "average": avg, "missing": [n for n in nets if n not in rows],
            "recommend": product_rows(nets)}


def product_rows(nets: list[str]) -> dict:
    """The product as a user runs it: `recommend --leave-one-out` on the whole model (from
    bench/results/recommend_zoo.json), beside the per-method kernel sums above."""
    path = results_dir() / "recommend_zoo.json"
    zoo = json.loads(path.read_text()) if path.exists() else {}
    out = {}
    for key in [k for net in nets for k in (net, f"{net} --exact-math")]:
        r, net = zoo.get(key), key
        if not r or "error" in r:
            continue
        lat, prov = r["model_latency_ms"], r.get("provenance") or {}
        out[net] = {"recommend_seconds": r["recommend_seconds"], "untuned_ms": lat.get("untuned"),
                    "ttrank_ms": lat.get("tuned"), "onnxruntime_ms": lat.get("onnxruntime"),
                    "speedup": r.get("speedup_vs_untuned"), "ort_ratio": r.get("latency_vs_onnxruntime"),
                    "kernels_tuned": f"{r['kernels_tuned']}/{r['kernels']}",
                    "threads": prov.get("threads", 1), "cpu": prov.get("mcpu"), "date": prov.get("date")}
    return out


def write_outputs(table: dict) -> str:
    """paper_table.json, .md and .png in bench/results; returns the Markdown."""
    table = {**table, "provenance": provenance(), "how": "python bench/paper_table.py [--measure]",
             "definitions": {
                 "latency_ms": "sum over kernels of weight x kernel latency, all measured in one run per network",
                 "pct_max_speedup": "(S - 1) / (S_max - 1), S_max from MetaSchedule's longest run",
                 "*_reference": "the average over networks_reference only: those whose MetaSchedule run is a "
                                "long one (>= 200 trials per task) searched on this run's CPU with its runtime "
                                "threads; elsewhere S_max comes from a 64-trial run and MetaSchedule's seconds "
                                "are another machine's",
                 "metaschedule_time_ratio": "MetaSchedule search seconds to reach the method's latency "
                                            "(best split of time among kernels) / the method's search "
                                            "seconds; geometric mean; a lower bound where the log never got there",
                 "ort_latency_ratio_top3": "whole model, ttrank top-3 / onnxruntime, timed in alternation",
                 "top_k": "the fastest of ttrank's ranks 1..k over the whole donor pool of the other "
                          "networks, all measured in the run",
                 "exhaustive": "the fastest of ttrank's top 5 and the collected sample (a lower bound on "
                               "measuring the whole pool); its search time is the whole pool's",
                 "paper": "the paired donor network's exact-class schedules, tiles as they are, the "
                          "fastest by the collector's measurements, re-measured in the run",
                 "adaptive": "recommend's default measuring policy (ttrank.ranking.AdaptiveK, bound 5): per "
                             "kernel, the fastest of the ranks the ranker cannot tell from its top-1, fewer "
                             "for kernels with a small share of the untuned model; from the same run"}}
    out = results_dir()
    atomic_write_json(out / "paper_table.json", table)
    L = ["# ttrank vs transfer-tuning (paper) vs MetaSchedule vs onnxruntime", "",
         "Leave-one-out per network; latencies are kernel sums measured side by side in one run "
         "(ms); whole-model ms for ttrank top-3, MetaSchedule and onnxruntime timed in alternation. "
         "top-k: the fastest of ttrank's ranks 1..k over the whole donor pool of the other networks; "
         "exhaustive: the fastest of the top 5 and the collected random sample (search time: the whole "
         "pool measured); paper: the paired donor's exact-class schedules, tiles as they are.", "",
         "CPU: where the run measured everything; MetaSchedule's schedules come from the search named "
         "after it (tuned on that CPU, re-measured on this one).", "",
         "| network | CPU (MS tuned on) | untuned | MS max (trials/task) | paper | top-1 | top-3 | top-5 | "
         "exhaustive | % max top-3 | % max paper | MS time ratio top-3 | whole top-3 / MS / ORT | top-3 / ORT |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if x is not None else "-"

    for net, r in table["networks"].items():
        lt, pm, wm = r["latency_ms"], r["pct_max_speedup"], r["whole_model_ms"]
        tr = r["metaschedule_time_ratio"]["top3"]
        L.append(f"| {net} | {r.get('cpu') or '?'} ({', '.join(c for c in r.get('metaschedule_cpus', []) if c) or '?'}) "
                 f"| {f(lt['untuned'], '{:.0f}')} | {f(lt['metaschedule_max'])} "
                 f"({r['metaschedule_trials_per_task']}) | {f(lt['paper'])} | {f(lt['top1'])} | "
                 f"{f(lt['top3'])} | {f(lt['top5'])} | {f(lt['exhaustive'])} | "
                 f"{f(100 * pm['top3'] if pm['top3'] is not None else None, '{:.0f}%')} | "
                 f"{f(100 * pm['paper'] if pm['paper'] is not None else None, '{:.0f}%')} | "
                 f"{'>' if tr['lower_bound'] else ''}{f(tr['value'], '{:.1f}x')} | "
                 f"{wm['ttrank_top3']:.1f} / {wm['metaschedule']:.1f} / {wm['onnxruntime']:.1f} | "
                 f"{r['ort_latency_ratio_top3']:.2f} |")
    a = table["average"]
    if a:
        L += ["", "| average over networks | paper | top-1 | top-3 | top-5 | exhaustive |",
              "|---|---|---|---|---|---|"]
        order = METHODS[4:] + METHODS[:4]  # paper first, as the header

        def pct(suffix: str) -> str:
            return " | ".join(f(100 * v if (v := a[f'pct_max_speedup_{m}{suffix}']) is not None else None, '{:.0f}%')
                              for m in order)

        def ratio(suffix: str) -> str:
            return " | ".join(('>' if a[f'metaschedule_time_ratio_{m}{suffix}_is_lower_bound']
                               and a[f'metaschedule_time_ratio_{m}{suffix}'] else '')
                              + f(a[f'metaschedule_time_ratio_{m}{suffix}'], '{:.1f}x') for m in order)

        L.append(f"| % of max speedup | {pct('')} |")
        L.append("| speedup over untuned | " + " | ".join(f(a[f'speedup_{m}'], '{:.1f}x') for m in order) + " |")
        L.append(f"| MetaSchedule time ratio (geomean) | {ratio('')} |")
        if ref := a.get("networks_reference"):
            L.append(f"| % of max speedup, long runs on this machine ({', '.join(ref)}) | {pct('_reference')} |")
            L.append(f"| MetaSchedule time ratio, long runs on this machine | {ratio('_reference')} |")
        L += ["", f"Adaptive measuring ({POLICY.to_json()}): per kernel, the ranks the ranker cannot tell "
                  "from its top-1, fewer for kernels with a small share of the model (same runs).", "",
              "| average over networks | candidates top-1 / top-3 / top-5 / adaptive | % of max speedup "
              "adaptive | MetaSchedule time ratio adaptive |", "|---|---|---|---|"]
        for suffix, label in (("", "all"), ("_reference", "long runs on this machine")):
            if suffix and not a.get("networks_reference"):
                continue
            cands = " / ".join(f(a.get(f"candidates_{m}{suffix}"), "{:.0f}") for m in ("top1", "top3", "top5", "adaptive"))
            v = a.get(f"pct_max_speedup_adaptive{suffix}")
            rt = a.get(f"metaschedule_time_ratio_adaptive{suffix}")
            L.append(f"| {label} | {cands} | {f(100 * v if v is not None else None, '{:.0f}%')} | "
                     f"{'>' if a.get(f'metaschedule_time_ratio_adaptive{suffix}_is_lower_bound') and rt else ''}"
                     f"{f(rt, '{:.1f}x')} |")
        L += ["", f"ttrank top-3 whole-model latency / onnxruntime, average: {a['ort_latency_ratio_top3']:.2f}"
                  + (f" (CNNs only: {a['ort_latency_ratio_top3_cnn']:.2f})"
                     if a.get("ort_latency_ratio_top3_cnn") is not None else "")]
    if table.get("recommend"):
        L += ["", "## The product as a user runs it", "",
              "`ttrank recommend zoo:NET --leave-one-out` on the whole model, with the shipped ranker and "
              "its default top-k (bench/recommend_zoo.py), as the run reported them. Threads: the TVM runtime's "
              "(rows with 1 predate one thread per core, and timed TVM and onnxruntime one after the other).", "",
              "| network | kernels tuned | untuned ms | ttrank ms | speedup | onnxruntime ms | ttrank / ORT | "
              "recommend s | threads | CPU, date |", "|---|---|---|---|---|---|---|---|---|---|"]
        for net, r in table["recommend"].items():
            L.append(f"| {net} | {r['kernels_tuned']} | {f(r['untuned_ms'], '{:.0f}')} | {f(r['ttrank_ms'], '{:.2f}')} | "
                     f"{f(r['speedup'], '{:.1f}x')} | {f(r['onnxruntime_ms'], '{:.2f}')} | "
                     f"{f(r['ort_ratio'], '{:.2f}')} | {f(r['recommend_seconds'], '{:.0f}')} | {r['threads']} | "
                     f"{r.get('cpu') or '?'}, {(r.get('date') or '?')[:10]} |")
    if table["missing"]:
        L += ["", "Not measured yet (its cross-measurements, its tuning log or its long MetaSchedule run is "
                  "missing): " + ", ".join(table["missing"])]
    atomic_write_text(out / "paper_table.md", "\n".join(L) + "\n")
    plot(table, out / "paper_table.png")
    return "\n".join(L)


def plot(table: dict, path: Path) -> None:
    """Per network, speedup over untuned against search seconds for each method."""
    import matplotlib  # a bench extra, not a dependency of the package

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    nets = list(table["networks"])
    if not nets:
        return
    cols = min(4, len(nets))
    rows = (len(nets) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, net in zip(axes.flat, nets):
        r = table["networks"][net]
        u = r["latency_ms"]["untuned"]
        ct = [(t, u / v) for t, v in r["curve"] if t > 0]
        if ct:
            ax.plot(*zip(*ct), label="MetaSchedule", color="C0")
        pts = [(r["search_seconds"][m], r["speedup"][m]) for m in ("top1", "top3", "top5", "exhaustive")
               if r["speedup"][m]]
        if pts:
            ax.plot(*zip(*pts), "o-", label="ttrank top-1/3/5/all", color="C1")
        if r["speedup"]["paper"]:
            ax.plot([r["search_seconds"]["paper"]], [r["speedup"]["paper"]], "s", label="paper", color="C2")
        ax.axhline(u / r["whole_model_ms"]["onnxruntime"] * r["latency_ms"]["top3"] / r["whole_model_ms"]["ttrank_top3"],
                   ls="--", color="gray", lw=0.8, label="onnxruntime (scaled)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # a narrow range crowds them
        ax.set_title(net, fontsize=9)
        ax.set_xlabel("search seconds", fontsize=8)
        ax.set_ylabel("speedup over untuned", fontsize=8)
    for ax in list(axes.flat)[len(nets):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

