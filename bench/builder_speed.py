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



def _timed(builder):
    """Wrap a builder to account the seconds spent building."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import PyBuilder

    @derived_object
    class Timed(PyBuilder):
        def __init__(self):
            super().__init__()
            self.seconds = 0.0

        def build(self, inputs):
            t0 = time.time()
            try:
                return builder.build(inputs)
            finally:
                self.seconds += time.time() - t0

    return Timed()


def run(builder_kind: str, trials: int, per_iter: int) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from ttrank import frontend, kernels, zoo
    from ttrank.measure import RunnerSpec, WarmPoolBuilder
    from ttrank.target import make_target, provenance
    from ttrank.tune import metaschedule_logging

    target = make_target()
    with tempfile.TemporaryDirectory() as d:
        path = zoo.export("resnet18", Path(d) / "r18.onnx")
        mod = kernels.fuse(frontend.load(path).mod)
        task = next(t for t in ms.relax_integration.extract_tasks(mod, target)
                    if t.task_name.startswith("fused_conv2d1_add1_relu"))
        with metaschedule_logging():
            ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts([task], d, seed=0)
        inner = (WarmPoolBuilder() if builder_kind == "ttrank" else
                 ms.builder.LocalBuilder(timeout_sec=120.0) if builder_kind == "stock-timeout120" else
                 ms.builder.LocalBuilder())
        builder = _timed(inner)
        runner = RunnerSpec(repeat=1, number=3).create()
        t0 = time.time()
        with metaschedule_logging():
            db = ms.tune.tune_tasks(tasks=ctxs, task_weights=weights, work_dir=d,
                                    max_trials_global=trials, max_trials_per_task=trials,
                                    num_trials_per_iter=per_iter, builder=builder, runner=runner,
                                    database="memory", task_scheduler="round-robin")
        elapsed = time.time() - t0
        recs = db.get_all_tuning_records()
        valid = [r for r in recs if r.run_secs and min(float(s) for s in r.run_secs) < 1e9]
        if builder_kind == "ttrank":
            inner.close()
        best = min((min(float(s) for s in r.run_secs) for r in valid), default=None)
        return {"builder": builder_kind, "seconds": round(elapsed, 1), "trials": len(recs),
                "valid_trials": len(valid),
                "trials_per_minute": round(60 * len(recs) / elapsed, 2),
                "valid_trials_per_minute": round(60 * len(valid) / elapsed, 2),
                "build_seconds": round(builder.seconds, 1),
                "build_seconds_per_trial": round(builder.seconds / max(1, len(recs)), 2),
                "best_ms": best and round(best * 1e3, 4), "provenance": provenance(target)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--per-iter", type=int, default=16)
    ap.add_argument("--skip-if-current", action="store_true",
                    help="do nothing if the result was measured with the runtime's thread count recorded")
    args = ap.parse_args()
    from ttrank.bench import results_dir

    path = results_dir() / "builder_speed.json"
    if args.skip_if_current and path.exists():
        old = json.loads(path.read_text())
        if old.get("runs") and all("threads" in r["provenance"] for r in old["runs"]):
            print(f"{path} is current")
            return
    from ttrank.target import load_average

    load = load_average()
    import logging

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    # warm the search's one-time imports so neither side pays them inside its timing
    import tvm.s_tir.tensor_intrin  # noqa: F401

    rows = [run(kind, args.trials, args.per_iter) for kind in ("ttrank", "stock", "stock-timeout120")]
    by = {r["builder"]: r for r in rows}

    def ratio(key: str, other: str):
        o = by[other][key]
        return round(by["ttrank"][key] / o, 1) if o else None  # None: the stock run got nothing

    out = {"task": "resnet18 fused_conv2d1_add1_relu1 (64->64, 3x3, 56x56)",
           "trials": args.trials, "trials_per_iter": args.per_iter, "runs": rows,
           "speedup_valid_trials_per_minute_vs_stock": ratio("valid_trials_per_minute", "stock"),
           "speedup_valid_trials_per_minute_vs_stock_timeout120": ratio("valid_trials_per_minute",
                                                                         "stock-timeout120"),
           "build_speedup_per_trial_vs_stock_timeout120": round(
               by["stock-timeout120"]["build_seconds_per_trial"] /
               max(by["ttrank"]["build_seconds_per_trial"], 1e-9), 1),
           "load_1m_at_start": load,
           "note": "one process, one run after the other, same search settings and runner, on a "
                   "2-core machine (load_1m_at_start: what else was running). 'stock' is "
                   "MetaSchedule's LocalBuilder with its defaults; 'stock-timeout120' raises its "
                   "build timeout so that its fresh workers survive the tensor-intrinsics import. "
                   "Search and measuring cost both sides the same, so whole-trial throughput "
                   "gains less than the build time per trial."}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
