"""The paper's experiment side by side: ttrank vs transfer-tuning (paper) vs MetaSchedule vs
onnxruntime, for each zoo network as the target, leave-one-out.

    python bench/paper_table.py [--measure [--budget-minutes M]] [--networks ...]

With ``--measure``, each network that has what it needs (its cross-measurement table and its
MetaSchedule tuning log) and no up-to-date run gets one *evaluation run*, cached in
bench/results/paper_runs/<net>.json. In that run, kernel by kernel and in one batch each, these
are measured side by side: the untuned kernel; every step of MetaSchedule's convergence curve
(the longest log: datasets/metaschedule_long/<net> if present, else the 64-trial donor run);
ttrank's choice at top-1, top-3 and top-5 (a ranker refitted without <net>, candidates
from the other networks, the fastest of the top-k by the collected latencies, as `recommend`
keeps the fastest it measured); ttrank exhaustive (the fastest candidate of the pool); and the
paper's choice (the one paired donor network, exact fused-op class, its tile sizes left as they
are, the fastest measured). Then the whole model is built with ttrank's top-3 schedules and
with MetaSchedule's, and timed in alternation with onnxruntime.

Without ``--measure``, the table is rebuilt from the cached runs: bench/results/paper_table.md,
paper_table.json (``average`` holds pct_max_speedup_top3, metaschedule_time_ratio_top3 and
ort_latency_ratio_top3; ``networks`` one row per network) and paper_table.png.

Latency per method is the sum over kernels of weight x kernel latency (all measured in the same
run); the whole-model numbers are reported beside it. Search time: MetaSchedule's from its log;
ttrank's and the paper's = candidates measured x the measured cost of one candidate in the
evaluation run (build + correctness check + timing), plus the untuned kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "paper_runs"
sys.path.insert(0, str(ROOT / "bench"))

from recommend_bench import metaschedule_dir as ms_dir  # noqa: E402
from tune_donors import ORDER  # noqa: E402

KS = (1, 3, 5)
TRANSFORMERS = ("bert", "mobilebert")
METHODS = ("top1", "top3", "top5", "exhaustive", "paper")


def inputs_hash(net: str) -> str:
    """Changes when the run's inputs grow (the measurement table or the MetaSchedule log), the
    runtime's thread count changes, or the shipped ranker's second stage changes."""
    from ttrank.ranker import Ranker
    from ttrank.target import runtime_threads

    stage2 = (Ranker.load().metadata.get("stage2") or {})
    h = hashlib.sha256(f"threads={runtime_threads()}".encode())
    if stage2.get("enabled"):
        h.update(json.dumps([stage2.get("weight"), stage2.get("shortlist")]).encode())
    for p in (ROOT / "datasets" / "measurements" / f"{net}.jsonl", (ms_dir(net) or Path("/nonexistent")) / "trials.jsonl"):
        h.update(str(p.stat().st_size if p.exists() else 0).encode())
    return h.hexdigest()[:12]


def choices(net: str, ds, store, params: dict, stage2: dict | None = None) -> dict[str, dict[str, dict]]:
    """workload -> method -> the chosen measured row (ttrank top-k with a ranker that never
    saw ``net``, and its second stage if the shipped ranker has one; exhaustive; the paper's
    pool)."""
    from ttrank.collect import measurement_key
    from ttrank.evaluate import _groups, _regroup
    from ttrank.ranker import Ranker
    from ttrank.util import read_jsonl

    train = [i for i, m in enumerate(ds.meta) if m["network"] != net and m.get("donor_network") != net]
    model = Ranker(**params).fit(ds.X[train], ds.y[train], _regroup(ds, train))
    rows = {measurement_key(r): r for r in read_jsonl(ROOT / "datasets" / "measurements" / f"{net}.jsonl")}
    out: dict[str, dict[str, dict]] = {}
    spans = [(a, b) for a, b in _groups(ds) if ds.meta[a]["network"] == net]
    all_scores = np.zeros(len(ds.y))
    for a, b in spans:
        all_scores[a:b] = model.predict(ds.X[a:b])
    if stage2 and stage2.get("enabled"):
        all_scores = second_stage_scores(net, ds, store, spans, all_scores, stage2)
    for a, b in spans:
        scores = all_scores[a:b]
        order = np.argsort(-scores, kind="stable")
        group = [ds.meta[a + i] for i in order]
        wh = group[0]["workload"]
        ok = [(i, m) for i, m in enumerate(group) if m["latency_s"]]
        pick = out.setdefault(wh, {})
        for k in KS:
            top = [m for i, m in ok if i < k]
            if top:
                pick[f"top{k}"] = {**min(top, key=lambda m: m["latency_s"]), "measured": min(k, len(group))}
        if ok:
            pick["exhaustive"] = {**min((m for _, m in ok), key=lambda m: m["latency_s"]),
                                  "measured": len(group)}
    paper: dict[str, list[dict]] = {}
    for r in rows.values():
        if r.get("pool") == "paper":
            paper.setdefault(r["workload"], []).append(r)
    for wh, rs in paper.items():
        ok = [r for r in rs if r["status"] == "ok" and r["latency_s"]]
        if ok:
            out.setdefault(wh, {})["paper"] = {**min(ok, key=lambda r: r["latency_s"]), "measured": len(rs)}
    return out


def second_stage_scores(net: str, ds, store, spans, scores: np.ndarray, stage2: dict) -> np.ndarray:
    """The shortlists of ``net``'s groups reordered by a cost model that never saw ``net``."""
    from ttrank.collect import Dataset
    from ttrank.programs import loo_cost_scores, rerank_spans
    from ttrank.target import make_target

    rows = [i for a, b in spans for i in range(a, b)]
    sub = Dataset(ds.X[rows], ds.y[rows], [b - a for a, b in spans], [ds.meta[i] for i in rows])
    cost = np.full(len(ds.y), np.nan)
    cost[rows] = loo_cost_scores(sub, store, make_target(), [Path(r.work_dir) for r in store.reports])
    return rerank_spans(spans, scores, cost, stage2["weight"], stage2["shortlist"])


