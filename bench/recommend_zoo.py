"""`ttrank recommend` on every zoo network, leave-one-out: does it work everywhere, and how well.

    python bench/recommend_zoo.py [--networks N ...] [--budget-minutes M] [--pause-background] [--force]

Each network runs as a user would run it (bench/recommend_bench.run_recommend: the CLI, a fresh
data dir, the network's own schedules and measurements left out of the candidates and the
ranker). A run passes when the compiled model's outputs match onnxruntime (recommend exits
non-zero otherwise). Results are kept per network in bench/results/recommend_zoo.json, so the
command resumes; a network is rerun when the donor networks available to it or the runtime's
threads or the shipped ranker changed. Rows run with recommend's default, fast math; the networks whose
epilogues call exp/erf also run with --exact-math (rows "NET --exact-math"), to show what it costs,
and ``--nchwc-networks`` run again with packed convs (rows "NET --layout nchwc"; their conv
schedules come from the packed donor sets, datasets/donors/NET@nchwc-*).
Writes recommend_zoo.md beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ttrank.bench import head_commit, ranker_id, results_dir, run_recommend
from ttrank.donors import DonorStore
from ttrank.target import provenance, runtime_threads
from ttrank.util import atomic_write_json, atomic_write_text
from ttrank.zoo import ZOO

OUT = results_dir() / "recommend_zoo.json"
# exp/erf in their epilogues: with libm's scalar calls they cost more than the convolution before
# them, which is why fast math is the default; these also run with --exact-math to show it
EXACT_MATH_TOO = ("efficientnetb0", "efficientnetb4", "bert", "mobilebert", "yolo", "vit_tiny", "gpt2")


def summarize(net: str, report: dict, wall: float, donors: list[str], paused: int) -> dict:
    lat = report["model_latency_ms"]
    ks = report["kernels"]
    return {
        "network": net, "donor_networks": donors, "recommend_seconds": round(wall, 1),
        "kernels": len(ks), "kernels_tuned": sum(1 for k in ks if k["status"] != "untuned"),
        "kernels_without_donor": sum(1 for k in ks if k["why"] == "no compatible donor schedule"),
        "model_latency_ms": lat, "speedup_vs_untuned": lat["untuned"] / lat["tuned"],
        "latency_vs_onnxruntime": (lat["tuned"] / lat["onnxruntime"]) if lat.get("onnxruntime") else None,
        "max_abs_error_vs_onnxruntime": report["max_abs_error_vs_onnxruntime"],
        "search_seconds": report["search_seconds"], "background_paused": paused,
        "chosen_from": sorted({k["chosen"]["donor_network"] for k in ks if k.get("chosen")}),
        "provenance": provenance(),
    }


def previous_of(old: dict | None) -> dict | None:
    """What a rerun replaces: the earlier row's times and where they were measured (kept beside
    the new row, so recommend_zoo.md shows each phase before and after)."""
    if not old or "error" in old:
        return None
    prov = old.get("provenance") or {}
    return {"recommend_seconds": old["recommend_seconds"], "search_seconds": old.get("search_seconds"),
            "commit": old.get("commit"), "mcpu": prov.get("mcpu"), "date": prov.get("date"),
            "latency_vs_onnxruntime": old.get("latency_vs_onnxruntime")}


def _phases(s: dict) -> str:
    """recommend's own split of its time (ranking, building and running candidates, tuning what
    no donor covers, compiling, timing the model against onnxruntime; runs before that split
    was reported show '-' for it)."""
    keys = ("ranking", "measuring_build", "measuring_run", "tuning_missing", "compiling", "timing")
    return " / ".join("-" if s.get(k) is None else f"{s[k]:.0f}" for k in keys)


def write_table(results: dict) -> None:
    lines = ["# `ttrank recommend` on the zoo, leave-one-out", "",
             "Each row: `ttrank recommend zoo:NET --leave-one-out` with a fresh data dir; outputs checked "
             "against onnxruntime. Latencies are whole-model, measured by the run itself.", "",
             "| network | donor networks | kernels tuned | untuned ms | ttrank ms | speedup | onnxruntime ms "
             "| ttrank / ORT | max abs error | recommend s | rank / build / run / tune / compile / time s "
             "| paused | threads |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for net in sorted(results):
        r = results[net]
        if "error" in r:
            lines.append(f"| {net} | {len(r.get('donor_networks', []))} | failed: {r['error'][:80]} |"
                         + " |" * 10)
            continue
        lat = r["model_latency_ms"]
        ort = r["latency_vs_onnxruntime"]
        lines.append(f"| {net} | {len(r['donor_networks'])} | {r['kernels_tuned']}/{r['kernels']} | "
                     f"{lat['untuned']:.1f} | {lat['tuned']:.2f} | {r['speedup_vs_untuned']:.1f}x | "
                     f"{lat.get('onnxruntime') or float('nan'):.2f} | "
                     f"{'-' if ort is None else f'{ort:.2f}'} | {r['max_abs_error_vs_onnxruntime']:.1e} | "
                     f"{r['recommend_seconds']:.0f} | {_phases(r.get('search_seconds') or {})} | "
                     f"{'yes' if r['background_paused'] else 'no'} | "
                     f"{(r.get('provenance') or {}).get('threads', 1)} |")
    lines += ["", "paused: whether background tuning was paused during the run (2 cores; an unpaused run "
              "shares them, so its latencies and wall time are noisier)."]
    rerun = {net: r for net, r in sorted(results.items()) if r.get("previous")}
    if rerun:
        lines += ["", "## Before and after: rows rerun on newer code", "",
                  "Each phase in seconds, the earlier run's -> this run's (`rank / build / run / tune / "
                  "compile / time`, as recommend reported them).", "",
                  "| network | CPU | commit | recommend s | rank / build / run / tune / compile / time s | ttrank / ORT |",
                  "|---|---|---|---|---|---|"]
        for net, r in rerun.items():
            p = r["previous"]
            ort = ("-" if p.get("latency_vs_onnxruntime") is None else f"{p['latency_vs_onnxruntime']:.2f}")
            lines.append(f"| {net} | {p.get('mcpu') or '?'} -> {(r.get('provenance') or {}).get('mcpu')} | "
                         f"{p.get('commit') or 'earlier'} -> {r.get('commit') or '?'} | "
                         f"{p['recommend_seconds']:.0f} -> {r['recommend_seconds']:.0f} | "
                         f"{_phases(p.get('search_seconds') or {})} -> {_phases(r.get('search_seconds') or {})} | "
                         f"{ort} -> {r['latency_vs_onnxruntime']:.2f} |")
    atomic_write_text(OUT.with_suffix(".md"), "\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--networks", nargs="+", default=[n for n, e in ZOO.items() if not e.tiny])
    ap.add_argument("--budget-minutes", type=float, default=None, help="start no network after this")
    ap.add_argument("--pause-background", action="store_true")
    ap.add_argument("--force", action="store_true", help="rerun networks that already have a result")
    ap.add_argument("--exact-math-networks", nargs="*", default=list(EXACT_MATH_TOO),
                    help="also run these with --exact-math (their epilogues call exp/erf)")
    ap.add_argument("--nchwc-networks", nargs="*", default=[],
                    help="also run these with --layout nchwc (packed convs)")
    args = ap.parse_args()

    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    store_networks = DonorStore.load().networks
    deadline = time.time() + 60 * args.budget_minutes if args.budget_minutes else None
    failed = 0
    ranker = ranker_id()
    runs = [(net, ()) for net in args.networks]
    runs += [(net, ("--exact-math",)) for net in args.exact_math_networks if net in args.networks]
    runs += [(net, ("--layout", "nchwc")) for net in args.nchwc_networks]
    for net, extra in runs:
        key = " ".join((net, *extra))
        donors = sorted(n for n in store_networks if n != net)
        old = results.get(key)
        if old and not args.force and old.get("donor_networks") == donors and "error" not in old \
                and (old.get("provenance") or {}).get("threads") == runtime_threads() \
                and old.get("ranker") == ranker and old.get("fast_math") == ("--exact-math" not in extra):
            print(f"{key}: done earlier with the same donors, threads and ranker")
            continue
        if deadline and time.time() > deadline:
            print("budget spent; rerun to continue")
            break
        print(f"{key}: recommend with donors {', '.join(donors)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="ttrank-zoo-") as tmp:
            try:
                report, wall, paused, _ = run_recommend(net, Path(tmp), pause=args.pause_background,
                                                        extra=extra)
                results[key] = summarize(net, report, wall, donors, paused)
                results[key]["previous"] = previous_of(old)
                results[key]["commit"] = head_commit()
                results[key]["ranker"] = ranker
                results[key]["fast_math"] = (report.get("provenance") or {}).get("fast_math")
            except RuntimeError as e:
                failed += 1
                results[key] = {"network": net, "donor_networks": donors, "error": str(e)[-1500:]}
            results[key]["options"] = list(extra)
        atomic_write_json(OUT, results)
        write_table(results)
    write_table(results)
    print(OUT.with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
