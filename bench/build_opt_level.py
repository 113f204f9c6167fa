"""Would measuring candidates built at a lower LLVM opt-level pick the same winners, sooner?

recommend's measuring is mostly building (ResNet-18 on znver4: 33.7 of 40.5 s), and LLVM's
optimisation is most of a build. For each kernel of a zoo network, the ranker's top candidates
(the network's own donors left out) are built at opt-level 3, as the compiled model is, and at
each lower level asked for; every build is measured in the same run, the levels' order
alternating between kernels. Per level: build seconds (the workers' own, per candidate), how
often a kernel's winner is the opt-level-3 winner, and the model's estimated latency with each
level's winners timed at opt-level 3 (what choosing with that level would cost).

    python bench/build_opt_level.py [--network resnet18] [--top 5] [--levels 1 2]

Writes bench/results/build_opt_level.json.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", default="resnet18")
    ap.add_argument("--top", type=int, default=5, help="candidates per kernel, in the ranker's order")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="opt-levels beside 3")
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
    levels = [3, *[lv for lv in args.levels if lv != 3]]
    targets = {lv: tvm.target.Target({**target.export(), "opt-level": lv}) for lv in levels}
    store = DonorStore.load(shipped_work_dirs())
    ranker = Ranker.load(shipped_ranker())
    cpu = cpu_description(provenance(target))
    model = frontend.load(zoo.cached(args.network))
    measurers = {lv: measure.Measurer(t) for lv, t in targets.items()}
    rows, t0 = [], time.time()
    try:
        untuned = measurers[3].baseline()
        for i, k in enumerate(kernels.model_kernels(model, target)):
            cands = ranking.rank_kernel(k, store, ranker, {args.network}, cpu)[:args.top]
            moved = [t for c in cands if (t := transfer.transfer(c.record, k, c.donor, target)).ok]
            if len(moved) < 2:
                continue
            base = untuned.measure([k.mod])[0].latency_s
            lat: dict[int, list[float | None]] = {}
            build: dict[int, float] = {}
            for lv in (levels if i % 2 == 0 else levels[::-1]):
                m = measurers[lv]
                busy = m.builder.busy_s
                res = m.measure([t.mod for t in moved], references=[(k.mod, k.workload_hash)] * len(moved))
                build[lv] = (m.builder.busy_s - busy) / len(moved)
                lat[lv] = [r.latency_s if r.ok else None for r in res]
            rows.append({"kernel": k.name, "weight": k.weight, "untuned_s": base, "candidates": len(moved),
                         "latency_s": {str(lv): v for lv, v in lat.items()},
                         "build_s_per_candidate": {str(lv): round(v, 3) for lv, v in build.items()}})
            print(k.name, {lv: round(v, 2) for lv, v in build.items()},
                  {lv: [round(1e3 * x, 3) if x else None for x in v] for lv, v in lat.items()}, flush=True)
    finally:
        for m in measurers.values():
            m.close()

    def winner(v: list[float | None]) -> int | None:
        ok = [(x, j) for j, x in enumerate(v) if x is not None]
        return min(ok)[1] if ok else None

    summary = {}
    for lv in levels:
        same, est, best = 0, 0.0, 0.0
        for r in rows:
            w, w3 = winner(r["latency_s"][str(lv)]), winner(r["latency_s"]["3"])
            same += w == w3
            o3 = r["latency_s"]["3"]
            pick = o3[w] if w is not None and o3[w] is not None else r["untuned_s"]
            est += r["weight"] * min(pick, r["untuned_s"])
            best += r["weight"] * min(o3[w3] if w3 is not None else r["untuned_s"], r["untuned_s"])
        summary[str(lv)] = {
            "build_s_per_candidate": round(sum(r["build_s_per_candidate"][str(lv)] * r["candidates"] for r in rows)
                                           / max(1, sum(r["candidates"] for r in rows)), 3),
            "same_winner": f"{same}/{len(rows)}",
            "estimated_ms_with_its_winners_at_o3": round(1e3 * est, 3),
            "vs_o3_choice": round(est / best, 4) if best else None}
    out = {"network": args.network, "top": args.top, "kernels": len(rows), "summary": summary,
           "seconds": round(time.time() - t0, 1), "provenance": provenance(target), "rows": rows}
    atomic_write_json(results_dir() / "build_opt_level.json", out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