def evaluation_run(net: str, ds, store, params: dict, stage2: dict | None = None) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from ttrank.convergence import read_log, remeasure, remeasured_curves  # noqa: F401
    from ttrank.donors import open_database
    from ttrank.engine import time_side_by_side, write_database
    from ttrank.frontend import load
    from ttrank.kernels import extract
    from ttrank.measure import Measurer
    from ttrank.target import make_target, provenance
    from ttrank.transfer import transfer
    from ttrank.zoo import export

    import tempfile

    target = make_target()
    picks = choices(net, ds, store, params, stage2)
    rec_of = {r.id: (w, r) for w in store.workloads for r in w.records}
    log = read_log(ms_dir(net))
    with tempfile.TemporaryDirectory() as tmp:
        model = load(export(net, Path(tmp) / f"{net}.onnx"))
        kernels = {k.workload_hash: k for k in extract(model.mod, target)}
        others: dict[str, dict] = {m: {} for m in METHODS}
        traced: dict[str, dict] = {m: {} for m in METHODS}
        for wh, pick in picks.items():
            k = kernels.get(wh)
            for method, row in pick.items():
                if k is None or not row.get("latency_s") or row.get("record") not in rec_of:
                    continue
                w, r = rec_of[row["record"]]
                c = transfer(r, k, w, target, adapt=row.get("adapt") or "ttrank")
                if c.ok:
                    others[method][wh] = c.mod
                    traced[method][k.name] = c
        measurer = Measurer(target)
        t0 = time.time()
        try:
            sbs = remeasure(log, others, measurer,
                            on_progress=lambda i, n, name: print(f"  {net}: {i}/{n} {name}", flush=True))
        finally:
            measurer.close()
        wall = time.time() - t0
        n_measured = sum(len(v) for v in others.values()) + sum(len(s) for s in log.steps.values())
        n_measured += len(log.kernels)
        # whole model: ttrank top-3 and MetaSchedule's final database, with onnxruntime
        kl = list(kernels.values())
        db3 = write_database(Path(tmp) / "top3", kl, traced["top3"], target)
        t1 = time.time()
        whole = time_side_by_side(model, target, {"ttrank_top3": db3,
                                                   "metaschedule": open_database(log.work_dir)})
        compile_s = (time.time() - t1) / 2
    return {"network": net, "inputs": inputs_hash(net), "log": str(log.work_dir.relative_to(ROOT)),
            "log_trials": log.manifest.get("trials_done"), "log_trials_per_task": log.manifest.get("trials_per_task"),
            "log_search_seconds": log.manifest.get("search_seconds"),
            "weights": log.weights, "steps_seconds": {n: [s.seconds for s in st] for n, st in log.steps.items()},
            "global_seconds": {n: [s.global_s for s in st] for n, st in log.steps.items()},
            "measured": sbs.to_json(), "whole_model_ms": whole,
            "seconds_per_candidate": wall / max(1, n_measured), "compile_seconds": compile_s,
            "candidates_measured": {m: sum(p.get(m, {}).get("measured", 0) for p in picks.values())
                                    for m in METHODS},
            "kernels_with_candidates": sum(1 for p in picks.values() if p),
            "name_of": {wh: k.name for wh, k in kernels.items()},
            "chosen": {m: {k: {"donor_network": c.donor.network, "donor_kernel": c.donor.kernel.name,
                               "record": c.record.id} for k, c in traced[m].items()} for m in METHODS},
            "provenance": provenance(target)}


