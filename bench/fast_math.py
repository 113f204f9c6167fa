"""Is fast math safe as the default (issue #19 item 4)? Every zoo network, loaded with fast math
and with libm's exact functions, compiled and checked against onnxruntime on the same inputs.

    python bench/fast_math.py [--networks NET ...] [--budget-minutes M] [--force] [--no-exact]

A network whose graph has no exp, sigmoid, erf, tanh or GELU gets the same program either way
("unchanged": nothing to check). For the others, both programs are compiled (untuned: the
schedule does not change the arithmetic) and checked with `recommend`'s own output check
(|got - ref| <= 1e-3 * max(1, max|ref|) + 1e-3 * |ref|). Results go to
bench/results/fast_math.json after every network; a rerun skips what is done for this TVM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import tvm_ffi

from ttrank.bench import results_dir
from ttrank.errors import TTRankError
from ttrank.runtime import CompiledModel, check_against_onnxruntime, compile_model
from ttrank.target import make_target, provenance
from ttrank.util import atomic_write_json
from ttrank.zoo import ZOO, load

OUT = results_dir() / "fast_math.json"


def check(net: str, target, exact_too: bool = True) -> dict:
    """Both imports of ``net`` against onnxruntime: the max abs error and the verdict of each."""
    fast, exact = load(f"zoo:{net}"), load(f"zoo:{net}", fast_math=False)
    if tvm_ffi.structural_equal(fast.mod, exact.mod):
        return {"changed": False, "ok": True}
    out: dict = {"changed": True}
    for name, model in (("fast", fast), ("exact", exact))[:2 if exact_too else 1]:
        t0 = time.time()
        compiled = CompiledModel.from_executable(compile_model(model, target), model)
        res = check_against_onnxruntime(compiled, model)
        out[name] = {**res.to_json(), "seconds": round(time.time() - t0, 1)}
    out["ok"] = out["fast"]["ok"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--networks", nargs="+", default=[n for n, e in ZOO.items() if not e.tiny])
    ap.add_argument("--budget-minutes", type=float, default=None, help="start no network after this")
    ap.add_argument("--force", action="store_true", help="check networks already checked again")
    ap.add_argument("--no-exact", action="store_true",
                    help="compile and check only the fast-math import (half the time)")
    args = ap.parse_args()
    target = make_target()
    prov = provenance(target)
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    nets = res.setdefault("networks", {})
    deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
    for net in args.networks:
        old = nets.get(net)
        if old and not args.force and old.get("tvm") == prov.get("tvm") and "error" not in old:
            continue
        if deadline and time.time() > deadline:
            print("budget spent; rerun to continue")
            break
        print(f"{net} ...", flush=True)
        try:
            nets[net] = check(net, target, exact_too=not args.no_exact)
        except TTRankError as e:
            nets[net] = {"ok": False, "error": str(e)}
        nets[net]["tvm"] = prov.get("tvm")
        print(f"  {json.dumps(nets[net])}", flush=True)
        changed = [r for r in nets.values() if r.get("changed")]
        res.update({"checked": len(nets), "changed": len(changed),
                    "all_ok": all(r.get("ok") for r in nets.values()),
                    "worst_fast_abs_error": max((r["fast"]["max_abs_error"] for r in changed if "fast" in r),
                                                default=None),
                    "provenance": prov})
        atomic_write_json(OUT, res)
    print(json.dumps({k: v for k, v in res.items() if k != "networks"}, indent=1))
    return 0 if res.get("all_ok") else 1


if __name__ == "__main__":
    sys.exit(main())
