"""Leave-one-network-out evaluation of the ranker against baselines, on the committed data.

    python bench/ranker_eval.py [--trees 300] [--out DIR]
    python bench/ranker_eval.py --cpus-only [--programs]   # per CPU and leave one CPU out alone

Writes bench/results/ranker_eval.json (raw numbers; `average` holds top1/top3/top5/ndcg5 for
ttrank, `baselines` the same keys per baseline), ranker_eval.md (table) and ranker_eval.png.
When network T is the target, T's own schedules are never candidates (the collector excludes
them) and none of T's rows, nor rows whose donor is T, train the model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

KEYS = ("top1", "top3", "top5", "ndcg5", "within5")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=300)
    ap.add_argument("--no-programs", action="store_true",
                    help="skip the second stage (program cost model): no transfers, much faster")
    ap.add_argument("--objective", default=None,
                    help="default: every objective, the best by leave-one-out (mean of top-1 and top-3)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the report goes (default: bench/results; a scratch dir for a look at "
                         "partial data)")
    ap.add_argument("--programs", action="store_true",
                    help="with --cpus-only: also the second stage's blends per CPU (the program "
                         "features of every candidate: half an hour on 2 cores the first time)")
    ap.add_argument("--cpus-only", action="store_true",
                    help="only the CPU evaluation (each CPU's leave-one-network-out and leave one "
                         "CPU out) of the shipped ranker's settings with and without the CPU "
                         "features, into ranker_cpus.json/.md")
    args = ap.parse_args()
    if args.cpus_only:
        cpus_only(args)
        return

    from ttrank.collect import build_dataset
    from ttrank.donors import DonorStore, shipped_work_dirs
    from ttrank.locations import shipped_measurements
    from ttrank.evaluate import KS, group_spans, baseline_scores, choose_top_k, evaluate
    from ttrank.ranker import OBJECTIVES
    from ttrank.target import provenance
    from ttrank.training import candidate_configs, config_label, data_hash, select_config
    from ttrank.bench import results_dir
    from ttrank.util import atomic_write_json, atomic_write_text

    args.out = args.out or results_dir()

    store = DonorStore.load(shipped_work_dirs())
    ds = build_dataset([shipped_measurements(required=True)], store)
    objectives = (args.objective,) if args.objective else OBJECTIVES
    cfg, runs = select_config(ds, candidate_configs(objectives), args.trees)
    best = config_label(cfg)
    res = runs[best]
    nets = sorted(res["networks"])
    spans = {net: [a for a, _ in group_spans(ds) if ds.meta[a]["network"] == net] for net in nets}

    def per_net_all(scores) -> dict:
        """networks and average over every metric key (the top-k curve too)"""
        out = {net: evaluate(ds, scores, spans[net]) for net in nets}
        vals = [v for v in out.values() if v]
        return {"networks": out, "average": {k: float(np.mean([v[k] for v in vals])) for k in vals[0]}}

    def per_net(scores):
        out = {net: evaluate(ds, scores, spans[net]) for net in nets}
        return out, {k: float(np.mean([out[n][k] for n in nets if out[n]])) for k in KEYS} if nets else {}

    # the second stage: the cost model pre-trained on the donors' tuning logs, blended on the
    # ranker's shortlist (ttrank.programs); "ttrank" below is what recommend runs
    stage2 = None
    if not args.no_programs:
        from ttrank.programs import loo_cost_scores, rerank_spans
        from ttrank.target import make_target
        from ttrank.training import choose_stage2

        target = make_target(None)
        cost = loo_cost_scores(ds, store, target, [Path(r.work_dir) for r in store.reports])
        stage2 = choose_stage2(ds, res["scores"], cost)
        alone = per_net_all(res["scores"])
        if stage2["enabled"]:
            scores = rerank_spans(group_spans(ds), res["scores"], cost, stage2["weight"], stage2["shortlist"])
            res = {**per_net_all(scores), "scores": scores}

    baselines, baseline_nets = {}, {}
    if stage2 is not None:
        baselines["ranker alone"] = {k: alone["average"][k] for k in KEYS}
        baseline_nets["ranker alone"] = alone["networks"]
        c = np.where(np.isnan(cost), -np.inf, cost)
        baseline_nets["cost model alone"], baselines["cost model alone"] = per_net(c)
    rnd = [per_net(baseline_scores(ds, "random", seed=s))[1] for s in range(5)]
    baselines["random"] = {k: float(np.mean([r[k] for r in rnd])) for k in KEYS}
    baseline_nets["nearest_shape"], baselines["nearest_shape"] = per_net(baseline_scores(ds, "nearest_shape"))
    # the paper: one hand-picked donor network, its exact-class schedules with tiles as they are,
    # all measured (the collector's "paper" rows); the score uses the same best-of-pool as ttrank's
    paper_best = paper_latencies(shipped_measurements(required=True))
    pn: dict[str, dict | None] = {}
    for net in nets:
        if not any(n == net for n, _ in paper_best):
            pn[net] = None  # the paired donor is not tuned (yet): no paper rows at all
            continue
        ok = []
        for a, b in group_spans(ds):
            if a not in spans[net]:
                continue
            lat = [ds.meta[i]["latency_s"] if ds.y[i] > 0 else None for i in range(a, b)]
            best_all = min((x for x in lat if x), default=None)
            # no exact-class candidate from the paired donor: the paper leaves the kernel untuned
            sub = paper_best.get((net, ds.meta[a]["workload"])) or ds.meta[a].get("untuned_s")
            if best_all:
                ok.append((ds.meta[a]["weight"] * best_all, best_all / sub if sub else 0.0))
        w = sum(x for x, _ in ok)
        allm = sum(x * v for x, v in ok) / w if w else 0.0
        pn[net] = {k: allm for k in KEYS}
    baseline_nets["paper"] = pn
    have = [n for n in nets if pn[n]]
    baselines["paper"] = {k: float(np.mean([pn[n][k] for n in have])) for k in KEYS} if have else {}
    baselines["exhaustive"] = {k: 1.0 for k in KEYS}

    # the ranker for many CPUs: each CPU's own leave-one-network-out, and leave one CPU out
    from ttrank.evaluate import by_cpu, leave_one_cpu_out, per_cpu
    from ttrank.ranker import Ranker

    def make():
        return Ranker(n_estimators=args.trees, **cfg)

    held = {net: [i for i, m in enumerate(ds.meta) if m["network"] == net] for net in nets}
    cpus = {"per_cpu": per_cpu(ds, make), "per_cpu_pooled": per_cpu(ds, make, pooled=True),
            "leave_one_cpu_out": leave_one_cpu_out(ds, make),
            # what recommend picks: the ranker (pooled, seed 0) and the second stage if enabled
            "per_cpu_ttrank": by_cpu(ds, res["scores"], held)}

    curve = {f"top{k}": res["average"].get(f"top{k}") for k in KS}
    out = {"ranker": best, "configs": {o: {k: r["average"].get(k) for k in KEYS}
                                       for o, r in runs.items()},
           "config_note": "each config's leave-one-out scores are the mean over 3 seeds",
           "top_k_curve": curve, "chosen_top_k": choose_top_k(res["average"], max_k=5),
           "training_data_hash": data_hash(ds),  # bench/background.py: is this report current?
           "rows": int(len(ds.y)), "kernel_groups": len(ds.groups), "networks": res["networks"],
           "average": {k: res["average"][k] for k in KEYS if k in res["average"]}, "baselines": baselines,
           "baseline_networks": baseline_nets, "cpus": cpus,
           "stage2": ({k: v for k, v in stage2.items() if k != "table"} | {
               "table": {k: v["average"] for k, v in stage2["table"].items()}}) if stage2 else None,
           "note": "top-k score (TenSet): best latency among all measured candidates / best among "
                   "the top-k, weighted by kernel weight x best latency; paper = one hand-picked "
                   "donor network, all its candidates measured",
           "provenance": provenance()}
    res_dir = args.out
    res_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(res_dir / "ranker_eval.json", out)
    how = (f"ranker {best}, then the program cost model blended on its top {stage2['shortlist']} "
           f"(weight {stage2['weight']})" if stage2 and stage2["enabled"] else f"ranker {best}")
    lines = [f"# Ranker evaluation (leave-one-network-out, {how})", "",
             f"{out['rows']} measured candidates in {out['kernel_groups']} kernel groups, "
             f"{len(nets)} target networks.", "",
             "| network | top-1 | top-3 | top-5 | NDCG@5 | top-1 within 5% | paper | nearest-shape top-3 |",
             "|---|---|---|---|---|---|---|---|"]
    for net in nets:
        m = res["networks"][net]
        lines.append(f"| {net} | {m['top1']:.3f} | {m['top3']:.3f} | {m['top5']:.3f} | "
                     f"{m['ndcg5']:.3f} | {m['within5']:.2f} | {_fmt(pn[net] and pn[net]['top1'])} | "
                     f"{baseline_nets['nearest_shape'][net]['top3']:.3f} |")
    a = res["average"]
    if a:
        lines.append(f"| **average** | {a['top1']:.3f} | {a['top3']:.3f} | {a['top5']:.3f} | "
                     f"{a['ndcg5']:.3f} | {a['within5']:.2f} | {_fmt(baselines['paper'].get('top1'))} | "
                     f"{baselines['nearest_shape']['top3']:.3f} |")
    lines += ["", "Per CPU (leave one network out scored on that CPU's rows. The ranker alone: trained on its "
              "rows alone, or pooled over every CPU's rows of the other networks; leave one CPU out trains on "
              "the other CPUs' rows. ttrank: what recommend picks, the pooled ranker then the second stage):", "",
              "| CPU | rows | own top-1 | own top-3 | pooled top-1 | pooled top-3 | leave-one-CPU-out top-1 | top-3 "
              "| ttrank top-1 | ttrank top-3 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lo = cpus["leave_one_cpu_out"]
    for c, r in cpus["per_cpu"].items():
        m, p, o = r["average"], cpus["per_cpu_pooled"][c]["average"], lo["cpus"].get(c) or {}
        t = cpus["per_cpu_ttrank"][c]["average"]
        lines.append(f"| {c} | {r['rows']} | {_fmt(m.get('top1'))} | {_fmt(m.get('top3'))} | "
                     f"{_fmt(p.get('top1'))} | {_fmt(p.get('top3'))} | {_fmt(o.get('top1'))} | {_fmt(o.get('top3'))} | "
                     f"{_fmt(t.get('top1'))} | {_fmt(t.get('top3'))} |")
    if not lo["cpus"]:
        lines += ["", f"Leave one CPU out needs rows from two CPUs or more; the data has {', '.join(lo['have'])}."]
    lines += ["", "| method | top-1 | top-3 | top-5 | NDCG@5 |", "|---|---|---|---|---|"]
    for name, m in [("ttrank", a)] + list(baselines.items()):
        if m:
            lines.append(f"| {name} | {m['top1']:.3f} | {m['top3']:.3f} | {m['top5']:.3f} | {m['ndcg5']:.3f} |")
    lines += ["", "paper: the paired donor network's exact-class candidates, tiles as they are, all measured; "
              "a kernel with none stays untuned. Averaged over the networks whose paired donor is tuned "
              f"({', '.join(have) or 'none yet'}); — where it is not. Scores are against the best of the "
              "kernel's collected random sample (at most 24 candidates), which the paper's own pool (all "
              "exact-class schedules of one network, often 40-50) can beat: a paper score above 1. "
              "bench/paper_table.py compares the two on the whole pool, with ttrank's top-k measured.",
              "", "Ranker settings compared (leave-one-out, mean over 3 seeds; chosen by mean of top-1 and top-3): " +
              "; ".join(f"{o}: top-1 {r['average']['top1']:.3f}, top-3 {r['average']['top3']:.3f}"
                        for o, r in runs.items() if r["average"]),
              "", _stage2_text(stage2),
              "", "Top-k score against k (how many candidates `recommend` measures per kernel): " +
              ", ".join(f"k={k}: {v:.3f}" for k, v in ((k, curve[f'top{k}']) for k in KS) if v is not None),
              f"Default k: {out['chosen_top_k']} (the smallest k reaching 0.97, else the point where one more "
              f"candidate adds under 0.005, at most 5 so that `recommend` stays near its 3-minute budget); "
              f"`python train.py` stores it with the model."]
    atomic_write_text(res_dir / "ranker_eval.md", "\n".join(lines) + "\n")
    _plot(res_dir / "ranker_eval.png", a, baselines)
    print("\n".join(lines))


def cpus_only(args) -> None:
    """How the ranker does per CPU and on a CPU it never saw, with and without the ``c_`` group."""
    from ttrank.bench import results_dir
    from ttrank.collect import build_dataset
    from ttrank.donors import DonorStore, shipped_work_dirs
    from ttrank.evaluate import by_cpu, group_spans, leave_one_cpu_out, leave_one_network_out, per_cpu, \
        repeat_agreement
    from ttrank.locations import shipped_measurements
    from ttrank.ranker import OWN_MIN_ROWS, OWN_WEIGHT, Ranker, own_feature_groups
    from ttrank.target import provenance
    from ttrank.training import evaluate_own
    from ttrank.util import atomic_write_json, atomic_write_text

    store = DonorStore.load(shipped_work_dirs())
    ds = build_dataset([shipped_measurements(required=True)], store)
    base = {k: v for k, v in Ranker.load().get_params().items() if k not in ("n_estimators", "feature_groups")}
    groups = own_feature_groups(Ranker.load().feature_groups)
    out: dict = {"rows": int(len(ds.y)), "kernel_groups": len(ds.groups), "settings": base,
                 "configs": {}, "provenance": provenance()}
    lines = ["# The ranker per CPU and on a CPU it never saw", "",
             f"{out['rows']} measured candidates in {out['kernel_groups']} kernel groups. Written by "
             f"`python bench/ranker_eval.py --cpus-only{' --programs' if args.programs else ''}` (the shipped "
             "ranker's settings, "
             f"{args.trees} trees). Leave one network out, scored on each CPU's rows: trained on that CPU's "
             "rows alone (own), or on every CPU's rows of the other networks (pooled: how the shipped "
             "ranker is trained). Leave one CPU out: trained on the other CPUs' rows.", "",
             "| features | CPU | rows | own top-1 | own top-3 | pooled top-1 | pooled top-3 | "
             "leave-one-CPU-out top-1 | top-3 |",
             "|---|---|---|---|---|---|---|---|---|"]
    pooled: dict = {}
    for fg in (groups, (*groups, "c")):
        label = "+".join(fg)

        def make(fg=fg):
            return Ranker(n_estimators=args.trees, feature_groups=fg, **base)

        pooled = leave_one_network_out(ds, make)  # the last one's: the shipped feature groups
        res = {"per_cpu": per_cpu(ds, make), "per_cpu_pooled": by_cpu(ds, pooled["scores"], pooled["held"]),
               "leave_one_cpu_out": leave_one_cpu_out(ds, make)}
        out["configs"][label] = res
        lo = res["leave_one_cpu_out"]
        for c, r in res["per_cpu"].items():
            m, p, o = r["average"], res["per_cpu_pooled"][c]["average"], lo["cpus"].get(c) or {}
            lines.append(f"| {label} | {c} | {r['rows']} | {_fmt(m.get('top1'))} | {_fmt(m.get('top3'))} | "
                         f"{_fmt(p.get('top1'))} | {_fmt(p.get('top3'))} | "
                         f"{_fmt(o.get('top1'))} | {_fmt(o.get('top3'))} |")
    # what recommend ranks with: the pooled ranker, each CPU's own and family's blended in where
    # it has them (as python train.py evaluates and chooses it)
    _, own = evaluate_own(ds, pooled["scores"], {**base, "feature_groups": (*groups, "c")}, args.trees,
                          OWN_MIN_ROWS, OWN_WEIGHT)
    out["own_blend"] = own
    lines += ["", f"**What `recommend` ranks with.** The pooled ranker (the shipped features); on a CPU with "
              f"at least {OWN_MIN_ROWS} rows its own ranker (trained on its rows of the other networks), and "
              "on a CPU whose leave-one-network-out its family's ranker improves that too, blended in at weight "
              f"{OWN_WEIGHT}. Own rankers: {', '.join(own['cpus']) or 'none'}; family rankers for: "
              f"{', '.join(own['family_for']) or 'none'}.", "",
              "| CPU | pooled top-1 / top-3 | with its own | with its own and its family's | shipped |",
              "|---|---|---|---|---|"]
    for c, a in own["per_cpu"].items():
        lines.append(f"| {c} | {_fmt(a['top1_pooled'])} / {_fmt(a['top3_pooled'])} | "
                     f"{_fmt(a['top1_no_family'])} / {_fmt(a['top3_no_family'])} | "
                     f"{_fmt(a['top1_family'])} / {_fmt(a['top3_family'])} | {_fmt(a['top1'])} / {_fmt(a['top3'])} |")
    if args.programs:
        # what the second stage would make of the pooled ranker's order, per CPU: recommend picks
        # by the ranker alone where the evaluation leaves the donors' shortlist as it is
        from ttrank.programs import loo_cost_scores, rerank_spans
        from ttrank.target import make_target
        from ttrank.training import STAGE2_SHORTLISTS, STAGE2_WEIGHTS

        cost = loo_cost_scores(ds, store, make_target(None), [Path(r.work_dir) for r in store.reports])
        blends = {"ranker alone": pooled["scores"]}
        blends.update({f"weight {w}, top {n}": rerank_spans(group_spans(ds), pooled["scores"], cost, w, n)
                       for n in STAGE2_SHORTLISTS for w in STAGE2_WEIGHTS})
        out["stage2_per_cpu"] = {name: {c: v["average"] for c, v in by_cpu(ds, sc, pooled["held"]).items()}
                                 for name, sc in blends.items()}
        cpus = list(out["stage2_per_cpu"]["ranker alone"])
        lines += ["", "**The second stage per CPU.** The pooled ranker's order (the shipped features), each "
                  "kernel's top n reordered by the blend of its score and the program cost model's (weight on "
                  "the ranker's z-score; the cost model never saw the held-out network's tuning logs). "
                  "top-1 / top-3:", "", "| order | " + " | ".join(cpus) + " |", "|---|" + "---|" * len(cpus)]
        for name, per in out["stage2_per_cpu"].items():
            lines.append(f"| {name} | " + " | ".join(f"{_fmt(per[c].get('top1'))} / {_fmt(per[c].get('top3'))}"
                                                    for c in cpus) + " |")
    out["repeat_agreement"] = repeat = repeat_agreement(ds)
    lines += ["", "**How well the labels repeat.** A ranker learns from one measurement of each candidate and is "
              "scored on that measurement. Where two networks share a workload, a CPU's table measured the "
              "same candidates twice (two kernel groups): the same candidate's two latencies apart (median "
              "|log ratio|), and the top-1 and top-3 of ordering the candidates by one measurement and scoring "
              "them on the other (`evaluate.repeat_agreement`), what knowing the first measurement exactly "
              "would reach.", "",
              "| CPU | pairs of groups | candidates per pair | median abs log ratio | top-1 | top-3 |",
              "|---|---|---|---|---|---|"]
    for c, r in repeat.items():
        lines.append(f"| {c} | {r['pairs']} | {r['candidates_per_pair']:.1f} | {r['median_abs_log_ratio']:.3f} | "
                     f"{_fmt(r['top1'])} | {_fmt(r['top3'])} |")
    res_dir = args.out or results_dir()
    res_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(res_dir / "ranker_cpus.json", out)
    atomic_write_text(res_dir / "ranker_cpus.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _stage2_text(stage2: dict | None) -> str:
    if not stage2:
        return "Second stage (program cost model): not evaluated (--no-programs)."
    t = stage2["table"]
    head = (f"Second stage (a cost model pre-trained on the donors' tuning logs, blended on the ranker's "
            f"shortlist; leave-one-out, seed 0): {'kept' if stage2['enabled'] else 'left out'}, "
            f"gain {stage2['gain']:+.3f} in the mean of top-1 and top-3. ")
    return head + "; ".join(f"{k}: top-1 {v['average']['top1']:.3f}, top-3 {v['average']['top3']:.3f}"
                            for k, v in t.items() if v["average"])


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def paper_latencies(table_dir: Path) -> dict[tuple[str, str], float]:
    """(network, workload) -> the fastest of the paper's candidates (collector rows pool=paper)."""
    from ttrank.util import read_jsonl

    out: dict[tuple[str, str], float] = {}
    for table in sorted(Path(table_dir).glob("*.jsonl")):
        for r in read_jsonl(table):
            if r.get("pool") == "paper" and r.get("status") == "ok" and r.get("latency_s"):
                key = (r["network"], r["workload"])
                out[key] = min(out.get(key, r["latency_s"]), r["latency_s"])
    return out


def _plot(path: Path, ours: dict, baselines: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("ttrank", ours)] + [(k, v) for k, v in baselines.items() if v]
    keys = ["top1", "top3", "top5", "ndcg5"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(methods)
    for i, (name, m) in enumerate(methods):
        ax.bar([j + i * width for j in range(len(keys))], [m.get(k, 0) for k in keys], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score (1 = the best measured candidate)")
    ax.set_title("Donor-schedule ranking, leave-one-network-out")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
