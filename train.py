"""Rebuild the shipped ranker (models/ranker.json) from datasets/.

    python train.py [--trees 300]

Donors: datasets/donors/*; measurements: datasets/measurements/*.jsonl (and the user's own runs
under ~/.cache/ttrank/data unless --shipped-only).
"""

from __future__ import annotations

import argparse
import json
import sys

from ttrank import training
from ttrank.ranker import DEFAULT_MODEL


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=300)
    ap.add_argument("--out", default=str(DEFAULT_MODEL))
    ap.add_argument("--shipped-only", action="store_true", default=True,
                    help="train on datasets/ only (the default for the shipped model)")
    ap.add_argument("--skip-if-current", action="store_true",
                    help="exit 3 without training if the model was trained on exactly this data")
    args = ap.parse_args()
    dirs = [training.DATASET_MEASUREMENTS] if args.shipped_only else None
    from ttrank.collect import build_dataset
    from ttrank.donors import DATASET_DONORS, DonorStore
    from ttrank.errors import TTRankError
    from ttrank.ranker import Ranker

    store = DonorStore.load(sorted(p for p in DATASET_DONORS.iterdir() if p.is_dir()))
    ds = build_dataset(dirs or training.default_measurement_dirs(), store)
    if args.skip_if_current:
        try:
            current = Ranker.load(args.out).metadata.get("training_data_hash")
        except TTRankError:
            current = None
        if current == training.data_hash(ds):
            print(f"{args.out} was trained on this data already")
            return 3
    report = training.train(dirs, store, out=args.out, n_estimators=args.trees, ds=ds)
    print(json.dumps({k: v for k, v in report.items() if k != "configs"}, indent=1))
    for label, r in report.get("configs", {}).items():
        print(label, json.dumps({k: round(v, 3) for k, v in r["average"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
