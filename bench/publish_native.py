"""Publish an adaptation's native tuning as shipped donor sets (``datasets/donors``).

    python bench/publish_native.py ADAPT_CACHE [--mcpu MCPU]

``ADAPT_CACHE`` is the user cache ``ttrank adapt`` ran in (for example
``bench/work/host/znver1/adapted-cache@auto``): each of its ``donors/native-MCPU-NET[@LAYOUT]``
work_dirs joins ``datasets/donors/NET@LAYOUT-tTHREADS-MCPU``, merged into the set an earlier
adaptation of that CPU began; then the donors' manifest is rewritten. Repeating it adds nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ttrank import locations
from ttrank.donors import publish_native, write_store_manifest


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cache", type=Path)
    ap.add_argument("--mcpu", default=None, help="only this CPU's native tuning")
    args = ap.parse_args()
    root = locations.shipped_donors(required=True)
    for src, dest, added in publish_native(args.cache / "donors", root, args.mcpu):
        print(f"{src.name} -> {dest.name}: {added}")
    write_store_manifest(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
