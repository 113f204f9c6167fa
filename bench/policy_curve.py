"""Quality against candidates measured, per measuring policy: how ``AdaptiveK``'s defaults were set.

    python bench/policy_curve.py [--trees 300]

The shipped ranker's configuration is refitted leave-one-network-out on the committed
cross-measurements (as bench/ranker_eval.py does, ranker alone), and every policy of a grid
(fixed k, and AdaptiveK over bound, score gap and full share) is scored on the out-of-fold
scores with :func:`ttrank.evaluate.policy_curve`: the weighted top-k score with each kernel's k
from the policy, and the mean k. Writes bench/results/policy_curve.json (no timings).
"""

from __future__ import annotations

import argparse
import itertools

from ttrank.bench import results_dir
from ttrank.collect import build_dataset
from ttrank.donors import DonorStore
from ttrank.evaluate import leave_one_network_out, policy_curve
from ttrank.locations import shipped_measurements
from ttrank.ranker import Ranker
from ttrank.ranking import AdaptiveK, FixedK
from ttrank.target import provenance
from ttrank.util import atomic_write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=None, help="default: the shipped ranker's")
    args = ap.parse_args()
    shipped = Ranker.load()
    params = shipped.get_params()
    if args.trees:
        params["n_estimators"] = args.trees
    ds = build_dataset([shipped_measurements(required=True)], DonorStore.load())
    res = leave_one_network_out(ds, lambda: Ranker(**params))
    policies: dict[str, FixedK] = {f"fixed k={k}": FixedK(k) for k in (1, 2, 3, 4, 5, 6, 8, 10)}
    for max_k, gap, full in itertools.product((3, 5, 8, 10), (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5),
                                              (0.0, 0.005, 0.01, 0.02, 0.05)):
        # full share 0: every kernel over the minor share may get the bound
        policies[f"adaptive max_k={max_k} gap={gap} full_share={full}"] = AdaptiveK(
            max_k, gap=gap, full_share=full or 1e-9)
    curve = policy_curve(ds, res["scores"], policies)
    default = AdaptiveK(5)
    out = {"how": "python bench/policy_curve.py", "ranker": params.get("objective"),
           "rows": len(ds.y), "kernel_groups": len(ds.groups),
           "default": {"policy": default.to_json(),
                       **policy_curve(ds, res["scores"], {"default": default})["default"]},
           "curve": curve, "provenance": provenance()}
    atomic_write_json(results_dir() / "policy_curve.json", out)
    for name, v in curve.items():
        print(f"{name:44s} quality {v['quality']:.4f}  candidates/kernel {v['candidates']:.2f}")


if __name__ == "__main__":
    main()
