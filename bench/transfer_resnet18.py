"""Transfer every ResNet-18 conv2d kernel's candidates from MobileNetV2's and VGG-16's donor
logs, and compare ttrank's tile adaptation with TVM's own re-sampling on the same pairs.

    python bench/transfer_resnet18.py [--records-per-donor 1] [--donors mobilenetv2 vgg16]

Writes bench/results/transfer_resnet18.json (and .md): per kernel, how many candidates were
valid / rejected and why, the untuned latency, and for each adaptation the best latency and the
share of pairs where it won. Both variants of a pair are measured in the same batch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--donors", nargs="+", default=["mobilenetv2", "vgg16"])
    ap.add_argument("--records-per-donor", type=int, default=1)
    ap.add_argument("--target-network", default="resnet18")
    ap.add_argument("--max-pairs-per-kernel", type=int, default=None,
                    help="sample this many pairs per kernel (seeded), half from each donor network")
    args = ap.parse_args()

    from ttrank import donors, frontend, kernels, measure, transfer, zoo
    from ttrank.bench import results_dir
    from ttrank.locations import shipped_donors
    from ttrank.target import make_target, provenance
    from ttrank.util import atomic_write_json, atomic_write_text

    target = make_target()
    store = donors.DonorStore.load([shipped_donors(required=True) / d for d in args.donors])
    model = frontend.load(zoo.cached(args.target_network))
    ks = [k for k in kernels.extract(model.mod, target) if k.anchor_op.endswith("conv2d_nchw")]
    m = measure.Measurer(target)
    base_m = m.baseline()
    rows, t0 = [], time.time()
    reasons: Counter = Counter()
    try:
        for k in ks:
            pairs = [(w, r) for w, r in store.compatible(k) if r.rank < args.records_per_donor]
            if args.max_pairs_per_kernel and len(pairs) > args.max_pairs_per_kernel:
                import random

                rng = random.Random(k.workload_hash)
                per = max(1, args.max_pairs_per_kernel // len(args.donors))
                picked = []
                for d in args.donors:
                    mine = [p for p in pairs if p[0].network == d]
                    picked += rng.sample(mine, min(per, len(mine)))
                pairs = picked
            untuned = base_m.measure([k.mod])[0].latency_s
            cands = {a: [transfer.transfer(r, k, w, target, adapt=a) for w, r in pairs]
                     for a in ("ttrank", "tvm")}
            flat = [c for a in ("ttrank", "tvm") for c in cands[a] if c.ok]
            res = dict(zip(map(id, flat), m.measure([c.mod for c in flat], reference=k.mod,
                                                    reference_key=k.workload_hash)))
            per_pair = []
            for ct, cv in zip(cands["ttrank"], cands["tvm"]):
                entry = {"donor": ct.record.id, "donor_kernel": ct.donor.kernel.name,
                         "tile_changes": len(ct.tile_changes)}
                for a, c in (("ttrank", ct), ("tvm", cv)):
                    mm = res.get(id(c))
                    status = c.status if not c.ok else ("ok" if mm.ok else mm.status)
                    reason = c.reason if not c.ok else (mm.error if not mm.ok else "")
                    entry[a] = {"status": status, "latency_s": mm.latency_s if mm else None,
                                "reason": reason[:160], "method": c.method}
                    if status != "ok":
                        reasons[(a, status, reason.split(":")[0][:60])] += 1
                per_pair.append(entry)
            ok = lambda a: [p[a]["latency_s"] for p in per_pair if p[a]["status"] == "ok"]  # noqa: E731
            both = [p for p in per_pair if p["ttrank"]["status"] == "ok" and p["tvm"]["status"] == "ok"]
            changed = [p for p in both if p["tile_changes"]]
            rows.append({
                "kernel": k.name, "class": k.workload_class, "extents": k.extents, "weight": k.weight,
                "untuned_s": untuned, "candidates": len(pairs),
                "valid": {a: len(ok(a)) for a in ("ttrank", "tvm")},
                "best_s": {a: min(ok(a), default=None) for a in ("ttrank", "tvm")},
                "pairs_both_valid": len(both), "pairs_with_tile_changes": len(changed),
                "ttrank_faster_on_changed": sum(p["ttrank"]["latency_s"] < p["tvm"]["latency_s"] for p in changed),
                "geomean_ratio_tvm_over_ttrank_on_changed": _geomean(
                    [p["tvm"]["latency_s"] / p["ttrank"]["latency_s"] for p in changed]),
                "pairs": per_pair})
            print(f"{k.name}: {len(pairs)} pairs, valid {rows[-1]['valid']}, best "
                  f"{rows[-1]['best_s']}, untuned {untuned}", flush=True)
    finally:
        m.close()
    summary = {
        "target_network": args.target_network, "donors": args.donors,
        "max_pairs_per_kernel": args.max_pairs_per_kernel,
        "records_per_donor": args.records_per_donor, "seconds": round(time.time() - t0, 1),
        "kernels": len(rows),
        "candidates": sum(r["candidates"] for r in rows),
        "valid": {a: sum(r["valid"][a] for r in rows) for a in ("ttrank", "tvm")},
        "rejections": [{"adapt": a, "status": s, "reason": why, "count": n}
                       for (a, s, why), n in reasons.most_common()],
        "pairs_with_tile_changes": sum(r["pairs_with_tile_changes"] for r in rows),
        "ttrank_faster_on_changed": sum(r["ttrank_faster_on_changed"] for r in rows),
        "geomean_ratio_tvm_over_ttrank_on_changed": _geomean(
            [p["tvm"]["latency_s"] / p["ttrank"]["latency_s"] for r in rows for p in r["pairs"]
             if p["tile_changes"] and p["ttrank"]["status"] == "ok" and p["tvm"]["status"] == "ok"]),
        "weighted_best_ms": {a: 1e3 * sum(r["weight"] * (r["best_s"][a] or r["untuned_s"]) for r in rows)
                             for a in ("ttrank", "tvm")},
        "weighted_untuned_ms": 1e3 * sum(r["weight"] * r["untuned_s"] for r in rows),
        "provenance": provenance(target),
    }
    out = results_dir() / "transfer_resnet18.json"
    atomic_write_json(out, {"summary": summary, "kernels": rows})
    lines = ["| kernel | extents | pairs | valid (ttrank/tvm) | untuned ms | best ttrank ms | best tvm ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v: "-" if v is None else f"{v * 1e3:.3f}"  # noqa: E731
        lines.append(f"| {r['kernel']} | {'x'.join(map(str, r['extents']))} | {r['candidates']} | "
                     f"{r['valid']['ttrank']}/{r['valid']['tvm']} | {f(r['untuned_s'])} | "
                     f"{f(r['best_s']['ttrank'])} | {f(r['best_s']['tvm'])} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n\n```json\n" +
                      json.dumps({k: v for k, v in summary.items() if k != "provenance"}, indent=1) + "\n```\n")
    print(json.dumps(summary, indent=1))


def _geomean(xs):
    import math

    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


if __name__ == "__main__":
    main()
