"""What closes the kernel gap to onnxruntime (issue #19, item 1): each lever, per kernel, with numbers.

For a handful of representative zoo kernels, each taken from its zoo network by ttrank's own task
extraction (and rebuilt as a one-op ONNX model whose extracted kernel must have the same
structural hash, so the levers that change the graph can be applied to it), this measures
what each lever buys against onnxruntime's own time for the same node:

- ``depth``    MetaSchedule (ttrank's ``tune``: in-process builder, xgb cost model), NCHW, every
               runtime thread, best-so-far at 64/128/256/512/1024 trials;
- ``prepack``  the same with weight pre-packing (``AttachAttrLayoutFreeBuffers`` before
               extraction, MetaSchedule's ``RewriteLayout`` postprocessor picks the weight layout);
- ``nhwc``     Relax ``ConvertLayout`` to NHWC/OHWI before fusion;
- ``nchwc``    :func:`ttrank.layouts.pack_conv2d_nchwc`: packed NCHW[x]c convs (x86 style);
- ``nchwc8``   the same with blocks of 8 channels (AVX2's float lanes) where ``nchwc`` packs
               by 16 (the shipped packed donors' block), to see which block an AVX2 CPU wants;
- ``threads1`` tuned with one runtime thread (as the v1 donors were), then re-measured on all;
- ``gap``      per network (ResNet-18, MobileNetV2): the whole network tuned at ``gap_trials``
               (``--gap-trials``) per kernel, then the compiled model's time against the weighted
               sum of its kernel times (and onnxruntime's whole-model time, in alternation);
- ``gap_nchwc`` the same with the packed layout (where packing propagates from conv to conv).

``search s`` is the tuning run's clock (trials.jsonl), MetaSchedule's one-time set-up included
(about 30 s on an idle machine). Every cell's best records are re-measured at each depth with
every runtime thread (top 3 by the tuning-time latency among the first N trials), so the cells
compare directly.
onnxruntime's node time comes from its profiler: the full zoo network, the node mapped by its
input and weight shapes (``ort_node_ms``: the fastest matching node's median), and the one-op
model (``ort_one_node_ms``).

Each cell tunes into its own work dir with ttrank's resumable ``tune``, so a rerun continues
it. The driver, ``bench/kernel_gap.py``, parses the arguments and runs the cells; :func:`save`
writes the results (the JSON, its per-CPU Markdown table and the every-CPU summary).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from tvm import relax, s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

from . import frontend, kernels, layouts, runtime, workdir, zoo
from .frontend import LoadedModel
from .measure import Measurer, RunnerSpec
from .profiling import ort_profile
from .target import host_cores, provenance
from .tune import count_trials, tune
from .util import atomic_write_json, atomic_write_text
from .zoo import GraphBuilder

DEPTHS = (64, 128, 256, 512, 1024, 2048, 4096)
# trials for the side kernels of a layout lever (the transforms into and out of the layout)
SIDE_TRIALS = 32
REMEASURE_TOP = 3

# network, the kernel's class and anchor extents (as ttrank.kernels.describe reads them), and
# the one-op ONNX model that reproduces it
KERNELS: dict[str, dict] = {
    "conv3x3": dict(network="resnet18", workload_class="conv2d_nchw+add+relu",
                    extents=[1, 128, 28, 28, 128, 3, 3],
                    op=dict(kind="conv", cin=128, cout=128, k=3, stride=1, hw=28, act="relu"),
                    about="ResNet-18 3x3 conv 128->128 at 28x28, bias + ReLU"),
    "conv1x1": dict(network="resnet18", workload_class="conv2d_nchw+add",
                    extents=[1, 128, 28, 28, 64, 1, 1],
                    op=dict(kind="conv", cin=64, cout=128, k=1, stride=2, hw=56, act=None),
                    about="ResNet-18 1x1 downsample conv 64->128, stride 2, 56->28, bias"),
    "stem7x7": dict(network="resnet18", workload_class="conv2d_nchw+add+relu",
                    extents=[1, 64, 112, 112, 3, 7, 7],
                    op=dict(kind="conv", cin=3, cout=64, k=7, stride=2, hw=224, act="relu"),
                    about="ResNet-18 7x7 stem conv 3->64, stride 2, 224->112, bias + ReLU"),
    "dw3x3": dict(network="mobilenetv2", workload_class="group_conv2d_nchw+add+maximum+minimum",
                  extents=[1, 144, 56, 56, 1, 3, 3],
                  op=dict(kind="conv", cin=144, cout=144, k=3, stride=1, hw=56, groups=144,
                          act="relu6"),
                  about="MobileNetV2 depthwise 3x3 conv, 144 ch at 56x56, bias + ReLU6"),
    "dense": dict(network="bert", workload_class="matmul+add", extents=[1, 256, 768, 768],
                  op=dict(kind="dense", seq=256, cin=768, cout=768),
                  about="BERT-base dense 768->768 at sequence 256, bias (Q/K/V projections)"),
}
KERNEL_LEVERS = ("depth", "nchwc", "nchwc8", "prepack", "nhwc", "threads1")
NETWORK_LEVERS = ("gap", "gap_nchwc")
LEVERS = KERNEL_LEVERS + NETWORK_LEVERS
CONV_ONLY = ("nchwc", "nchwc8", "nhwc")
GAP_NETWORKS = ("resnet18", "mobilenetv2")


# ------------------------------------------------------------------------------------------
# models


def one_op_model(op: dict, seed: int = 0):
    """The one-op ONNX model of a kernel (zoo-style weights)."""
    g = GraphBuilder("kernel", seed)
    if op["kind"] == "conv":
        x = g.input("x", [1, op["cin"], op["hw"], op["hw"]])
        y = g.conv(x, op["cin"], op["cout"], op["k"], op["stride"], groups=op.get("groups", 1))
        if op.get("act") == "relu":
            y = g.relu(y)
        elif op.get("act") == "relu6":
            y = g.relu6(y)
    else:
        x = g.input("x", [1, op["seq"], op["cin"]])
        y = g.linear(x, op["cin"], op["cout"])
    g.output(y)
    return g.model()


def load_onnx(model, name: str) -> LoadedModel:
    """An ONNX model (in memory) loaded as ttrank loads a file: written to a temp folder first."""
    path = Path(tempfile.mkdtemp(prefix="kgap-")) / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return frontend.load(str(path))


def find_zoo_kernel(spec: dict, target) -> dict:
    """The kernel in its zoo network (ttrank's task extraction): name, weight, hash."""
    lm = frontend.load(str(zoo.cached(spec["network"])))
    for k in kernels.extract(lm.mod, target, include_injective=False):
        if k.workload_class == spec["workload_class"] and k.extents == spec["extents"]:
            return {"task": k.name, "weight": k.weight, "flops": k.flops,
                    "workload_hash": k.workload_hash, "network": spec["network"]}
    raise RuntimeError(f"no {spec['workload_class']} {spec['extents']} kernel in {spec['network']}")


def anchor_of(mod, target) -> tuple[kernels.Kernel, list[str]]:
    """The heaviest kernel of a module and the names of the others."""
    ks = kernels.extract(mod, target, include_injective=True)
    tunable = [k for k in ks if k.flops > 0]
    anchor = max(tunable or ks, key=lambda k: k.flops)
    return anchor, [k.name for k in ks if k.name != anchor.name]


# ------------------------------------------------------------------------------------------
# onnxruntime's per-node profile


def match_nodes(nodes: list[dict], op: dict) -> list[dict]:
    """The profiled nodes that compute this kernel's op (by activation and weight shapes)."""
    hits = []
    for n in nodes:
        ins = n["inputs"]
        if op["kind"] == "conv":
            if n["op"] not in ("Conv", "FusedConv", "NchwcConv") or len(ins) < 2:
                continue
            w = [op["cout"], op["cin"] // op.get("groups", 1), op["k"], op["k"]]
            x = [1, op["cin"], op["hw"], op["hw"]]
            ohw = (op["hw"] + 2 * (op["k"] // 2) - op["k"]) // op["stride"] + 1
            outs = n.get("outputs") or []
            if outs and math.prod(outs[0]) != op["cout"] * ohw * ohw:  # another stride
                continue
            # onnxruntime's NCHWc transformer reorders the weights (and the data to nChw8c/16c)
            # a 4th input is the residual sum onnxruntime fused in: another kernel
            if len(ins) > 3:
                continue
            if ins[1] == w and ins[0] == x:
                hits.append(n)
            elif n["op"] == "NchwcConv" and math.prod(ins[1]) == math.prod(w) \
                    and math.prod(ins[0]) == math.prod(x) and ins[1][2:4] == [op["k"], op["k"]]:
                hits.append(n)
        else:
            # onnxruntime lists no prepacked (initializer) weight among a Gemm's inputs: match
            # the activation and the output, 2-D or 3-D (batched attention matmuls are 4-D)
            if n["op"] not in ("MatMul", "FusedMatMul", "Gemm", "FusedGemm") or not ins:
                continue
            outs = n.get("outputs") or [[]]
            if len(ins[0]) in (2, 3) and math.prod(ins[0]) == op["seq"] * op["cin"] \
                    and ins[0][-1] == op["cin"] and outs[0] and outs[0][-1] == op["cout"] \
                    and math.prod(outs[0]) == op["seq"] * op["cout"]:
                hits.append(n)
    return hits


def ort_node_times(spec: dict, cache: dict) -> dict:
    """onnxruntime's own time for the kernel's node: in the full network, and as one op."""
    net = spec["network"]
    if net not in cache:
        lm = frontend.load(str(zoo.cached(net)))
        cache[net] = ort_profile(lm.onnx_model, lm.random_inputs(), runs=20 if net == "bert" else 50)
    hits = match_nodes(cache[net], spec["op"])
    one = load_onnx(one_op_model(spec["op"]), "one")
    one_nodes = ort_profile(one.onnx_model, one.random_inputs(), runs=100)
    one_hits = match_nodes(one_nodes, spec["op"])
    return {
        "ort_node_ms": min((h["median_ms"] for h in hits), default=None),
        "ort_node_min_ms": min((h["min_ms"] for h in hits), default=None),
        "ort_node_ms_median_of_nodes": statistics.median([h["median_ms"] for h in hits]) if hits else None,
        "ort_nodes": [{k: h[k] for k in ("node", "op", "median_ms", "min_ms")} for h in hits],
        "ort_one_node_ms": min((h["median_ms"] for h in one_hits), default=None),
        "ort_one_node_min_ms": min((h["min_ms"] for h in one_hits), default=None),
        "ort_one_node_op": one_hits[0]["op"] if one_hits else None,
        # the whole one-op model's nodes (layout reorders included), for reference
        "ort_one_model_nodes_ms": round(sum(n["median_ms"] for n in one_nodes), 4),
    }


def kernel_info(name: str, target, ort_cache: dict, with_ort: bool = True) -> dict:
    """A kernel of :data:`KERNELS` as its zoo network has it, whether the one-op model rebuilds
    it (same workload hash), and onnxruntime's time for its node (``ort_cache``: the networks'
    profiles, shared by the kernels of one run)."""
    spec = KERNELS[name]
    zk = find_zoo_kernel(spec, target)
    anchor, _ = anchor_of(load_onnx(one_op_model(spec["op"]), name).mod, target)
    info = {**zk, "about": spec["about"], "op": spec["op"],
            "one_op_task": anchor.name, "one_op_hash": anchor.workload_hash,
            "same_kernel": anchor.workload_hash == zk["workload_hash"]}
    if with_ort:
        info["ort"] = ort_node_times(spec, ort_cache)
        info["ort"]["threads"] = host_cores()
    return info


# ------------------------------------------------------------------------------------------
# tuning a cell


def _set_threads(n: int) -> None:
    os.environ["TVM_NUM_THREADS"] = str(n)


def lever_module(lm: LoadedModel, lever: str, target) -> tuple:
    """The kernel's module as the lever prepares it, and the tune() ``prepare`` hook."""
    if lever == "nhwc":
        return layouts.to_nhwc(lm.mod), None
    if lever in ("nchwc", "gap_nchwc"):
        return layouts.pack_conv2d_nchwc(lm.mod, target=target), None
    if lever == "nchwc8":
        return layouts.pack_conv2d_nchwc(lm.mod, target=target, lanes=8), None
    if lever == "prepack":
        return lm.mod, relax.transform.AttachAttrLayoutFreeBuffers()
    # the plain levers read the weights as the model holds them (tune's extraction marks a
    # matmul's weight layout-free, which is the prepack lever)
    return lm.mod, kernels.unmark_prepacked_weights


def read_records(work_dir: Path) -> list[TuningRecord]:
    """The tuning records of a JSONDatabase work_dir in the order they were committed."""
    wpath, rpath = work_dir / workdir.WORKLOAD_FILE, work_dir / workdir.RECORD_FILE
    if not rpath.exists():
        return []
    workloads = [Workload.from_json(json.loads(ln)) for ln in wpath.read_text().splitlines() if ln.strip()]
    out = []
    for ln in rpath.read_text().splitlines():
        if not ln.strip():
            continue
        try:
            wi, rec = json.loads(ln)
            out.append(TuningRecord.from_json(rec, workloads[wi]))
        except Exception:  # noqa: BLE001 - a torn line; tune() repairs it on the next run
            continue
    return out


def curve(work_dir: Path, task: str) -> list[dict]:
    """Best-so-far latency and search seconds of one task at each depth it reached."""
    rows = [r for r in workdir.trials(work_dir) if r.get("task") == task and not r.get("event")]
    pts, best = [], None
    for i, r in enumerate(rows, 1):
        if r.get("latency_s") is not None and (best is None or r["latency_s"] < best):
            best = r["latency_s"]
        if i in DEPTHS or i == len(rows):
            pts.append({"trials": i, "best_ms": None if best is None else round(best * 1e3, 5),
                        # the work dir's search clock: this task is the only one tuned in it
                        "search_s": round(r["search_s"], 1)})
    return pts


def remeasure(work_dir: Path, depths: list[int], target, threads: int) -> dict[int, float | None]:
    """At each depth: the top records among the first N trials, re-measured with ``threads``
    runtime threads (min over them, ms)."""
    recs = read_records(work_dir)
    _set_threads(threads)  # the measuring workers start now and inherit it
    measurer = Measurer(target, RunnerSpec(rounds=3, repeat=2, min_repeat_ms=50))
    out: dict[int, float | None] = {}
    try:
        for d in depths:
            pool = [r for r in recs[:d]
                    if r.run_secs and min(float(s) for s in r.run_secs) < workdir.FAILED_SECS]
            pool.sort(key=lambda r: statistics.mean(float(s) for s in r.run_secs))
            mods = []
            for r in pool[:REMEASURE_TOP]:
                sch = s_tir.Schedule(r.workload.mod)
                r.trace.apply_to_schedule(sch, remove_postproc=False)
                mods.append(sch.mod)
            ms_ = [m.latency_s for m in measurer.measure(mods) if m.ok]
            out[d] = round(min(ms_) * 1e3, 5) if ms_ else None
    finally:
        measurer.close()
    return out


def run_kernel_cell(name: str, lever: str, target, *, work_root: str | Path, max_trials: int,
                    per_batch: int, seed: int, deadline: float) -> dict:
    """One kernel with one lever, tuned to ``max_trials`` in ``work_root/<name>/<lever>``
    (resumed if there): its best-so-far curve, each depth re-measured with every thread."""
    spec = KERNELS[name]
    all_threads = host_cores()
    work = Path(work_root) / name / lever
    lm = load_onnx(one_op_model(spec["op"]), name)
    mod, prepare = lever_module(lm, lever, target)
    anchor, others = anchor_of(mod, target)
    threads = 1 if lever == "threads1" else all_threads
    _set_threads(threads)
    left_min = max(0.5, (deadline - time.time()) / 60)
    t0 = time.time()
    tune(mod, work / "anchor", trials_per_task=max_trials, budget_minutes=left_min,
         target=target, trials_per_iter=per_batch, model_name=f"{name}-{lever}",
         seed=seed, only=[anchor.name], prepare=prepare)
    side = {}
    if lever in CONV_ONLY and others and time.time() < deadline:
        tune(mod, work / "side", trials_per_task=SIDE_TRIALS, injective_trials=SIDE_TRIALS,
             budget_minutes=max(0.5, (deadline - time.time()) / 60), target=target,
             trials_per_iter=SIDE_TRIALS, model_name=f"{name}-{lever}-side", seed=seed,
             only=others)
        side = {k: (None if v["best_s"] is None else round(v["best_s"] * 1e3, 5))
                for k, v in count_trials(work / "side").items()}
    wall = time.time() - t0
    tuned = count_trials(work / "anchor")
    # the anchor work dir holds one task; its name can differ from the plain extraction's
    # (AttachAttrLayoutFreeBuffers renames the functions it marks: fused_conv2d_add1)
    task = anchor.name if anchor.name in tuned or len(tuned) != 1 else next(iter(tuned))
    done = tuned.get(task, {})
    pts = curve(work / "anchor", task)
    depths = [p["trials"] for p in pts]
    re_all = remeasure(work / "anchor", depths, target, all_threads)
    _set_threads(all_threads)
    for p in pts:
        p["remeasured_ms"] = re_all.get(p["trials"])
    return {
        "kernel": name, "lever": lever, "anchor_task": task,
        "anchor_hash": anchor.workload_hash, "anchor_class": anchor.workload_class,
        "trials": done.get("done", 0), "target_trials": max_trials,
        "complete": bool(done.get("complete")) or done.get("done", 0) >= max_trials,
        "tuning_threads": threads, "remeasure_threads": all_threads,
        "search_s": pts[-1]["search_s"] if pts else 0.0, "wall_s_this_run": round(wall, 1),
        "curve": pts, "side_kernels_ms": side,
        "side_sum_ms": round(sum(v for v in side.values() if v), 5) if side else None,
        "provenance": provenance(target),
    }


def run_network_cell(net: str, lever: str, target, *, work_root: str | Path, gap_trials: int,
                     per_batch: int, seed: int, deadline: float) -> dict:
    """A whole network tuned at ``gap_trials`` per kernel in ``work_root/net-<net>/<lever>``:
    compiled time vs the kernel sum."""
    all_threads = host_cores()
    _set_threads(all_threads)
    work = Path(work_root) / f"net-{net}" / lever
    lm = frontend.load(str(zoo.cached(net)))
    mod, _ = lever_module(lm, lever, target)
    prog = tune(mod, work, trials_per_task=gap_trials, target=target,
                budget_minutes=max(0.5, (deadline - time.time()) / 60),
                trials_per_iter=min(per_batch, gap_trials), model_name=f"{net}-{lever}",
                seed=seed)
    done = count_trials(work)
    complete = all(t.done >= t.target_trials for t in prog.tasks)
    kernels = [{"task": t.name, "weight": t.weight, "flops": t.flops, "trials": t.done,
                "best_ms": None if t.best_s is None else round(t.best_s * 1e3, 5)} for t in prog.tasks]
    kernel_sum = sum(k["weight"] * k["best_ms"] for k in kernels if k["best_ms"] is not None)
    conv_sum = sum(k["weight"] * k["best_ms"] for k in kernels
                   if k["best_ms"] is not None and "conv2d" in k["task"])
    row = {"network": net, "lever": lever, "complete": complete,
           "trials": sum(k["trials"] for k in kernels), "trials_per_kernel": gap_trials,
           "search_s": round(max((d["search_s"] for d in done.values()), default=0.0), 1),
           "kernels": kernels, "kernel_sum_ms": round(kernel_sum, 4),
           "conv_kernel_sum_ms": round(conv_sum, 4),
           "kernels_without_valid_trial": sum(1 for k in kernels if k["best_ms"] is None),
           "provenance": provenance(target)}
    if complete:
        row.update(whole_model_times(lm, mod, work, target, kernel_sum))
    return row


def whole_model_times(lm: LoadedModel, mod, work: Path, target, kernel_sum: float | None) -> dict:
    """Compile ``mod`` (the network as the lever prepared it) with the database in ``work``,
    check its outputs against onnxruntime, and time both in alternation."""
    db = ms.database.JSONDatabase(work_dir=str(work))
    lm2 = LoadedModel(lm.path, lm.onnx_model, lm.inputs, mod)
    cm = runtime.CompiledModel.from_executable(runtime.compile_model(lm2, target, db), lm2)
    chk = runtime.check_against_onnxruntime(cm, lm2)
    times = runtime.alternate_ms(lm2, {"ttrank": cm}, rounds=5, min_repeat_ms=300)
    return {"whole_model_ms": round(times["ttrank"], 4), "ort_ms": round(times["onnxruntime"], 4),
            "whole_over_kernel_sum": round(times["ttrank"] / kernel_sum, 3) if kernel_sum else None,
            "whole_over_ort": round(times["ttrank"] / times["onnxruntime"], 3),
            "check_max_rel_error": chk.max_rel_error, "check_ok": chk.ok}


# ------------------------------------------------------------------------------------------
# results


def load_results(path: Path) -> dict:
    """The results so far at ``path`` (empty tables for a new file)."""
    if path.exists():
        return json.loads(path.read_text())
    return {"kernels": {}, "cells": {}, "networks": {}}


def save(path: Path, res: dict) -> None:
    """The JSON, its Markdown table beside it and the every-CPU summary, each written atomically."""
    atomic_write_json(path, res)
    atomic_write_text(path.with_suffix(".md"), markdown(res))
    write_summary(path.parent)  # the every-CPU table follows


def _fmt(v, nd=3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def markdown(res: dict) -> str:
    """One CPU's results: each cell's curve, onnxruntime's node times, and the network cells."""
    prov = res.get("provenance", {})
    lines = ["# Kernel gap to onnxruntime, per lever (issue #19 item 1)", "",
             f"CPU: {prov.get('cpu')} (`{prov.get('mcpu')}`, {prov.get('cores')} cores), "
             f"TVM {prov.get('tvm')}, {prov.get('date')}. Written by `bench/kernel_gap.py`.", "",
             "Best ms at each depth is the tuning-time best-so-far; `re` is that depth's top "
             f"{REMEASURE_TOP} records re-measured with every runtime thread (the comparable number). "
             "`/ort` = re-measured ms / onnxruntime's own time for the node (its profiler, the node "
             "in the full network; the one-op model in brackets).", ""]
    depths = sorted({p["trials"] for c in res["cells"].values() for p in c["curve"]})
    head = "| kernel | lever | " + " | ".join(f"{d} (re)" for d in depths) + \
        " | /ort at best | trials | search s | layout side kernels ms |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, kinfo in res["kernels"].items():
        ort = kinfo.get("ort", {})
        for lever in LEVERS:
            c = res["cells"].get(f"{name}/{lever}")
            if not c:
                continue
            by = {p["trials"]: p for p in c["curve"]}
            cells = [f"{_fmt(by[d]['best_ms'])} ({_fmt(by[d].get('remeasured_ms'))})" if d in by else ""
                     for d in depths]
            last = c["curve"][-1] if c["curve"] else {}
            best = last.get("remeasured_ms") or last.get("best_ms")
            r1 = best / ort["ort_node_ms"] if best and ort.get("ort_node_ms") else None
            r2 = best / ort["ort_one_node_ms"] if best and ort.get("ort_one_node_ms") else None
            lines.append(f"| {name} | {lever}{'' if c['complete'] else ' (partial)'} | " + " | ".join(cells)
                         + f" | {_fmt(r1, 2)} [{_fmt(r2, 2)}] | {c['trials']} | {c['search_s']:.0f} | "
                         f"{_fmt(c.get('side_sum_ms'))} |")
    lines += ["", "onnxruntime per node (ms):", ""]
    for name, kinfo in res["kernels"].items():
        ort = kinfo.get("ort", {})
        lines.append(f"- {name} ({kinfo['about']}; {kinfo['network']} `{kinfo['task']}` x{kinfo['weight']}, "
                     f"same kernel as the one-op model: {kinfo.get('same_kernel')}): "
                     f"node {_fmt(ort.get('ort_node_ms'))} (min {_fmt(ort.get('ort_node_min_ms'))}; "
                     f"{len(ort.get('ort_nodes', []))} matching nodes, "
                     f"median {_fmt(ort.get('ort_node_ms_median_of_nodes'))}), "
                     f"one-op model {_fmt(ort.get('ort_one_node_ms'))} ({ort.get('ort_one_node_op')})")
    if res["networks"]:
        lines += ["", "## Whole model vs weighted kernel sum", "",
                  "| network | lever | trials/kernel | kernel sum ms | conv kernels ms | whole model ms "
                  "| whole / sum | onnxruntime ms | whole / ort | search s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for key, n in res["networks"].items():
            lines.append(f"| {n['network']} | {n['lever']}{'' if n['complete'] else ' (partial)'} | "
                         f"{n['trials_per_kernel']} | {_fmt(n['kernel_sum_ms'])} | "
                         f"{_fmt(n['conv_kernel_sum_ms'])} | {_fmt(n.get('whole_model_ms'))} | "
                         f"{_fmt(n.get('whole_over_kernel_sum'), 2)} | {_fmt(n.get('ort_ms'))} | "
                         f"{_fmt(n.get('whole_over_ort'), 2)} | {n['search_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _ort_ratio(ms: float | None, kinfo: dict) -> float | None:
    ort_ms = (kinfo.get("ort") or {}).get("ort_node_ms")
    return ms / ort_ms if ms and ort_ms else None


def summary_markdown(results: dict[str, dict]) -> str:
    """Every CPU's table in one (``bench/results/kernel_gap.md``): per kernel and lever, the
    re-measured time over onnxruntime's node time after the first batch (64 trials) and at the
    deepest point measured, and the gain of the lever over plain NCHW at equal depth."""
    cpus = sorted(results)
    lines = ["# Kernel gap to onnxruntime, every CPU measured (issue #19 item 1)", "",
             "Written by `python bench/kernel_gap.py --summary` from " +
             ", ".join(f"`kernel_gap_{c}.json`" for c in cpus) + " (the per-CPU tables hold the curves). "
             "Each cell: this lever's kernel time (re-measured with every runtime thread) / onnxruntime's "
             "own time for the node, after 64 trials -> at the deepest point (its trials); "
             "`x nchw`: the plain NCHW search's time over this lever's at that depth. Under 1.00 "
             "beats onnxruntime.", "",
             "| kernel | lever | " + " | ".join(f"{c}: /ort 64 -> deepest | x nchw" for c in cpus) + " |",
             "|---|---|" + "---|---|" * len(cpus)]
    names = list(dict.fromkeys(n for r in results.values() for n in r["kernels"]))
    for name in names:
        for lever in KERNEL_LEVERS:
            row, any_cell = [], False
            for cpu in cpus:
                res = results[cpu]
                c, kinfo = res["cells"].get(f"{name}/{lever}"), res["kernels"].get(name, {})
                if not c or not c["curve"]:
                    row += ["", ""]
                    continue
                any_cell = True
                by = {p["trials"]: p.get("remeasured_ms") or p["best_ms"] for p in c["curve"]}
                deep = max(by)
                plain = {p["trials"]: p.get("remeasured_ms") or p["best_ms"]
                         for p in (res["cells"].get(f"{name}/depth") or {}).get("curve", [])}
                first = _ort_ratio(by.get(64), kinfo)
                row.append(f"{_fmt(first, 2)} -> {_fmt(_ort_ratio(by[deep], kinfo), 2)} ({deep})")
                row.append(_fmt(plain[deep] / by[deep], 2) if lever != "depth" and plain.get(deep) else "")
            if any_cell:
                lines.append(f"| {name} | {lever} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_summary(out_dir: Path) -> Path | None:
    """``kernel_gap.md`` beside the per-CPU results in ``out_dir``, from all of them (None: there
    are none)."""
    results = {p.stem.removeprefix("kernel_gap_"): json.loads(p.read_text())
               for p in sorted(out_dir.glob("kernel_gap_*.json"))}
    if not results:
        return None
    path = out_dir / "kernel_gap.md"
    atomic_write_text(path, summary_markdown(results))
    return path

