"""The paper's experiment side by side: ttrank vs transfer-tuning (paper) vs MetaSchedule vs
onnxruntime, for each zoo network as the target, leave-one-out.

    python bench/paper_table.py [--measure [--budget-minutes M]] [--networks ...]

With ``--measure``, each network that has what it needs (its cross-measurement table and its
MetaSchedule tuning log) and no up-to-date run gets one evaluation run, cached in
bench/results/paper_runs/<net>.json. Without it, the table is rebuilt from the cached runs:
bench/results/paper_table.md, paper_table.json and paper_table.png. What a run measures and
what the table's numbers mean: :mod:`ttrank.paper`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ttrank.bench import DONOR_ORDER as ORDER
from ttrank.bench import LONG, long_dir
from ttrank.bench import metaschedule_dir as ms_dir
from ttrank.donors import DonorStore, shipped_work_dirs
from ttrank.locations import shipped_measurements
from ttrank.paper import build_table, evaluation_run, inputs_hash, runs_dir, write_outputs
from ttrank.ranker import Ranker
from ttrank.util import atomic_write_json


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", help="run the missing evaluation runs")
    ap.add_argument("--budget-minutes", type=float, default=None)
    ap.add_argument("--networks", nargs="+", default=ORDER)
    args = ap.parse_args()
    if args.measure:
        deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
        store = DonorStore.load(shipped_work_dirs())
        shipped = Ranker.load()
        for net in args.networks:
            p = runs_dir() / f"{net}.json"
            if p.exists() and json.loads(p.read_text()).get("inputs") == inputs_hash(net):
                continue
            if not (shipped_measurements() / f"{net}.jsonl").exists() or ms_dir(net) is None:
                print(f"{net}: skipped (needs its cross-measurements and its tuning log)")
                continue
            if net in LONG and ms_dir(net) != long_dir(net):
                # measured against the 64-trial log, the run would be stale once the long one ends
                print(f"{net}: skipped (its long MetaSchedule run is not finished)")
                continue
            if deadline and time.time() > deadline - 600:
                print("budget spent")
                break
            print(f"{net}: evaluation run", flush=True)
            run = evaluation_run(net, store, shipped,
                                 on_progress=lambda i, n, name: print(f"  {net}: {i}/{n} {name}", flush=True))
            atomic_write_json(p, run)
    print(write_outputs(build_table(args.networks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
