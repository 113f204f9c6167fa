"""How stable is a candidate's measured latency? Two runner protocols, each run twice.

    python bench/measure_noise.py [--network resnet18] [--kernels 4] [--candidates 10] [--pause-background]

For the heaviest kernels of a zoo network, a sample of donor candidates is measured twice with
each protocol, at the same number of timed repeats:
  sequential   each candidate's repeats back to back (rounds=1, repeat=R)
  interleaved  `rounds` passes over the batch in shuffled order, fewer repeats each
Reported per protocol: the spread of run-1/run-2 latency ratios, the relative dispersion (that
spread after removing the run's common shift: what a ranking depends on), and how often the two
runs agree on the best candidate (and the top-1 score of run 1's pick judged by run 2).
Adds an entry to bench/results/measure_noise.json (one per network and runtime thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from ttrank.bench import paused_background, results_dir
from ttrank.collect import sample_pairs
from ttrank.donors import DonorStore
from ttrank.kernels import extract
from ttrank.measure import Measurer, RunnerSpec
from ttrank.target import make_target, provenance
from ttrank.transfer import transfer
from ttrank.util import atomic_write_json
from ttrank.zoo import load


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--network", default="resnet18")
    ap.add_argument("--kernels", type=int, default=4)
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per candidate, per protocol")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=3, help="runs averaged per timed repeat (at least)")
    ap.add_argument("--min-repeat-ms", type=int, default=50)
    ap.add_argument("--pause-background", action="store_true")
    args = ap.parse_args()

    target = make_target(None)
    store = DonorStore.load(None, target=target)
    model = load(f"zoo:{args.network}")
    kernels = sorted((k for k in extract(model.mod, target) if k.tunable),
                     key=lambda k: -k.weight * k.flops)[:args.kernels]
    protocols = {
        "sequential": RunnerSpec(repeat=args.repeats, rounds=1, number=args.number,
                                 min_repeat_ms=args.min_repeat_ms),
        "interleaved": RunnerSpec(repeat=max(1, args.repeats // args.rounds), rounds=args.rounds,
                                  number=args.number, min_repeat_ms=args.min_repeat_ms),
    }
    out = {"network": args.network, "repeats": args.repeats, "rounds": args.rounds,
           "provenance": provenance(target), "kernels": []}
    with paused_background(args.pause_background) as paused:
        out["background_paused"] = paused
        for k in kernels:
            pairs = sample_pairs(k, store.compatible(k, {args.network}), args.candidates, 1)
            mods = [c.mod for c in (transfer(r, k, w, target) for w, r in pairs) if c.ok]
            row = {"kernel": k.name, "candidates": len(mods)}
            for name, spec in protocols.items():
                m = Measurer(target, spec)
                runs = []
                t0 = time.time()
                for _ in range(2):
                    runs.append([x.latency_s for x in m.measure(mods)])
                m.close()
                pairs_ok = [(a, b) for a, b in zip(*runs) if a and b]
                ratios = [a / b for a, b in pairs_ok]
                logs = [math.log(r) for r in ratios]
                shift = statistics.median(logs)  # the whole machine slower in one run than the other
                best1 = min(range(len(pairs_ok)), key=lambda i: pairs_ok[i][0])
                best2 = min(b for _, b in pairs_ok)
                row[name] = {
                    "seconds": round(time.time() - t0, 1),
                    "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "median_abs_log_ratio": statistics.median(abs(v) for v in logs),
                    # what ranking depends on: disagreement left after the common shift
                    "relative_dispersion": statistics.median(abs(v - shift) for v in logs),
                    "same_best": best1 == min(range(len(pairs_ok)), key=lambda i: pairs_ok[i][1]),
                    "top1_score_cross": best2 / pairs_ok[best1][1],
                    "runs": runs,
                }
                print(f"{k.name} {name}: ratio {min(ratios):.2f}-{max(ratios):.2f}, "
                      f"same best {row[name]['same_best']}, cross top-1 {row[name]['top1_score_cross']:.3f}",
                      flush=True)
            out["kernels"].append(row)
    for name in protocols:
        rs = [r[name] for r in out["kernels"]]
        out[name] = {"median_abs_log_ratio": statistics.mean(r["median_abs_log_ratio"] for r in rs),
                     "relative_dispersion": statistics.mean(r["relative_dispersion"] for r in rs),
                     "worst_ratio": max(max(r["ratio_max"], 1 / r["ratio_min"]) for r in rs),
                     "same_best": sum(r["same_best"] for r in rs) / len(rs),
                     "top1_score_cross": statistics.mean(r["top1_score_cross"] for r in rs),
                     "seconds": sum(r["seconds"] for r in rs)}
        print(name, json.dumps(out[name]))

    # one entry per (network, runtime threads): the protocols behave differently at 1 and 2
    path = results_dir() / "measure_noise.json"
    runs = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    out["runner"] = {"number": args.number, "min_repeat_ms": args.min_repeat_ms}
    label = f"{args.network}, {out['provenance'].get('threads')} thread(s)"
    if (args.number, args.min_repeat_ms) != (3, 50):
        label += f", number {args.number}, min_repeat_ms {args.min_repeat_ms}"
    runs[label] = out
    atomic_write_json(path, {"runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
