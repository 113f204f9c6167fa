"""Each CPU's own ranker and its family's blended in, over seeds: what `recommend` ranks with, per
CPU, against the pooled ranker alone.

    python bench/own_rankers.py [--seeds 3]

Leave one network out on the committed cross-measurements (:mod:`ttrank.evaluate`): the shipped
configuration pooled over every CPU's rows, and on each CPU with ``OWN_MIN_ROWS`` rows its own
ranker (that CPU's rows of the other networks alone), and its family's ranker (the family's
CPUs' rows) where that raises the CPU's mean of top-1 and top-3, blended in at ``OWN_WEIGHT``, as
``python train.py`` evaluates and chooses it (:func:`ttrank.training.evaluate_own`); scored per
CPU, each seed's split of rows and columns apart (mean, min and max). Each seed chooses the
family blend on its own scores, as train.py does. A seed's scores are cached (joblib, under
the user's cache), so a killed run resumes. About 15 minutes a seed on 2 cores.
Writes bench/results/own_rankers.json and .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from joblib import Memory

from ttrank.bench import results_dir
from ttrank.collect import Dataset, build_dataset
from ttrank.donors import DonorStore, shipped_work_dirs
from ttrank.evaluate import leave_one_network_out
from ttrank.locations import shipped_measurements
from ttrank.ranker import OWN_MIN_ROWS, OWN_WEIGHT, Ranker
from ttrank.target import provenance
from ttrank.training import evaluate_own
from ttrank.util import atomic_write_json, atomic_write_text, cache_dir

TARGETS = {"top1": 0.90, "top3": 0.97}


def one_seed(ds: Dataset, params: dict, seed: int, min_rows: int, weight: float) -> dict:
    """Per CPU, the pooled ranker's and the blend's leave-one-network-out top-1 and top-3."""
    config = {**{k: v for k, v in params.items() if k != "n_estimators"}, "seed": seed}
    pooled = leave_one_network_out(ds, lambda: Ranker(**{**params, "seed": seed}))["scores"]
    return evaluate_own(ds, pooled, config, params["n_estimators"], min_rows, weight)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: bench/results")
    args = ap.parse_args()
    ds = build_dataset([shipped_measurements(required=True)], DonorStore.load(shipped_work_dirs()))
    params = Ranker.load().get_params()
    # v2: with the family rankers (the cache keys on this function's code, not evaluate_own's)
    cached = Memory(cache_dir() / "bench" / "own_rankers_v2", verbose=0).cache(one_seed)
    runs = []
    for s in range(args.seeds):
        runs.append(cached(ds, params, s, OWN_MIN_ROWS, OWN_WEIGHT))
        print(f"seed {s}: " + ", ".join(f"{c} {v['top1_pooled']:.3f}/{v['top3_pooled']:.3f} -> "
                                         f"{v['top1']:.3f}/{v['top3']:.3f}{' (family)' if v['family'] else ''}"
                                         for c, v in runs[-1]["per_cpu"].items()),
              flush=True)
    cpus = sorted(runs[0]["per_cpu"])
    agg = {c: {"rows": runs[0]["per_cpu"][c]["rows"], "own": runs[0]["per_cpu"][c]["own"],
               "family_seeds": sum(bool(r["per_cpu"][c].get("family")) for r in runs),
               **{k: {"mean": float(np.mean(v)), "min": float(min(v)), "max": float(max(v))}
                  for k in ("top1_pooled", "top3_pooled", "top1_no_family", "top3_no_family",
                            "top1_family", "top3_family", "top1", "top3")
                  for v in [[r["per_cpu"][c][k] for r in runs]] if None not in v}} for c in cpus}
    out = {"how": f"python bench/own_rankers.py --seeds {args.seeds}",  # --out only says where "rows": int(len(ds.y)),
           "kernel_groups": len(ds.groups), "seeds": args.seeds, "min_rows": OWN_MIN_ROWS, "weight": OWN_WEIGHT,
           "params": {k: v for k, v in params.items() if k != "seed"}, "per_cpu": agg, "provenance": provenance()}

    def cell(a: dict, key: str) -> str:
        return f"{a[key]['mean']:.3f} ({a[key]['min']:.3f}–{a[key]['max']:.3f})"

    def meets(a: dict, suffix: str) -> bool:
        return all(a[k + suffix]["mean"] >= t for k, t in TARGETS.items())

    def pair(a: dict, suffix: str) -> str:
        return (f"{a['top1' + suffix]['mean']:.3f} / {a['top3' + suffix]['mean']:.3f}"
                if "top1" + suffix in a else "–")

    lines = ["# Each CPU's own ranker and its family's blended in", "",
             f"{out['rows']} measured candidates in {out['kernel_groups']} kernel groups. Written by `{out['how']}`. "
             f"Leave one network out, scored on each CPU's rows; mean over {args.seeds} seeds (min–max). Pooled: "
             f"the shipped configuration on every CPU's rows. Own: on a CPU with at least {OWN_MIN_ROWS} rows, "
             "its own ranker (its rows alone, without the CPU features) blended in. Family: the ranker of its "
             "CPU family (architecture, vendor and vector width; the rows of every CPU of it, with the CPU "
             f"features) blended in too, at weight {OWN_WEIGHT} together. Shipped: the family blend where it "
             "raises the CPU's mean of top-1 and top-3, chosen by each seed on its own scores as `python "
             "train.py` chooses it. Targets: top-1 >= 0.90 and top-3 >= 0.97 on every CPU.", "",
             "| CPU | rows | own ranker | pooled top-1 / top-3 | + own | + own + family | family chosen "
             "(seeds) | shipped top-1 | shipped top-3 | targets met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, a in agg.items():
        met = f"{'yes' if meets(a, '_pooled') else 'no'} -> {'yes' if meets(a, '') else 'no'}"
        lines.append(f"| {c} | {a['rows']} | {'yes' if a['own'] else 'no'} | {pair(a, '_pooled')} | "
                     f"{pair(a, '_no_family')} | {pair(a, '_family')} | {a['family_seeds']}/{args.seeds} | "
                     f"{cell(a, 'top1')} | {cell(a, 'top3')} | {met} |")
    res_dir = results_dir() if args.out is None else Path(args.out)
    atomic_write_json(res_dir / "own_rankers.json", out)
    atomic_write_text(res_dir / "own_rankers.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
