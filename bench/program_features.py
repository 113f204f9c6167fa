"""Does MetaSchedule's own program feature help the ranker? Leave-one-network-out, with and without.

    python bench/program_features.py [--trees 300] [--seeds 0 1 2]

For every cross-measured candidate, the donor schedule is transferred onto the target kernel
again and MetaSchedule's PerStoreFeature (164 numbers per buffer store, the features of its
own XGBoost cost model) is extracted from the transferred program, reduced to a fixed vector
(max and mean over stores: the group "m"). The ranker is then evaluated leave-one-network-out
on ttrank's feature groups alone, with "m" added, and on "m" with the target shape alone.

The extraction (ttrank.programs.candidate_vectors) takes 0.1-0.3 s per candidate, so it is
cached per network under ~/.cache/ttrank/program_features/ (recomputed when the rows change).
The second stage that recommend actually uses (a cost model pre-trained on the donors' tuning
logs, blended on the ranker's shortlist) is evaluated by train.py and bench/ranker_eval.py. Writes
bench/results/program_features.json. The answer decides whether recommend should pay that cost
per candidate at ranking time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--measurements", default=None, help="default: datasets/measurements")
    ap.add_argument("--shortlist", type=int, nargs="+", default=[5, 10, 20])
    args = ap.parse_args()

    from ttrank.collect import Dataset, build_dataset
    from ttrank.donors import DonorStore, shipped_work_dirs
    from ttrank.locations import shipped_measurements
    from ttrank.evaluate import KEYS, group_spans, evaluate, leave_one_network_out
    from ttrank.features import FEATURE_NAMES, group_columns
    from ttrank.ranker import Ranker
    from ttrank.target import make_target, provenance
    from ttrank.programs import N_PSF, candidate_vectors
    from ttrank.util import atomic_write_json
    from ttrank.bench import results_dir

    target = make_target(None)
    store = DonorStore.load(shipped_work_dirs(), target=target)
    ds = build_dataset([Path(args.measurements) if args.measurements else shipped_measurements(required=True)], store)
    if len(ds.networks) < 2:
        print("need measurements of at least two networks")
        return 1
    M = candidate_vectors(ds, store, target)
    X = np.concatenate([ds.X, M], axis=1)
    full = Dataset(X, ds.y, ds.groups, ds.meta)
    m_cols = list(range(len(FEATURE_NAMES), X.shape[1]))
    m_names = [f"m_{s}{i}" for s in ("max", "mean") for i in range(N_PSF)]

    class ColumnRanker(Ranker):
        """The ranker on explicit columns of the widened matrix."""

        def __init__(self, cols: list[int], names: list[str], **kw):
            super().__init__(**kw)
            self._cols, self._names = cols, names

        @property
        def feature_names(self) -> list[str]:
            return self._names

        @property
        def width(self) -> int:
            return X.shape[1]

    def columns(groups: str, with_m: bool) -> tuple[list[int], list[str]]:
        cols = group_columns(tuple(groups))
        names = [FEATURE_NAMES[i] for i in cols]
        return (cols + m_cols, names + m_names) if with_m else (cols, names)

    variants = {"ttrank [tdsr]": columns("tdsr", False), "ttrank [tdsra]": columns("tdsra", False),
                "ttrank [tdsr] + m": columns("tdsr", True), "ttrank [tdsra] + m": columns("tdsra", True),
                "[t] + m": columns("t", True)}
    results, all_runs = {}, {}

    def record(name: str, runs: list[dict]) -> None:
        results[name] = {
            "average": {k: float(np.mean([r["average"][k] for r in runs])) for k in KEYS},
            "networks": {n: {k: float(np.mean([r["networks"][n][k] for r in runs])) for k in KEYS}
                         for n in runs[0]["networks"]}}
        a = results[name]["average"]
        print(f"{name:24s} " + "  ".join(f"{k} {a[k]:.3f}" for k in KEYS), flush=True)

    for name, (cols, names) in variants.items():
        all_runs[name] = [leave_one_network_out(full, lambda s=s: ColumnRanker(
            cols, names, objective="reg:squarederror", n_estimators=args.trees, seed=s)) for s in args.seeds]
        record(name, all_runs[name])
    # what recommend could afford: extract "m" only for a shortlist of the base ranker's top-N
    # and reorder that shortlist with the ranker that has "m"
    spans = group_spans(full)
    for n_short in args.shortlist:
        runs = []
        for base, wide in zip(all_runs["ttrank [tdsr]"], all_runs["ttrank [tdsr] + m"]):
            combined = np.array(base["scores"], dtype=np.float64)
            for a, b in spans:
                order = np.argsort(-combined[a:b], kind="stable")
                short, rest = order[:n_short], order[n_short:]
                new = combined[a:b].copy()
                new[short] = wide["scores"][a:b][short]
                if len(rest):  # every shortlisted candidate above every other
                    new[short] += new[rest].max() + 1.0 - new[short].min()
                combined[a:b] = new
            per_net = {net: evaluate(full, combined, [a for a, _ in spans if full.meta[a]["network"] == net])
                       for net in base["networks"]}
            per_net = {n: v for n, v in per_net.items() if v}
            runs.append({"networks": per_net,
                         "average": {k: float(np.mean([v[k] for v in per_net.values()])) for k in KEYS}})
        record(f"two-stage, shortlist {n_short}", runs)
    atomic_write_json(results_dir() / "program_features.json", {
        "rows": len(ds.y), "groups": len(ds.groups), "networks": ds.networks,
        "objective": "reg:squarederror", "trees": args.trees, "seeds": args.seeds,
        "measurements": str(args.measurements or "datasets/measurements"),
        "results": results, "provenance": provenance(target)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
