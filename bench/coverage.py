"""Coverage of the donor-pool-v2 networks (#18): leave-one-out `recommend` on each, with
its own donors left out, and what is left at TVM's default schedule.

    python bench/coverage.py [--networks NET ...] [--budget-minutes M]

Writes bench/results/coverage.json (resumable: a network is rerun when its donors change).
Goal per network: no untuned kernel over 5% of the result, all of them under 10%, and ttrank
within 1.5x of onnxruntime (timed in alternation by the run itself). Time nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ttrank.bench import results_dir, run_recommend
from ttrank.coverage import report_summary
from ttrank.donors import DonorStore
from ttrank.target import provenance
from ttrank.util import atomic_write_json
from ttrank.zoo import FAMILY_NETWORKS

OUT = results_dir() / "coverage.json"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--networks", nargs="+", default=FAMILY_NETWORKS)
    ap.add_argument("--budget-minutes", type=float, default=None, help="start no network after this")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {"networks": {}}
    deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
    networks = DonorStore.load().networks
    for net in args.networks:
        donors = sorted(n for n in networks if n != net)
        old = results["networks"].get(net)
        if old and not args.force and old.get("donor_networks") == donors:
            print(f"{net}: measured earlier with the same donors")
            continue
        if deadline and time.time() > deadline:
            print("budget spent; rerun to continue")
            break
        with tempfile.TemporaryDirectory(prefix="ttrank-coverage-") as tmp:
            report, wall, _, cmd = run_recommend(net, Path(tmp))
        row = report_summary(report)
        row.update(network=net, donor_networks=donors, recommend_seconds=round(wall, 1),
                   command=" ".join(cmd[:4]), model_latency_ms=report["model_latency_ms"],
                   goal_met=(row["final_share_untuned_max"] <= 0.05
                             and row["final_share_untuned_total"] <= 0.10
                             and (row["ort_ratio"] or 99) <= 1.5),
                   provenance=provenance())
        results["networks"][net] = row
        atomic_write_json(OUT, results)
        print(json.dumps(row, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