# --------------------------------------------------------------------------------------------
# the table


def row_of(run: dict) -> dict:
    from ttrank.convergence import TaskCurve, model_curve, seconds_to_match

    w = run["weights"]
    m = json.loads(json.dumps(run["measured"]))
    untuned = {n: m["untuned"].get(n) or 0.0 for n in w}
    # methods that chose the same schedule for a kernel measured it more than once: min of those
    for n in w:
        by_rec: dict[str, list[str]] = {}
        for meth in METHODS:
            rec = run["chosen"].get(meth, {}).get(n, {}).get("record")
            if rec and m["others"].get(meth, {}).get(n) is not None:
                by_rec.setdefault(f"{rec}@{meth == 'paper'}", []).append(meth)
        for meths in by_rec.values():
            best = min(m["others"][x][n] for x in meths)
            for x in meths:
                m["others"][x][n] = best
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
    search = {meth: (run["candidates_measured"][meth] + n_kernels) * per_cand + run["compile_seconds"]
              for meth in METHODS}
    row = {"latency_ms": lat, "speedup": {k: u / v if v else None for k, v in lat.items()},
           "pct_max_speedup": {meth: (u / lat[meth] - 1) / (s_max - 1) if s_max > 1 and lat[meth] else None
                               for meth in METHODS},
           "search_seconds": search, "metaschedule_search_seconds": run["log_search_seconds"],
           "metaschedule_trials": run["log_trials"], "metaschedule_trials_per_task": run["log_trials_per_task"],
           "metaschedule_seconds_to_match": {}, "metaschedule_time_ratio": {},
           "whole_model_ms": run["whole_model_ms"],
           "ort_latency_ratio_top3": run["whole_model_ms"]["ttrank_top3"] / run["whole_model_ms"]["onnxruntime"],
           "curve": [(t, 1e3 * v) for t, v in model_curve(curves, order, w, untuned)]}
    for meth in METHODS:
        if lat[meth] is None:
            row["metaschedule_time_ratio"][meth] = {"value": None, "lower_bound": False}
            continue
        st = seconds_to_match(curves, order, w, untuned, lat[meth] / 1e3)
        t = st["oracle"]
        row["metaschedule_seconds_to_match"][meth] = st
        # not reached within the log: the whole log is a lower bound
        row["metaschedule_time_ratio"][meth] = {"value": (t if t is not None else run["log_search_seconds"]) / search[meth],
                                               "lower_bound": t is None}
    return row


