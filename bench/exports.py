"""`ttrank recommend` on ONNX exports made outside this repo, as a new user runs them.

    python bench/exports.py DIR [--only NAME ...] [--force] [--budget-minutes M] [--out FILE.json]

Every ``DIR/*.onnx`` (third-party exports: torchvision's, timm's and transformers' models
through torch.onnx, a detector from another toolchain, ...) runs through the CLI with the
defaults, a fresh data dir and no donors of the user's own
(bench/recommend_bench.run_recommend), one after another and nothing else running. A run passes
when recommend exits 0, which it does only when the compiled model's outputs match
onnxruntime's. ``DIR/NAME.args`` holds the file's extra arguments if it needs any (the
--input-shape that binds a text model's dynamic axes). Results are kept per file in
bench/results/exports.json (a file is rerun when its bytes, the shipped ranker or the commit
changed, or with --force) and tabled in exports.md (``--out`` keeps another table, for example
one CPU's beside the main one's): ttrank's latency against onnxruntime's,
timed in alternation in the same run, the phases, and the one line a failure ends with. No
export is committed: bench/export_torchvision.py makes the torchvision ones,
bench/export_hub.py the timm and transformers ones (they need torch, which ttrank does not),
bench/export_keras.py Keras models through tf2onnx and torchvision's at old opsets (7-12),
bench/export_paddle.py PaddlePaddle models through paddle2onnx, and bench/export_half.py
float16 exports.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from ttrank.bench import head_commit, ranker_id, results_dir, run_recommend
from ttrank.target import provenance
from ttrank.util import atomic_write_json, atomic_write_text, cache_dir

# what a cache holds that follows from the shipped data alone (content-addressed): shared
# between runs. The user's own donors (what --tune-missing tuned for an earlier file) are not
DERIVED_CACHES = ("index", "program_features", "zoo", "rankers")


@contextlib.contextmanager
def new_user_cache(root: Path):
    """A user cache at ``root`` with no donors of the user's own (TTRANK_CACHE, which the
    recommend subprocess inherits): a file must not get what --tune-missing tuned for the files
    before it, which a new user would not have."""
    old = os.environ.get("TTRANK_CACHE")
    shared = cache_dir()
    root.mkdir(parents=True)
    for sub in DERIVED_CACHES:
        (shared / sub).mkdir(parents=True, exist_ok=True)
        (root / sub).symlink_to(shared / sub)
    os.environ["TTRANK_CACHE"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TTRANK_CACHE", None)
        else:
            os.environ["TTRANK_CACHE"] = old

OUT = results_dir() / "exports.json"


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def summarize(report: dict, wall: float, cmd: list[str]) -> dict:
    lat = report["model_latency_ms"]
    ks = report["kernels"]
    return {"recommend_seconds": round(wall, 1), "command": " ".join(cmd), "kernels": len(ks),
            "kernels_tuned": sum(1 for k in ks if k["status"] != "untuned"),
            "kernels_without_donor": sum(1 for k in ks if k["why"] == "no compatible donor schedule"),
            "model_latency_ms": lat,
            "latency_vs_onnxruntime": lat["tuned"] / lat["onnxruntime"] if lat.get("onnxruntime") else None,
            "max_abs_error_vs_onnxruntime": report["max_abs_error_vs_onnxruntime"],
            "search_seconds": report["search_seconds"]}


def table(rows: dict) -> str:
    lines = ["# ttrank recommend on third-party ONNX exports", "",
             "Written by `python bench/exports.py DIR`: each file as a new user runs it (the CLI's "
             "defaults, a fresh data dir), one at a time with nothing else running. ttrank / "
             "onnxruntime: both timed in alternation in the same run, 2 threads each.", "",
             "| file | CPU | result | recommend s | kernels tuned | ttrank ms | onnxruntime ms | "
             "ttrank / onnxruntime | commit |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items()):
        cpu = r["provenance"].get("mcpu")
        if "error" in r:
            lines.append(f"| {name} | {cpu} | fails: {r['error']} | {r.get('recommend_seconds', '')} | "
                         f"| | | | {r['commit']} |")
            continue
        lat = r["model_latency_ms"]
        ratio = r["latency_vs_onnxruntime"]
        lines.append(f"| {name} | {cpu} | ok | {r['recommend_seconds']} | {r['kernels_tuned']}/{r['kernels']} | "
                     f"{lat['tuned']:.2f} | {lat.get('onnxruntime') or 0:.2f} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {r['commit']} |")
    ok = [r["latency_vs_onnxruntime"] for r in rows.values() if r.get("latency_vs_onnxruntime")]
    if ok:
        lines += ["", f"{len(ok)} of {len(rows)} files compiled and matched onnxruntime; ttrank / "
                  f"onnxruntime averages {sum(ok) / len(ok):.3f} over them, "
                  f"{sum(1 for x in ok if x < 1)} faster than onnxruntime."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path, help="a folder of .onnx files")
    ap.add_argument("--only", nargs="*", default=None, help="file stems to run (default: all)")
    ap.add_argument("--force", action="store_true", help="rerun files whose result is current")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help="start no new file after this long (the rest stay for the next run)")
    ap.add_argument("--out", type=Path, default=OUT,
                    help="the results file (its table goes beside it, .md); default bench/results/exports.json")
    args = ap.parse_args()
    files = sorted(p for p in args.dir.glob("*.onnx") if args.only is None or p.stem in args.only)
    if not files:
        print(f"exports: no .onnx files in {args.dir}", file=sys.stderr)
        return 2
    out = args.out
    rows = json.loads(out.read_text()) if out.exists() else {}
    commit, ranker = head_commit(), ranker_id()
    t0 = time.time()
    for path in files:
        if args.budget_minutes is not None and time.time() - t0 > 60 * args.budget_minutes:
            print(f"exports: budget spent, {path.name} and after left for the next run")
            break
        # an export with dynamic axes comes with the --input-shape that binds them
        args_file = path.with_suffix(".args")
        extra = shlex.split(args_file.read_text()) if args_file.exists() else []
        key = {"sha256_16": digest(path), "ranker": ranker, "commit": commit, **({"args": extra} if extra else {})}
        old = rows.get(path.stem)
        if old and not args.force and all(old.get(k) == v for k, v in key.items()):
            continue
        with tempfile.TemporaryDirectory(prefix="ttrank-export-") as tmp:
            t = time.time()
            try:
                with new_user_cache(Path(tmp) / "cache"):
                    report, wall, _, cmd = run_recommend(path.stem, Path(tmp), path=path, extra=tuple(extra),
                                                         report_name=f"export_{path.stem}")
                row = summarize(report, wall, cmd)
            except RuntimeError as e:
                last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
                row = {"error": last[:300], "recommend_seconds": round(time.time() - t, 1)}
        rows[path.stem] = {**row, **key, "provenance": provenance()}
        atomic_write_json(out, rows)
        atomic_write_text(out.with_suffix(".md"), table(rows))
        print(f"{path.stem}: {row.get('latency_vs_onnxruntime') or row.get('error')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
