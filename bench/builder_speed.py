"""Trials per minute: ttrank's warm-pool builder vs MetaSchedule's stock LocalBuilder.

Both tune the same ResNet-18 conv2d task (64->64, 3x3, 56x56) with the same search settings,
one after the other in one run, from a fresh process state for the search. Writes
bench/results/builder_speed.json.

    python bench/builder_speed.py [--trials 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(builder_kind: str, trials: int, per_iter: int) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from ttrank import frontend, kernels, zoo
    from ttrank.measure import RunnerSpec, WarmPoolBuilder
    from ttrank.target import make_target, provenance

    target = make_target()
    with tempfile.TemporaryDirectory() as d:
        path = zoo.export("resnet18", Path(d) / "r18.onnx")
        mod = kernels.fuse(frontend.load(path).mod)
        task = next(t for t in ms.relax_integration.extract_tasks(mod, target)
                    if t.task_name.startswith("fused_conv2d1_add1_relu"))
        ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts([task], d, seed=0)
        builder = WarmPoolBuilder() if builder_kind == "ttrank" else ms.builder.LocalBuilder()
        runner = RunnerSpec(repeat=1, number=3).create()
        t0 = time.time()
        db = ms.tune.tune_tasks(tasks=ctxs, task_weights=weights, work_dir=d,
                                max_trials_global=trials, max_trials_per_task=trials,
                                num_trials_per_iter=per_iter, builder=builder, runner=runner,
                                database="memory", task_scheduler="round-robin")
        elapsed = time.time() - t0
        recs = db.get_all_tuning_records()
        valid = [r for r in recs if r.run_secs and min(float(s) for s in r.run_secs) < 1e9]
        if builder_kind == "ttrank":
            builder.close()
        best = min((min(float(s) for s in r.run_secs) for r in valid), default=None)
        return {"builder": builder_kind, "seconds": round(elapsed, 1), "trials": len(recs),
                "valid_trials": len(valid),
                "trials_per_minute": round(60 * len(recs) / elapsed, 2),
                "valid_trials_per_minute": round(60 * len(valid) / elapsed, 2),
                "best_ms": best and round(best * 1e3, 4), "provenance": provenance(target)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--per-iter", type=int, default=16)
    args = ap.parse_args()
    import logging

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    # warm the search's one-time imports so neither side pays them inside its timing
    import tvm.s_tir.tensor_intrin  # noqa: F401

    rows = [run("ttrank", args.trials, args.per_iter), run("stock", args.trials, args.per_iter)]
    ratio = rows[0]["valid_trials_per_minute"] / max(rows[1]["valid_trials_per_minute"], 1e-9)
    out = {"task": "resnet18 fused_conv2d1_add1_relu1 (64->64, 3x3, 56x56)",
           "trials": args.trials, "trials_per_iter": args.per_iter, "runs": rows,
           "speedup_valid_trials_per_minute": round(ratio, 1),
           "speedup_trials_per_minute": round(rows[0]["trials_per_minute"] / rows[1]["trials_per_minute"], 1),
           "note": "measured in one process, one after the other, on a shared 2-core machine"}
    path = ROOT / "bench" / "results" / "builder_speed.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
