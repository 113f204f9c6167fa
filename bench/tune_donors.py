"""Tune the zoo's donor networks into datasets/donors/<name>/ (resumable, budgeted).

    python bench/tune_donors.py --budget-minutes 170 [--trials-per-task 64] [names...]

Each network is one `ttrank tune` run; a rerun continues where the last one stopped.

Pool v1 (the default) is NCHW, one runtime thread. Another layout or thread count is another
donor set, kept beside v1 in ``<name>@<layout>-t<threads>-<mcpu>/`` (the store reads it as
network ``<name>``, so leave-one-out leaves both out):

    python bench/tune_donors.py --budget-minutes 120 --layout nchwc --threads 0 resnet18
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ttrank.bench import DONOR_ORDER as ORDER
from ttrank.donors import donor_set_dir, write_store_manifest
from ttrank.layouts import LAYOUTS
from ttrank.locations import shipped_donors
from ttrank.target import host_cores, make_target, provenance


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=ORDER)
    ap.add_argument("--budget-minutes", type=float, required=True)
    ap.add_argument("--trials-per-task", type=int, default=64)
    ap.add_argument("--small-trials", type=int, default=64,
                    help="at most this many for kernels under 0.1%% of a network's FLOPs")
    ap.add_argument("--out", default=None, help="default: datasets/donors of the data home")
    ap.add_argument("--layout", choices=list(LAYOUTS), default="nchw")
    ap.add_argument("--threads", type=int, default=1,
                    help="TVM runtime threads while tuning (v1: 1; 0: one per core)")
    args = ap.parse_args()
    deadline = time.time() + 60 * args.budget_minutes
    args.out = args.out or str(shipped_donors(required=True))
    threads = args.threads or host_cores()
    v1 = args.layout == "nchw" and threads == 1
    for name in args.names:
        work = Path(args.out) / name if v1 else donor_set_dir(
            Path(args.out), name, args.layout, threads, provenance(make_target())["mcpu"])
        # always through `ttrank tune`, even when the manifest says complete: a change to the
        # import passes makes new kernels (tune finds them; a finished run costs one extraction),
        # and --measure-model times the model once per finished set of trials
        left = (deadline - time.time()) / 60
        if left < 2:
            print("budget spent", flush=True)
            break
        cmd = ["ttrank", "tune", f"zoo:{name}", "--out", str(work), "--name", name,
               "--trials-per-task", str(args.trials_per_task), "--budget-minutes", f"{left:.1f}",
               "--no-progress", "--measure-model", "--layout", args.layout,
               "--small-trials", str(args.small_trials)]
        print(" ".join(cmd), flush=True)
        # The first nine donors were tuned with TVM's default of one runtime thread on this
        # 2-core host (TVM halves the CPU count to skip hyper-threads); the rest of the dataset
        # keeps that, so every donor's own latency means the same thing. TTRANK_DONOR_THREADS
        # overrides it for a new donor set.
        env = dict(os.environ, TVM_NUM_THREADS=os.environ.get("TTRANK_DONOR_THREADS", str(threads)))
        rc = subprocess.call(cmd, env=env)
        print(f"{name}: exit {rc}", flush=True)
        write_store_manifest(Path(args.out))
    write_store_manifest(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
