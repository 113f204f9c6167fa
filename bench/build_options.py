"""Would measuring candidates built with other LLVM options pick as fast kernels, sooner?

recommend's measuring is mostly building, and a build is mostly LLVM. For each kernel of a zoo
network, the ranker's top candidates (the network's own donors left out) are built as the
compiled model is ("O3") and with each variant asked for; every build is measured in the same
run, the variants' order alternating between kernels and rounds (each candidate's latency is its
best over the rounds). Per variant: build seconds (the workers' own, per candidate), each
candidate's latency against its own O3 build (geometric mean and spread), how often a kernel's
winner is the O3 winner (a re-measure of O3 itself gives the noise floor of that count: "O3'"),
and the model's estimated latency when the whole model is built with the variant (each kernel's
best candidate in that variant) and when the variant only chooses (its winners timed at O3).

    python bench/build_options.py [--network resnet18] [--layout nchwc] [--top 5] [--rounds 2]
                                  [--variants noslp O1]

Variants: O1, O2 (LLVM opt-level), noslp (O3 without LLVM's SLP vectorizer), O3' (O3 again).
Writes bench/results/build_options_<network>.json (build_opt_level.json: the first run, levels
only, one round).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

VARIANTS = {"O3": {}, "O3'": {}, "O1": {"opt-level": 1}, "O2": {"opt-level": 2},
            "noslp": {"cl-opt": ["-vectorize-slp=false"]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", default="resnet18")
    ap.add_argument("--layout", default="nchwc")
    ap.add_argument("--top", type=int, default=5, help="candidates per kernel, in the ranker's order")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["noslp", "O3'"], choices=sorted(set(VARIANTS) - {"O3"}))
    args = ap.parse_args()

    import tvm

    from ttrank import frontend, kernels, measure, ranking, transfer, zoo
    from ttrank.bench import results_dir
    from ttrank.donors import DonorStore, shipped_work_dirs
    from ttrank.locations import shipped_ranker
    from ttrank.ranker import Ranker
    from ttrank.target import cpu_description, make_target, provenance
    from ttrank.util import atomic_write_json

    target = make_target()
    names = ["O3", *args.variants]
    targets = {v: tvm.target.Target({**target.export(), **VARIANTS[v]}) for v in names}
    store = DonorStore.load(shipped_work_dirs())
    ranker = Ranker.load(shipped_ranker())
    cpu = cpu_description(provenance(target))
    model = frontend.load(zoo.cached(args.network), layout=args.layout)
    measurers = {v: measure.Measurer(t) for v, t in targets.items()}
    rows, t0 = [], time.time()
    try:
        untuned = measurers["O3"].baseline()
        for i, k in enumerate(kernels.model_kernels(model, target)):
            cands = ranking.rank_kernel(k, store, ranker, {args.network}, cpu)[:args.top]
            moved = [t for c in cands if (t := transfer.transfer(c.record, k, c.donor, target)).ok]
            if len(moved) < 2:
                continue
            base = untuned.measure([k.mod])[0].latency_s
            lat: dict[str, list[float | None]] = {v: [None] * len(moved) for v in names}
            build: dict[str, float] = dict.fromkeys(names, 0.0)
            for r in range(args.rounds):
                for v in (names if (i + r) % 2 == 0 else names[::-1]):
                    m = measurers[v]
                    busy = m.builder.busy_s
                    res = m.measure([t.mod for t in moved], references=[(k.mod, k.workload_hash)] * len(moved))
                    build[v] += (m.builder.busy_s - busy) / len(moved) / args.rounds
                    lat[v] = [min((x for x in (old, new.latency_s if new.ok else None) if x), default=None)
                              for old, new in zip(lat[v], res)]
            rows.append({"kernel": k.name, "weight": k.weight, "untuned_s": base, "candidates": len(moved),
                         "latency_s": lat, "build_s_per_candidate": {v: round(b, 3) for v, b in build.items()}})
            print(k.name, {v: round(b, 2) for v, b in build.items()},
                  {v: [round(1e3 * x, 3) if x else None for x in xs] for v, xs in lat.items()}, flush=True)
    finally:
        for m in measurers.values():
            m.close()
    out = {"network": args.network, "layout": args.layout, "top": args.top, "rounds": args.rounds,
           "variants": {v: VARIANTS[v] for v in names}, "kernels": len(rows), "summary": summarize(rows, names),
           "seconds": round(time.time() - t0, 1), "provenance": provenance(target), "rows": rows}
    atomic_write_json(results_dir() / f"build_options_{args.network}.json", out)
    print(json.dumps(out["summary"], indent=1))


def summarize(rows: list[dict], names: list[str]) -> dict[str, dict]:
    """Per variant: build seconds per candidate, latency against O3 per candidate, winners, and
    the model's estimated latency built with the variant or choosing with it."""

    def winner(v: list[float | None]) -> int | None:
        ok = [(x, j) for j, x in enumerate(v) if x is not None]
        return min(ok)[1] if ok else None

    def capped(x: float | None, r: dict) -> float:  # a kernel keeps its untuned build if nothing beats it
        return min(x if x is not None else r["untuned_s"], r["untuned_s"])

    o3 = sum(r["weight"] * capped(min((x for x in r["latency_s"]["O3"] if x), default=None), r) for r in rows)
    summary = {}
    for v in names:
        ratios = [b / a for r in rows for a, b in zip(r["latency_s"]["O3"], r["latency_s"][v]) if a and b]
        same = sum(winner(r["latency_s"][v]) == winner(r["latency_s"]["O3"]) for r in rows)
        built = sum(r["weight"] * capped(min((x for x in r["latency_s"][v] if x), default=None), r) for r in rows)
        chose = sum(r["weight"] * capped(r["latency_s"]["O3"][w] if (w := winner(r["latency_s"][v])) is not None
                                         else None, r) for r in rows)
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [math.nan] * 9
        summary[v] = {
            "build_s_per_candidate": round(sum(r["build_s_per_candidate"][v] * r["candidates"] for r in rows)
                                           / max(1, sum(r["candidates"] for r in rows)), 3),
            "latency_vs_o3_geomean": round(math.exp(statistics.fmean(math.log(x) for x in ratios)), 4),
            "latency_vs_o3_p10_p90": [round(q[0], 3), round(q[-1], 3)],
            "same_winner": f"{same}/{len(rows)}",
            "estimated_ms_built_with_it": round(1e3 * built, 3),
            "estimated_ms_choosing_with_it": round(1e3 * chose, 3),
            "estimated_ms_o3": round(1e3 * o3, 3)}
    return summary


if __name__ == "__main__":
    main()