def build_table(nets: list[str]) -> dict:
    rows = {}
    for net in nets:
        p = RUNS / f"{net}.json"
        if p.exists():
            rows[net] = row_of(json.loads(p.read_text()))
    avg = {}
    if rows:
        def mean(vals):
            vals = [v for v in vals if v is not None]
            return float(np.mean(vals)) if vals else None

        for meth in METHODS:
            avg[f"pct_max_speedup_{meth}"] = mean([r["pct_max_speedup"][meth] for r in rows.values()])
            avg[f"speedup_{meth}"] = mean([r["speedup"][meth] for r in rows.values()])
            ratios = [v for r in rows.values()
                      if (v := r["metaschedule_time_ratio"][meth]["value"]) is not None and v > 0]
            avg[f"metaschedule_time_ratio_{meth}"] = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
            avg[f"metaschedule_time_ratio_{meth}_is_lower_bound"] = any(
                r["metaschedule_time_ratio"][meth]["lower_bound"] for r in rows.values())
        avg["ort_latency_ratio_top3"] = mean([r["ort_latency_ratio_top3"] for r in rows.values()])
        # the target for onnxruntime is on the CNNs: the transformers have their own row
        avg["ort_latency_ratio_top3_cnn"] = mean([r["ort_latency_ratio_top3"] for n, r in rows.items()
                                                  if n not in TRANSFORMERS])
        avg["speedup_metaschedule_max"] = mean([r["speedup"]["metaschedule_max"] for r in rows.values()])
        avg["networks"] = len(rows)
    return {"networks": rows, "average": avg, "missing": [n for n in nets if n not in rows],
            "recommend": product_rows(nets)}


def product_rows(nets: list[str]) -> dict:
    """The product as a user runs it: `recommend --leave-one-out` on the whole model (from
    bench/results/recommend_zoo.json), beside the per-method kernel sums above."""
    path = RESULTS / "recommend_zoo.json"
    zoo = json.loads(path.read_text()) if path.exists() else {}
    out = {}
    for key in [k for net in nets for k in (net, f"{net} --fast-math")]:
        r, net = zoo.get(key), key
        if not r or "error" in r:
            continue
        lat = r["model_latency_ms"]
        out[net] = {"recommend_seconds": r["recommend_seconds"], "untuned_ms": lat.get("untuned"),
                    "ttrank_ms": lat.get("tuned"), "onnxruntime_ms": lat.get("onnxruntime"),
                    "speedup": r.get("speedup_vs_untuned"), "ort_ratio": r.get("latency_vs_onnxruntime"),
                    "kernels_tuned": f"{r['kernels_tuned']}/{r['kernels']}",
                    "threads": (r.get("provenance") or {}).get("threads", 1)}
    return out


