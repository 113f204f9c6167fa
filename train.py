"""Rebuild the shipped ranker (models/ranker.json) from datasets/.

    python train.py [--trees 300] [--like-current [--evaluate]]

Donors: datasets/donors/*; measurements: datasets/measurements/*.jsonl (with --no-shipped-only,
also the user's own runs under ~/.cache/ttrank/data).
"""

from __future__ import annotations

import argparse
import json
import sys

from ttrank import training
from ttrank.collect import build_dataset
from ttrank.donors import DonorStore, shipped_work_dirs
from ttrank.errors import TTRankError
from ttrank.locations import shipped_measurements, shipped_ranker
from ttrank.ranker import Ranker


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=300)
    ap.add_argument("--out", default=None, help="default: models/ranker.json")
    ap.add_argument("--shipped-only", action=argparse.BooleanOptionalAction, default=True,
                    help="train on datasets/ only (the default for the shipped model); "
                         "--no-shipped-only adds the user's own measurements")
    ap.add_argument("--like-current", action="store_true",
                    help="refit with the current model's settings (config, k, second stage) on "
                         "today's data: minutes, where choosing them again by leave-one-out takes "
                         "an hour on 2 cores once the tables hold several CPUs' rows")
    ap.add_argument("--evaluate", action="store_true",
                    help="with --like-current: copy only the configuration, and choose the second "
                         "stage, k and AdaptiveK's gap again by its leave-one-network-out on today's "
                         "data (3 seeds and the program features of new rows: a quarter of an hour)")
    ap.add_argument("--skip-if-current", action="store_true",
                    help="exit 3 without training if the model was trained on exactly this data")
    args = ap.parse_args()
    if args.evaluate and not args.like_current:
        ap.error("--evaluate goes with --like-current (without it, train.py evaluates every configuration)")
    args.out = args.out or str(shipped_ranker())
    dirs = [shipped_measurements(required=True)] if args.shipped_only else None
    store = DonorStore.load(shipped_work_dirs())
    ds = build_dataset(dirs or training.default_measurement_dirs(), store)
    if args.skip_if_current:
        try:
            current = Ranker.load(args.out).metadata.get("training_data_hash")
        except TTRankError:
            current = None
        if current == training.data_hash(ds):
            print(f"{args.out} was trained on this data already")
            return 3
    like = Ranker.load(args.out) if args.like_current else None
    report = training.train(dirs, store, out=args.out, n_estimators=args.trees, ds=ds, like=like,
                            evaluate_like=args.evaluate)
    print(json.dumps({k: v for k, v in report.items() if k != "configs"}, indent=1))
    for label, r in report.get("configs", {}).items():
        print(label, json.dumps({k: round(v, 3) for k, v in r["average"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
