"""Tune the zoo's donor networks into datasets/donors/<name>/ (resumable, budgeted).

    python bench/tune_donors.py --budget-minutes 170 [--trials-per-task 64] [names...]

Each network is one `ttrank tune` run; a rerun continues where the last one stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# donors that the transfer tests need first, then the rest, smaller searches first
ORDER = ["mobilenetv2", "vgg16", "resnet18", "bert", "alexnet", "mnasnet1_0", "resnet50",
         "googlenet", "efficientnetb0", "mobilebert", "efficientnetb4"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=ORDER)
    ap.add_argument("--budget-minutes", type=float, required=True)
    ap.add_argument("--trials-per-task", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "datasets" / "donors"))
    args = ap.parse_args()
    deadline = time.time() + 60 * args.budget_minutes
    for name in args.names:
        work = Path(args.out) / name
        man = work / "tune_manifest.json"
        m = json.loads(man.read_text()) if man.exists() else {}
        if m.get("complete") and m.get("trials_per_task") == args.trials_per_task and \
                m.get("model_latency_ms"):
            print(f"{name}: complete", flush=True)
            continue
        left = (deadline - time.time()) / 60
        if left < 2:
            print("budget spent", flush=True)
            break
        cmd = ["ttrank", "tune", f"zoo:{name}", "--out", str(work), "--name", name,
               "--trials-per-task", str(args.trials_per_task), "--budget-minutes", f"{left:.1f}",
               "--no-progress", "--measure-model"]
        print(" ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        print(f"{name}: exit {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
