"""Seeded against unseeded native tuning (issue #19's one-step adaptation), per kernel.

For each kernel: the ranker's top donor schedules measured on this CPU
(:func:`ttrank.adapt.measure_seeds`), then ``--trials`` MetaSchedule trials seeded with the
replayable ones, then as many unseeded, one after the other (nothing else may run on the cores).
This CPU is held out of the shipped data first (:func:`ttrank.holdout.hold_out_cpu`), as
bench/host.py does, so the seeds come from other CPUs' donors.

    python bench/seeding.py [NET:TASK ...] [--trials 64]

Results: bench/results/seeding_<mcpu>.json, rewritten after each kernel (a rerun skips the
kernels it has; tuning work dirs and the user cache in bench/work/seeding/<mcpu>).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ttrank import zoo
from ttrank.adapt import PlannedKernel, measure_seeds
from ttrank.bench import head_commit, results_dir
from ttrank.collect import best_measured
from ttrank.donors import DonorStore
from ttrank.holdout import hold_out_cpu
from ttrank.kernels import extract
from ttrank.locations import using_home
from ttrank.measure import Measurer
from ttrank.ranker import Ranker
from ttrank.target import host_mcpu, make_target, provenance
from ttrank.tune import count_trials, tune
from ttrank.util import atomic_write_json, environ

# dominant convs of ResNet-18, ResNet-50 and MobileNetV2, packed (NCHWc) as `adapt` tunes them
KERNELS = ["resnet18:fused_conv2d_NCHWc_add_relu", "resnet18:fused_conv2d_NCHWc9_add7_add8_relu4",
           "resnet50:fused_conv2d_NCHWc16_add9_relu7",
           "mobilenetv2:fused_conv2d_NCHWc13_add16_maximum8_minimum8"]


def one(net: str, task: str, trials: int, work: Path, store: DonorStore, ranker: Ranker, target,
        measurer: Measurer) -> dict:
    model = zoo.load(f"zoo:{net}", layout="nchwc", target=target)
    k = next((k for k in extract(model.mod, target) if k.name == task), None)
    if k is None:
        raise SystemExit(f"{net} has no kernel {task}")
    planned = PlannedKernel(k.workload_hash, net, task, k.workload_class, share=0.0)
    out = work / "measurements"
    t0 = time.time()
    seeds, measured = measure_seeds(net, model, [planned], store, ranker, out, target, measurer, budget_s=600)
    row = {"network": net, "kernel": task, "workload_class": k.workload_class, "trials": trials,
           "seed_seconds": round(time.time() - t0, 1), "candidates_measured": measured,
           "seeds_s": [s.latency_s for s in seeds.get(k.workload_hash, [])],
           # what transfer alone reaches among them (anchor-trace transfers too, which cannot seed)
           "best_transferred_s": min((lat for _, lat in best_measured(net, [k], store, out, target, 1)
                                      .get(k.workload_hash, [])), default=None)}
    for arm in ("seeded", "unseeded"):
        t1 = time.time()
        tune(model.mod, work / f"{net}-{task}-{arm}", trials_per_task=trials, only=[task], target=target,
             layout="nchwc", seeds=seeds if arm == "seeded" else None)
        row[f"{arm}_s"] = count_trials(work / f"{net}-{task}-{arm}")[task]["best_s"]
        row[f"{arm}_seconds"] = round(time.time() - t1, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="*", default=KERNELS, help="NET:TASK (zoo network, packed kernel name)")
    ap.add_argument("--trials", type=int, default=64)
    args = ap.parse_args()
    mcpu = host_mcpu()
    out_file = results_dir() / f"seeding_{mcpu}.json"
    res = json.loads(out_file.read_text()) if out_file.exists() else {"cpu": mcpu, "kernels": []}
    done = {(r["network"], r["kernel"], r["trials"]) for r in res["kernels"]}
    work = Path(__file__).resolve().parent / "work" / "seeding" / mcpu
    held = hold_out_cpu(mcpu, Path(__file__).resolve().parent / "work" / "host" / mcpu / "shipped-home")
    res["held_out"] = {k: v for k, v in held.to_json().items() if k != "home"}
    target = make_target()
    with using_home(held.home), environ("TTRANK_CACHE", work / "cache"):
        store, ranker, measurer = DonorStore.load(), Ranker.load(), Measurer(target)
        try:
            for spec in args.kernels:
                net, task = spec.split(":", 1)
                if (net, task, args.trials) in done:
                    continue
                row = one(net, task, args.trials, work, store, ranker, target, measurer)
                row.update(commit=head_commit(), provenance=provenance(target))
                res["kernels"].append(row)
                atomic_write_json(out_file, res)
                print(json.dumps({k: row[k] for k in ("network", "kernel", "seeds_s", "seeded_s", "unseeded_s")}),
                      flush=True)
        finally:
            measurer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
