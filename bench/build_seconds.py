"""Each shipped donor set's record compile times (datasets/donors/*/build_seconds.json).

    python bench/build_seconds.py [SET ...] [--force]

Resumable: a set that has its file is skipped (``--force`` measures it again). Sets run side by
side, one per core. ``recommend`` reads the files: a record whose program took over
``ttrank.pipeline.SLOW_BUILD_S`` to compile is measured only as its kernel's first pick.
"""

from __future__ import annotations

import argparse
import sys
import time

from joblib import Parallel, delayed

from ttrank.donors import shipped_work_dirs
from ttrank.measure import record_build_seconds
from ttrank.target import host_cores, make_target, provenance
from ttrank.util import orphan_safe
from ttrank.workdir import BUILD_FILE, write_build_seconds


def one(work_dir) -> tuple[str, int, float, float]:
    t0 = time.time()
    secs = record_build_seconds(work_dir, make_target())
    write_build_seconds(work_dir, secs, provenance())
    return work_dir.name, len(secs), max(secs.values(), default=0.0), time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sets", nargs="*", help="default: every shipped set")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    dirs = [d for d in shipped_work_dirs() if not args.sets or d.name in args.sets]
    todo = [d for d in dirs if args.force or not (d / BUILD_FILE).exists()]
    print(f"{len(todo)} of {len(dirs)} sets to measure", flush=True)
    for name, n, worst, wall in Parallel(n_jobs=host_cores(), return_as="generator_unordered")(
            delayed(orphan_safe(one))(d) for d in todo):
        print(f"{name}: {n} records, slowest {worst:.2f} s ({wall:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
