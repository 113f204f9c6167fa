"""In-model profiles: where a compiled model's time goes, next to onnxruntime's.

A kernel measured alone (recommend's candidates, a tuning trial) runs in a loop on its own
arguments. Inside the model its input was just written by the kernel before, its weights come
from memory, and the Relax VM's glue runs between kernels. On ResNet-50 (znver2, packed layout)
the kernels' in-model times summed to 1.07-1.27x their isolated sum, and some kernels took 2x
theirs. So this profiles both engines inside their own model runs:

- ttrank: every VM call of a run, timed by the Relax VM's instrument hook (TVM 0.27 has no VM
  profiler);
- onnxruntime: its own profiler, per node.

Both are summed per op class (conv 3x3, depthwise 3x3, matmul, ...; :func:`tvm_class`,
:func:`ort_class`), and the convolutions per geometry (:func:`conv_table`): which of ttrank's
convs runs slowest next to onnxruntime's for the same conv, the one to tune deeper. Profiling is
not free: the hook is a Python call with the call's arguments before and after every VM call,
and it slows small kernels (MobileNetV2 on znver2: 10.4 ms a run instrumented, 6.4 ms not), so
each profile also times the same model without it (``plain_run_ms``): the kernels' shares hold,
their absolute times are an upper bound. The engines run in blocks, each after a pause and
warm-up runs: right after one engine's runs the other's spinning worker threads still hold a core
(interleaved in blocks of 5 runs, MobileNetV2's instrumented runs took 24 ms).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from .frontend import LoadedModel
from .kernels import Kernel
from .runtime import CompiledModel, ort_session

# the VM's own instructions (allocations, shape checks, tuple building): glue, not kernels
RUNTIME_CLASS = "vm runtime"


@dataclass
class Profile:
    """One engine's in-model times: per kernel (or node), ms per model run, mean over runs (so
    that the kernels of a run add up to no more than the run)."""

    engine: str
    run_ms: float  # mean time of one whole run, profiled
    items: list[dict] = field(default_factory=list)  # name, op_class, calls, ms
    plain_run_ms: float | None = None  # the same runs without the profiler (ttrank's)

    def kernels_ms(self) -> float:
        return sum(i["ms"] for i in self.items)

    def by_class(self, key: Callable[[str], str] = str) -> dict[str, dict]:
        """Per op class (as ``key`` names it): ms per run, and calls per run (an onnxruntime
        node is one call)."""
        out: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
        for i in self.items:
            out[key(i["op_class"])]["ms"] += i["ms"]
            out[key(i["op_class"])]["calls"] += i["calls"]
        return dict(out)

    def to_json(self) -> dict:
        return {"engine": self.engine, "run_ms": round(self.run_ms, 4),
                "plain_run_ms": None if self.plain_run_ms is None else round(self.plain_run_ms, 4),
                "kernels_ms": round(self.kernels_ms(), 4),
                "items": [{**i, "ms": round(i["ms"], 5)} for i in sorted(self.items, key=lambda i: -i["ms"])]}


def conv_geometry(data: list[int], weight: list[int], out: list[int]) -> dict | None:
    """A convolution's geometry, the same in both engines' layouts (NCHW, or channels in blocks,
    NCHWc): channels, rows and columns in and out, kernel size and groups (the weight holds
    out-channels x in-channels per group x kernel, in any layout); None if the shapes are not
    a 2-D conv's."""
    if len(data) not in (4, 5) or len(out) not in (4, 5) or len(weight) < 4:
        return None
    h, w, ho, wo, kh, kw = data[2], data[3], out[2], out[3], weight[2], weight[3]
    if not all((h, w, ho, wo, kh, kw)):
        return None
    cin, cout = math.prod(data[1:]) // (h * w), math.prod(out[1:]) // (ho * wo)
    if not cin or not cout:
        return None
    per_group = math.prod(weight) // (cout * kh * kw)
    if not per_group or cin % per_group:
        return None
    return {"cin": cin, "h": h, "w": w, "cout": cout, "ho": ho, "wo": wo, "kh": kh, "kw": kw,
            "groups": cin // per_group}


def conv_flops(g: dict) -> float:
    """Multiply-adds x 2 of one call of a conv of geometry ``g``."""
    return 2.0 * g["cout"] * (g["cin"] // max(1, g["groups"])) * g["kh"] * g["kw"] * g["ho"] * g["wo"]


def conv_label(g: dict) -> str:
    """``in-channels x rows x columns -> out ... kernel``, and depthwise or the groups."""
    dw = " depthwise" if g["groups"] == g["cin"] and g["cin"] > 1 else (f" g{g['groups']}" if g["groups"] > 1 else "")
    return f"{g['cin']}x{g['h']}x{g['w']} -> {g['cout']}x{g['ho']}x{g['wo']} {g['kh']}x{g['kw']}{dw}"


def _tvm_conv(kernel: Kernel | None) -> dict | None:
    if kernel is None or "conv" not in kernel.anchor_op or "transpose" in kernel.anchor_op:
        return None
    if len(kernel.input_shapes) < 2:
        return None
    return conv_geometry(kernel.input_shapes[0], kernel.input_shapes[1], kernel.output_shape)


def _ort_conv(node: dict) -> dict | None:
    op, ins, outs = node.get("op") or "", node.get("inputs") or [], node.get("outputs") or []
    if "Conv" not in op or "Transpose" in op or len(ins) < 2 or not outs:
        return None
    return conv_geometry(ins[0], ins[1], outs[0])


def _conv_class(kind: str, kh: int | None, kw: int | None) -> str:
    return f"{kind} {kh}x{kw}" if kh and kw else kind


def tvm_class(name: str, kernel: Kernel | None = None) -> str:
    """The op class of a VM call: from its kernel's weight shape where known, else its name."""
    if name.startswith("vm.") or name.startswith("__"):
        return RUNTIME_CLASS
    kh = kw = None
    if kernel is not None and len(kernel.input_shapes) > 1 and len(kernel.input_shapes[1]) >= 4:
        kh, kw = kernel.input_shapes[1][2], kernel.input_shapes[1][3]
    n = name.lower()
    if "conv2d_transpose" in n:
        return "conv transpose"
    if "depthwise" in n or (kernel is not None and kernel.attrs.get("depthwise")):
        return _conv_class("depthwise", kh, kw)
    if "conv" in n:
        return _conv_class("conv", kh, kw)
    if re.search(r"matmul|dense", n):
        return "matmul"
    if re.search(r"pool|mean|reduce|_sum|^sum|_max\d*$|^max\d*$", n):
        return "pool/reduce"
    if re.search(r"layout_transform|transpose|reshape|concat|split|strided_slice", n):
        return "layout"
    return "other"


_ORT_MATMUL = {"MatMul", "Gemm", "FusedGemm", "FusedMatMul", "MatMulNBits", "MatMulInteger",
               "QLinearMatMul", "DynamicQuantizeMatMul", "Attention", "MultiHeadAttention"}
_ORT_LAYOUT = {"ReorderInput", "ReorderOutput", "Transpose", "Reshape", "Flatten", "Squeeze",
               "Unsqueeze", "Concat", "Split", "Slice"}


def ort_class(node: dict) -> str:
    """The op class of a profiled onnxruntime node (op type, input shapes)."""
    op, ins = node.get("op") or "", node.get("inputs") or []
    if "ConvTranspose" in op:
        return "conv transpose"
    if "Conv" in op:
        w = ins[1] if len(ins) > 1 else []
        x = ins[0] if ins else []
        if len(w) >= 4:
            cin = x[1] * x[4] if len(x) == 5 else (x[1] if len(x) >= 2 else 0)
            if w[1] == 1 and w[0] == cin and cin > 1:
                return _conv_class("depthwise", w[2], w[3])
            return _conv_class("conv", w[2], w[3])
        return "conv"
    if op in _ORT_MATMUL:
        return "matmul"
    if "Pool" in op or op.startswith("Reduce"):
        return "pool/reduce"
    if op in _ORT_LAYOUT:
        return "layout"
    return "other"


class _VMTimer:
    """The per-call times of one Relax VM (a second VM over the compiled library, so that the
    model's own VM runs without the hook)."""

    def __init__(self, compiled: CompiledModel, feed: dict[str, np.ndarray]):
        from tvm import relax

        self.vm = relax.VirtualMachine(compiled.lib, compiled.dev)
        self.args = compiled._args(feed)
        self.runs: list[dict[str, float]] = []  # per run: seconds per function
        self.calls: dict[str, int] = {}  # per function: calls in one run
        self.run_s: list[float] = []
        self._start = 0.0  # the VM's calls do not nest: one start at a time
        self._cur: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self.vm.set_instrument(self._hook)

    def _hook(self, func, name: str, before: bool, ret, *args) -> int:
        now = time.perf_counter()
        if before:
            self._start = now
        else:
            self._cur[name] = self._cur.get(name, 0.0) + now - self._start
            self._calls[name] = self._calls.get(name, 0) + 1
        return 0  # VMInstrumentReturnKind.kNoOp: run the call as usual

    def run(self, n: int, keep: bool = True) -> None:
        """``n`` runs; with ``keep=False`` (warm-up) none is recorded."""
        for _ in range(n):
            self._cur, self._calls = {}, {}
            t0 = time.perf_counter()
            self.vm["main"](*self.args)
            if keep:
                self.run_s.append(time.perf_counter() - t0)
                self.runs.append(self._cur)
                self.calls = self._calls


class _OrtTimer:
    """An onnxruntime session with its profiler on; the profile is read once, at the end."""

    def __init__(self, onnx_model, feed: dict[str, np.ndarray], threads: int | None = None):
        self.tmp = tempfile.mkdtemp(prefix="ttrank-ortprof-")
        self.sess = ort_session(onnx_model, threads, profile_prefix=os.path.join(self.tmp, "prof"))
        self.feed = feed
        self.warmup = 0
        self.run_s: list[float] = []

    def run(self, n: int, warmup: bool = False) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            self.sess.run(None, self.feed)
            if warmup:
                self.warmup += 1
            else:
                self.run_s.append(time.perf_counter() - t0)

    def nodes(self) -> list[dict]:
        try:
            path = self.sess.end_profiling()
            with open(path) as f:
                return ort_nodes(json.load(f), skip=self.warmup)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def ort_nodes(events: list[dict], skip: int = 0) -> list[dict]:
    """Per node of an onnxruntime profile (its JSON events): op, input and output shapes, and its
    median, mean and minimum ms, the first ``skip`` runs of each node left out (warm-up)."""
    nodes: dict[str, dict] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        a = e.get("args", {})
        name = e["name"][:-len("_kernel_time")]
        n = nodes.setdefault(name, {
            "node": name, "op": a.get("op_name"),
            "inputs": [list(next(iter(d.values()))) for d in a.get("input_type_shape", [])],
            "outputs": [list(next(iter(d.values()))) for d in a.get("output_type_shape", [])],
            "us": []})
        n["us"].append(float(e["dur"]))
    out = []
    for n in nodes.values():
        us = n.pop("us")[skip:] or [0.0]
        out.append({**n, "median_ms": statistics.median(us) / 1e3, "mean_ms": statistics.fmean(us) / 1e3,
                    "min_ms": min(us) / 1e3, "samples": len(us)})
    return out


def ort_profile(onnx_model, feed: dict, runs: int = 30, threads: int | None = None,
                warmup: int = 5) -> list[dict]:
    """Per node of onnxruntime's optimised graph, profiled over ``runs`` runs of ``onnx_model``
    (an onnx ModelProto) after ``warmup``: op, input shapes, median and min ms."""
    t = _OrtTimer(onnx_model, feed, threads)
    t.run(warmup, warmup=True)
    t.run(runs)
    return t.nodes()


# the pause before an engine's block of runs, for the other engine's worker threads to stop
# spinning, and the discarded runs that start each block
SETTLE_S = 0.05
WARMUP_RUNS = 2


def _plain_run_s(compiled: CompiledModel, feed: dict[str, np.ndarray], runs: int) -> list[float]:
    """Whole-run seconds of the model's own VM, without the hook."""
    args = compiled._args(feed)
    out = []
    for i in range(WARMUP_RUNS + runs):
        t0 = time.perf_counter()
        compiled.vm["main"](*args)
        if i >= WARMUP_RUNS:
            out.append(time.perf_counter() - t0)
    return out


def profile(model: LoadedModel, compiled: CompiledModel, kernels: Iterable[Kernel] = (),
            runs: int = 20, blocks: int = 2, onnxruntime: bool = True) -> dict[str, Profile]:
    """ttrank's (and onnxruntime's) in-model times over ``runs`` model runs each, the engines
    alternated in ``blocks`` (each after a pause and warm-up runs); ttrank's plain runs (no
    hook) are timed in the same blocks. ``kernels``: the model's kernels, to class convs by
    kernel size."""
    feed = model.random_inputs()
    by_name = {k.name: k for k in kernels}
    tv = _VMTimer(compiled, feed)
    # a model whose data-dependent end runs in onnxruntime (ttrank.partition) profiles the VM's
    # part only: onnxruntime's side is the same part, not the whole graph
    graph = model.tail.head if model.tail is not None else model.onnx_model
    ot = _OrtTimer(graph, {s.name: feed[s.name] for s in model.inputs}) if onnxruntime else None
    if ot is not None:  # its profile's first events per node are these (ort_nodes skips them)
        ot.run(WARMUP_RUNS, warmup=True)
    per = max(1, runs // blocks)
    plain: list[float] = []
    for _ in range(blocks):
        time.sleep(SETTLE_S)
        plain += _plain_run_s(compiled, feed, per)
        tv.run(WARMUP_RUNS, keep=False)
        tv.run(per)
        if ot is not None:
            time.sleep(SETTLE_S)
            ot.run(per)
    items = []
    for name in sorted({n for r in tv.runs for n in r}):
        items.append({"name": name, "op_class": tvm_class(name, by_name.get(name)),
                      "calls": tv.calls.get(name, 0),
                      "ms": 1e3 * statistics.fmean(r.get(name, 0.0) for r in tv.runs),
                      "conv": _tvm_conv(by_name.get(name))})
    out = {"ttrank": Profile("ttrank", 1e3 * statistics.fmean(tv.run_s), items, 1e3 * statistics.fmean(plain))}
    if ot is not None:
        nodes = ot.nodes()
        out["onnxruntime"] = Profile("onnxruntime", 1e3 * statistics.fmean(ot.run_s), [
            {"name": n["node"], "op_class": ort_class(n), "op": n["op"], "calls": 1, "ms": n["mean_ms"],
             "conv": _ort_conv(n)}
            for n in nodes])
    return out


def _coarse(op_class: str) -> str:
    """A conv class without its kernel size, depthwise or not."""
    return "conv" if op_class.startswith(("conv ", "depthwise")) and op_class != "conv transpose" else op_class


def class_table(profiles: dict[str, Profile]) -> list[dict]:
    """Per op class: each engine's in-model ms and calls per run, and ttrank / onnxruntime, the
    heaviest class first; the last rows are the time outside kernels and the whole run.

    Where some of ttrank's convs could not be sized (an untuned compile runs unfused kernels of
    other names than the extracted ones), both sides' convs are one class, so that the rows
    still compare like with like."""
    tt, ort_ = profiles["ttrank"], profiles.get("onnxruntime")
    a = tt.by_class()
    key = _coarse if "conv" in a or "depthwise" in a else str
    a, b = tt.by_class(key), (ort_.by_class(key) if ort_ else {})
    rows = []
    for c in sorted(set(a) | set(b), key=lambda c: -max(a.get(c, {}).get("ms", 0), b.get(c, {}).get("ms", 0))):
        x, y = a.get(c, {"ms": 0.0, "calls": 0}), b.get(c, {"ms": 0.0, "calls": 0})
        rows.append({"op_class": c, "ttrank_ms": x["ms"], "ttrank_calls": x["calls"],
                     "onnxruntime_ms": y["ms"] if ort_ else None, "onnxruntime_nodes": y["calls"],
                     "ratio": x["ms"] / y["ms"] if ort_ and y["ms"] > 0 else None})
    outside = {"op_class": "outside kernels", "ttrank_ms": max(0.0, tt.run_ms - tt.kernels_ms()),
               "onnxruntime_ms": max(0.0, ort_.run_ms - ort_.kernels_ms()) if ort_ else None}
    whole = {"op_class": "whole run", "ttrank_ms": tt.run_ms, "onnxruntime_ms": ort_.run_ms if ort_ else None}
    for r in (outside, whole):
        r["ratio"] = (r["ttrank_ms"] / r["onnxruntime_ms"]) if r["onnxruntime_ms"] else None
    return rows + [outside, whole]


def conv_table(profiles: dict[str, Profile]) -> list[dict]:
    """Per conv geometry: each engine's in-model ms per run and calls, GFLOP/s, and ttrank /
    onnxruntime, the largest gap (ttrank's ms over onnxruntime's) first. Only geometries both
    engines ran: a conv that one engine fused into something else has no partner."""
    sides: dict[str, dict[tuple, dict]] = {}
    for engine, prof in profiles.items():
        acc: dict[tuple, dict] = {}
        for i in prof.items:
            g = i.get("conv")
            if not g:
                continue
            a = acc.setdefault(tuple(sorted(g.items())), {"geometry": g, "ms": 0.0, "calls": 0, "names": []})
            a["ms"] += i["ms"]
            a["calls"] += i["calls"]
            a["names"].append(i["name"])
        sides[engine] = acc
    tt, ort_ = sides.get("ttrank", {}), sides.get("onnxruntime", {})
    rows = []
    for key in tt.keys() & ort_.keys():
        a, b = tt[key], ort_[key]
        flops = conv_flops(a["geometry"])
        rows.append({"conv": conv_label(a["geometry"]), "geometry": a["geometry"], "kernels": a["names"],
                     "ttrank_ms": a["ms"], "ttrank_calls": a["calls"], "onnxruntime_ms": b["ms"],
                     "onnxruntime_nodes": b["calls"],
                     "ttrank_gflops": flops * a["calls"] / a["ms"] / 1e6 if a["ms"] > 0 else None,
                     "onnxruntime_gflops": flops * b["calls"] / b["ms"] / 1e6 if b["ms"] > 0 else None,
                     "ratio": a["ms"] / b["ms"] if b["ms"] > 0 else None})
    return sorted(rows, key=lambda r: -(r["ttrank_ms"] - r["onnxruntime_ms"]))