def write_outputs(table: dict) -> None:
    from ttrank.target import provenance
    from ttrank.util import atomic_write_json, atomic_write_text

    table = {**table, "provenance": provenance(), "how": "python bench/paper_table.py [--measure]",
             "definitions": {
                 "latency_ms": "sum over kernels of weight x kernel latency, all measured in one run per network",
                 "pct_max_speedup": "(S - 1) / (S_max - 1), S_max from MetaSchedule's longest run",
                 "metaschedule_time_ratio": "MetaSchedule search seconds to reach the method's latency "
                                            "(best split of time among kernels) / the method's search "
                                            "seconds; geometric mean; a lower bound where the log never got there",
                 "ort_latency_ratio_top3": "whole model, ttrank top-3 / onnxruntime, timed in alternation"}}
    atomic_write_json(RESULTS / "paper_table.json", table)
    L = ["# ttrank vs transfer-tuning (paper) vs MetaSchedule vs onnxruntime", "",
         "Leave-one-out per network; latencies are kernel sums measured side by side in one run "
         "(ms); whole-model ms for ttrank top-3, MetaSchedule and onnxruntime timed in alternation.", "",
         "| network | untuned | MS max (trials/task) | paper | top-1 | top-3 | top-5 | exhaustive | "
         "% max top-3 | % max paper | MS time ratio top-3 | whole top-3 / MS / ORT | top-3 / ORT |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if x is not None else "-"

    for net, r in table["networks"].items():
        lt, pm, wm = r["latency_ms"], r["pct_max_speedup"], r["whole_model_ms"]
        tr = r["metaschedule_time_ratio"]["top3"]
        L.append(f"| {net} | {f(lt['untuned'], '{:.0f}')} | {f(lt['metaschedule_max'])} "
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
        L.append("| % of max speedup | " + " | ".join(
            f(100 * a[f'pct_max_speedup_{m}'] if a[f'pct_max_speedup_{m}'] is not None else None, '{:.0f}%')
            for m in METHODS[4:] + METHODS[:4]) + " |")
        L.append("| speedup over untuned | " + " | ".join(
            f(a[f'speedup_{m}'], '{:.1f}x') for m in METHODS[4:] + METHODS[:4]) + " |")
        L.append("| MetaSchedule time ratio (geomean) | " + " | ".join(
            ('>' if a[f'metaschedule_time_ratio_{m}_is_lower_bound'] and a[f'metaschedule_time_ratio_{m}'] else '') +
            f(a[f'metaschedule_time_ratio_{m}'], '{:.1f}x') for m in METHODS[4:] + METHODS[:4]) + " |")
        L += ["", f"ttrank top-3 whole-model latency / onnxruntime, average: {a['ort_latency_ratio_top3']:.2f}"
                  + (f" (CNNs only: {a['ort_latency_ratio_top3_cnn']:.2f})"
                     if a.get("ort_latency_ratio_top3_cnn") is not None else "")]
    if table.get("recommend"):
        L += ["", "## The product as a user runs it", "",
              "`ttrank recommend zoo:NET --leave-one-out` on the whole model, with the shipped ranker and "
              "its default top-k (bench/recommend_zoo.py), as the run reported them. Threads: the TVM runtime's "
              "(rows with 1 predate one thread per core, and timed TVM and onnxruntime one after the other).", "",
              "| network | kernels tuned | untuned ms | ttrank ms | speedup | onnxruntime ms | ttrank / ORT | "
              "recommend s | threads |", "|---|---|---|---|---|---|---|---|---|"]
        for net, r in table["recommend"].items():
            L.append(f"| {net} | {r['kernels_tuned']} | {f(r['untuned_ms'], '{:.0f}')} | {f(r['ttrank_ms'], '{:.2f}')} | "
                     f"{f(r['speedup'], '{:.1f}x')} | {f(r['onnxruntime_ms'], '{:.2f}')} | "
                     f"{f(r['ort_ratio'], '{:.2f}')} | {f(r['recommend_seconds'], '{:.0f}')} | {r['threads']} |")
    if table["missing"]:
        L += ["", "Not measured yet (no cross-measurement table or tuning log): " + ", ".join(table["missing"])]
    atomic_write_text(RESULTS / "paper_table.md", "\n".join(L) + "\n")
    plot(table, RESULTS / "paper_table.png")
    print("\n".join(L))


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.set_title(net, fontsize=9)
        ax.set_xlabel("search seconds", fontsize=8)
        ax.set_ylabel("speedup over untuned", fontsize=8)
    for ax in list(axes.flat)[len(nets):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", help="run the missing evaluation runs")
    ap.add_argument("--budget-minutes", type=float, default=None)
    ap.add_argument("--networks", nargs="+", default=ORDER)
    args = ap.parse_args()
    if args.measure:
        from ttrank.collect import build_dataset
        from ttrank.donors import DATASET_DONORS, DonorStore
        from ttrank.ranker import Ranker
        from ttrank.training import DATASET_MEASUREMENTS
        from ttrank.util import atomic_write_json

        deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
        store = DonorStore.load(sorted(p for p in DATASET_DONORS.iterdir() if p.is_dir()))
        ds = build_dataset([DATASET_MEASUREMENTS], store)
        shipped = Ranker.load()
        params, stage2 = shipped.get_params(), shipped.metadata.get("stage2")
        for net in args.networks:
            p = RUNS / f"{net}.json"
            if p.exists() and json.loads(p.read_text()).get("inputs") == inputs_hash(net):
                continue
            if not (DATASET_MEASUREMENTS / f"{net}.jsonl").exists() or ms_dir(net) is None \
                    or net not in ds.networks:
                print(f"{net}: skipped (needs its cross-measurements and its tuning log)")
                continue
            if deadline and time.time() > deadline - 600:
                print("budget spent")
                break
            print(f"{net}: evaluation run", flush=True)
            atomic_write_json(p, evaluation_run(net, ds, store, params, stage2))
    write_outputs(build_table(args.networks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
