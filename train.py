"""Rebuild the shipped ranker (models/ranker.json) from datasets/.

    python train.py [--trees 300]

Donors: datasets/donors/*; measurements: datasets/measurements/*.jsonl (and the user's own runs
under ~/.cache/ttrank/data unless --shipped-only).
"""

from __future__ import annotations

import argparse
import json

from ttrank import training
from ttrank.ranker import DEFAULT_MODEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=300)
    ap.add_argument("--out", default=str(DEFAULT_MODEL))
    ap.add_argument("--shipped-only", action="store_true", default=True,
                    help="train on datasets/ only (the default for the shipped model)")
    args = ap.parse_args()
    dirs = [training.DATASET_MEASUREMENTS] if args.shipped_only else None
    from ttrank.donors import DATASET_DONORS, DonorStore

    store = DonorStore.load(sorted(p for p in DATASET_DONORS.iterdir() if p.is_dir()))
    report = training.train(dirs, store, out=args.out, n_estimators=args.trees)
    print(json.dumps({k: v for k, v in report.items() if k != "configs"}, indent=1))
    for label, r in report.get("configs", {}).items():
        print(label, json.dumps({k: round(v, 3) for k, v in r["average"].items()}))


if __name__ == "__main__":
    main()
