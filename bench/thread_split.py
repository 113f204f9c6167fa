"""Does splitting a conv's output rows between threads pay (ttrank.transfer.rows_first)?

    python bench/thread_split.py [--phase native@auto+rows] [--networks NET ...] [--rounds 5]

Per network, the donor records that one of bench/host.py's recommends chose (its kept report,
bench/work/reports/host-<mcpu>-<phase>-<net>.json) are transferred twice onto the model's
kernels: as recommend does, the convs whose activations outweigh their weights with their row
tiles first, and with every donor's own loop order (its threads split the output channels).
Both builds and onnxruntime are timed in alternation in one process (the minimum over rounds).
Results go to bench/results/thread_split.json (per CPU) and thread_split.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ttrank import zoo
from ttrank.bench import head_commit, kept_measurements_dir, report_database, results_dir
from ttrank.donors import DonorStore
from ttrank.runtime import time_side_by_side
from ttrank.target import host_mcpu, make_target, provenance
from ttrank.util import atomic_write_json, atomic_write_text
from ttrank.zoo import PAPER_NETWORKS, ZOO

OUT = results_dir() / "thread_split.json"
CNNS = [n for n in PAPER_NETWORKS if ZOO[n].family == "cnn"]


def one(net: str, report: dict, store: DonorStore, rounds: int) -> dict:
    target = make_target()
    model = zoo.load(f"zoo:{net}", None, fast_math=True, layout=report["provenance"]["layout"], target=target)
    with tempfile.TemporaryDirectory(prefix="ttrank-split-") as tmp:
        rows_db, n_rows = report_database(report, model, target, store, Path(tmp) / "rows")
        chan_db, _ = report_database(report, model, target, store, Path(tmp) / "channels", split_rows=False)
        ms = time_side_by_side(model, target, {"rows": rows_db, "channels": chan_db}, rounds=rounds)
    return {"rows_ms": ms["rows"], "channels_ms": ms["channels"], "onnxruntime_ms": ms["onnxruntime"],
            "rows_ratio": ms["rows"] / ms["onnxruntime"], "channels_ratio": ms["channels"] / ms["onnxruntime"],
            "speedup": ms["channels"] / ms["rows"], "convs_rows_first": n_rows,
            "layout": report["provenance"]["layout"], "commit": head_commit(), "provenance": provenance()}


def table(res: dict) -> str:
    lines = ["# Threads splitting a conv's rows, not its channels (`transfer.rows_first`)", "",
             "Written by `python bench/thread_split.py`. Per network, the donor records one recommend chose, "
             "transferred with the row tiles first (recommend's default for convs whose activations outweigh "
             "their weights) and with each donor's own loop order; both builds and onnxruntime timed in "
             "alternation in one process (ms, minimum over rounds).", ""]
    for cpu, r in sorted(res.items()):
        nets = r["networks"]
        lines += [f"## {cpu} ({r.get('phase')})", "",
                  "| network | convs rows first | channels split ms | rows split ms | speedup | onnxruntime ms "
                  "| / ORT channels | / ORT rows |", "|---|---|---|---|---|---|---|---|"]
        for n, x in nets.items():
            lines.append(f"| {n} | {x['convs_rows_first']} | {x['channels_ms']:.2f} | {x['rows_ms']:.2f} | "
                         f"{x['speedup']:.3f}x | {x['onnxruntime_ms']:.2f} | {x['channels_ratio']:.3f} | "
                         f"{x['rows_ratio']:.3f} |")
        if nets:
            avg = {key: sum(x[key] for x in nets.values()) / len(nets)
                   for key in ("speedup", "channels_ratio", "rows_ratio")}
            lines.append(f"| **average** | | | | {avg['speedup']:.3f}x | | {avg['channels_ratio']:.3f} | "
                         f"{avg['rows_ratio']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="native@auto+rows", help="whose kept recommend reports to replay")
    ap.add_argument("--networks", nargs="+", default=CNNS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--force", action="store_true", help="redo networks that have a result")
    args = ap.parse_args()
    mcpu = host_mcpu()
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    mine = res.setdefault(mcpu, {"phase": args.phase, "networks": {}})
    if mine.get("phase") != args.phase or args.force:
        mine.update(phase=args.phase, networks={})
    store = DonorStore.load()
    reports = kept_measurements_dir().parent / "reports"
    for net in args.networks:
        if net in mine["networks"]:
            continue
        path = reports / f"host-{mcpu}-{args.phase}-{net}.json"
        if not path.exists():
            print(f"{net}: no report at {path}; run bench/host.py for that phase first", file=sys.stderr)
            continue
        mine["networks"][net] = one(net, json.loads(path.read_text()), store, args.rounds)
        x = mine["networks"][net]
        print(f"{net}: channels {x['channels_ms']:.2f} ms, rows {x['rows_ms']:.2f} ms ({x['speedup']:.3f}x), "
              f"onnxruntime {x['onnxruntime_ms']:.2f} ms", flush=True)
        atomic_write_json(OUT, res)
        atomic_write_text(OUT.with_suffix(".md"), table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
