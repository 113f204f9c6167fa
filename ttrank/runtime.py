"""Whole models: compile (untuned or with a MetaSchedule database), export, run, time against
onnxruntime, check outputs, and write the database a compile reads."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckError, OutputError, TTRankError
from .frontend import LoadedModel
from .kernels import LAYOUT_FREE, mark_prepacked_weights
from .measure import WarmPoolBuilder
from .partition import Tail
from .target import cross_compiler, host_cores, is_foreign, provenance, runtime_threads
from .util import write_failure

log = logging.getLogger("ttrank")


def compile_model(model: LoadedModel, target, database=None,
                  compile_objects: Callable[[list, Any], list[str]] | None = None,
                  kept_objects: Callable[[list, Any], dict[str, str]] | None = None,
                  prepack: bool | None = None):
    """Compile with the default CPU pipeline, or with a MetaSchedule database's schedules.

    ``compile_objects(modules, target) -> object files`` (a build pool's): with a database, the
    kernels are compiled in parts, in parallel, and linked as static libraries; LLVM is most of a
    compile, and one module keeps it on one core. ``kept_objects((name, PrimFunc) list, target)
    -> {name: object file}`` (the pool's measured builds): those kernels are linked as they were
    measured, not compiled again. ``prepack``: mark the matmuls' weights layout-free
    (:func:`ttrank.kernels.mark_prepacked_weights`) as the database's workloads were; None: if
    any of them is (a MetaSchedule run's own database, or one written before the marking, has
    unmarked matmuls, which a marked model would leave untuned). The executable must then be
    exported to run.
    """
    import tvm

    if database is None:
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(model.mod, target=target)
    if prepack is None:
        prepack = has_prepacked_workloads(database)
    if compile_objects is None or host_cores() < 2:  # one core: the parts would only cost more
        return _compile_whole(model.mod, target, database, prepack)
    return _compile_in_parts(model.mod, target, database, compile_objects, kept_objects, prepack)


def has_prepacked_workloads(database) -> bool:
    """Whether any workload of a MetaSchedule ``database`` has buffers marked layout-free."""
    return any(LAYOUT_FREE in (func.attrs or {})
               for rec in database.get_all_tuning_records() for func in rec.workload.mod.functions.values())


def _database_pipeline(target, prepack: bool = True):
    """MetaSchedule's ``compile_relax`` pipeline (TVM 0.27), the same passes in the same order:
    the database's keys are the workloads as ``extract_tasks`` prepared them
    (:func:`ttrank.kernels.fuse`). With ``prepack``, a schedule that packs its matmul's weight
    has its packing split off and folded into the constant, as TVM's
    ``static_shape_tuning_pipeline(cpu_weight_prepack=True)`` does; the weights stay constants,
    so the library's interface is the model's."""
    import tvm
    from tvm import relax
    from tvm.relax import pipeline as rp

    t = relax.transform
    try:
        dispatch = rp.library_dispatch_passes(target)
    except (ValueError, AttributeError):
        dispatch = []
    try:
        lower, finalize = rp.dataflow_lower_passes(target), rp.finalize_passes(target)
    except (ValueError, AttributeError):  # CPU targets: compile_relax's own lists
        lower = [t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite()]
        finalize = [t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.KillAfterLastUse(),
                    t.LowerRuntimeBuiltin(), t.ComputePrimValue(), t.VMShapeLower(), t.AttachGlobalSymbol()]
    mark = [tvm.transform.module_pass(lambda mod, _ctx: mark_prepacked_weights(mod), opt_level=0,
                                      name="MarkPrepackedWeights")] if prepack else []
    # the packing (a block SplitLayoutRewritePreproc moves into a function of its own) runs on
    # the constant weight at compile time; DeadCodeElimination drops the function it leaves
    packed = [t.SplitLayoutRewritePreproc(), t.FoldConstant(), t.DeadCodeElimination()] if prepack else []
    return tvm.transform.Sequential([
        *dispatch, t.LegalizeOps(), t.AnnotateTIROpPattern(), t.FoldConstant(), t.FuseOps(), t.FuseTIR(),
        *mark, t.MetaScheduleApplyDatabase(), *packed, *lower, *finalize])


def _compile_in_parts(mod, target, database, compile_objects: Callable[[list, Any], list[str]],
                      kept_objects: Callable[[list, Any], dict[str, str]] | None = None, prepack: bool = True):
    """relax.build with its TIR half compiled in parts by ``compile_objects``, but for the kernels
    ``kept_objects`` already has; all join the executable as static libraries (TVM's ``_vmlink``
    does this for external modules)."""
    import tvm
    from tvm import relax
    from tvm.relax import vm_build

    with target, database, tvm.transform.PassContext(opt_level=3):
        lowered = _database_pipeline(target, prepack)(mod)
    ext_libs = list(lowered.attrs.get("external_mods", [])) if lowered.attrs else []
    constants = dict(lowered.attrs.get("const_name_to_constant", {})) if lowered.attrs else {}
    builder = relax.ExecBuilder()
    lowered = vm_build._vmcodegen(builder, lowered, "bytecode")
    tir = vm_build._auto_attach_system_lib_prefix(vm_build._filter_tir(lowered), target, None)
    funcs = list(tir.functions.items()) if tir is not None else []
    kept = kept_objects([(gv.name_hint, f) for gv, f in funcs], target) if kept_objects else {}
    if kept:
        log.info("linking %d of %d kernels as they were built for measuring", len(kept), len(funcs))
    funcs = [(gv, f) for gv, f in funcs if gv.name_hint not in kept]
    # more parts than workers, so that one part of big kernels does not leave a core idle
    n = min(len(funcs), 4 * host_cores())
    parts = [tvm.IRModule(dict(funcs[i::n]), attrs=tir.attrs) for i in range(n)]
    try:
        objects = compile_objects(parts, target)
    except Exception as e:  # a worker's failure: the one-process compile says what is wrong
        log.warning("compiling the kernels in parallel failed (%s); compiling them in one process",
                    str(e).splitlines()[-1] if str(e) else type(e).__name__)
        return _compile_whole(mod, target, database, prepack)
    libs = [tvm.runtime.load_static_library(o, [gv.name_hint for gv in part.get_global_vars()])
            for o, part in zip(objects, parts)]
    libs += [tvm.runtime.load_static_library(o, [name]) for name, o in kept.items()]
    return vm_build._vmlink(builder, target, None, ext_libs=[*ext_libs, *libs], params=constants)


def compile_in_parallel(model: LoadedModel, target, database, path: str | Path) -> Path:
    """Compile with a database on a pool of one build worker per core (its workers start while
    Relax's passes run) and export into a temp file beside ``path`` (returned: the caller
    renames it into place once it is checked). One process compiles when there is one core."""
    if host_cores() < 2:
        return export_staged(compile_model(model, target, database), path, target)
    builder = WarmPoolBuilder()
    warming = threading.Thread(target=builder.warm, daemon=True)
    warming.start()
    try:
        ex = compile_model(model, target, database, builder.compile_objects)
        return export_staged(ex, path, target)  # the parts' object files are linked here
    finally:
        warming.join()
        builder.close()


def _compile_whole(mod, target, database, prepack: bool = True):
    """MetaSchedule's own ``compile_relax`` with :func:`_database_pipeline`: the kernels in one
    LLVM module."""
    import tvm
    from tvm import relax

    with target, database, tvm.transform.PassContext(opt_level=3):
        return relax.build(mod, target=target, relax_pipeline=_database_pipeline(target, prepack))


def export(executable, path: str | Path) -> Path:
    """Export a compiled model to a shared library, atomically: when the write fails (full
    disk, read-only folder) an :class:`OutputError` says so and the previous file is intact."""
    path = Path(path)
    os.replace(export_staged(executable, path), path)
    return path


def export_staged(executable, path: str | Path, target=None) -> Path:
    """Export into a temp file beside ``path``, for the caller to rename into place (linked
    by the cross compiler when ``target`` is another architecture)."""
    path = Path(path)
    kept = f"; the previous {path.name} is left as it was" if path.exists() else ""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".so")
        os.close(fd)
        executable.export_library(tmp, fcompile=cross_compiler(target))
    except Exception as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        why = write_failure(e)
        if why is None:
            raise
        raise OutputError(f"cannot write {path}: {why}{kept}") from None
    return Path(tmp)


def tail_path(library: str | Path) -> Path:
    """Where the onnxruntime tail of a compiled library is written: beside it, NAME.tail.onnx."""
    library = Path(library)
    return library.with_name(f"{library.stem}.tail.onnx")


def stage_tail(model: LoadedModel, library: str | Path) -> Path | None:
    """``model``'s tail (ttrank.partition) in a temp file beside :func:`tail_path`, for the
    caller to rename into place with the library; None when the whole model is compiled."""
    if model.tail is None:
        return None
    dst = tail_path(library)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.stem}.", suffix=".onnx")
    with os.fdopen(fd, "wb") as f:
        f.write(model.tail.model.SerializeToString())
    return Path(tmp)


def drop_stale_tail(model: LoadedModel, library: str | Path) -> None:
    """After ``library`` was replaced by ``model`` compiled whole: the tail file an earlier
    library of that name had goes with it (nothing would run it, and it reads as this one's)."""
    if model.tail is None:
        tail_path(library).unlink(missing_ok=True)


class CompiledModel:
    """A compiled model loaded in a Relax VM."""

    def __init__(self, lib, inputs, tail: Tail | None = None):
        import tvm
        from tvm import relax

        self.dev = tvm.cpu()
        self.lib = lib  # a second VM over it can be instrumented (ttrank.profiling)
        self.vm = relax.VirtualMachine(lib, self.dev)
        self.inputs = inputs
        # the graph's data-dependent end, run by onnxruntime on what the VM returns
        self.tail = tail
        self._tail_session = ort_session(tail.model) if tail is not None else None

    @classmethod
    def load(cls, path: str | Path, model: LoadedModel) -> CompiledModel:
        import tvm

        return cls(tvm.runtime.load_module(str(path)), model.inputs, model.tail)

    @classmethod
    def from_executable(cls, executable, model: LoadedModel) -> CompiledModel:
        return cls(executable, model.inputs, model.tail)

    def _args(self, feed: dict[str, np.ndarray]):
        import tvm

        return [tvm.runtime.tensor(feed[s.name], self.dev) for s in self.inputs]

    def run_compiled(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The compiled part's outputs: the model's, or the values its tail reads (``tail.cut``)."""
        out = self.vm["main"](*self._args(feed))
        return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        got = self.run_compiled(feed)
        if self.tail is None:
            return got
        made = dict(zip(self.tail.cut, got))
        late = self._tail_session.run(None, {n: made[n] if n in made else feed[n] for n in self.tail.inputs})
        made.update(zip((v.name for v in self.tail.model.graph.output), late))
        return [made[n] for n in self.tail.outputs]

    def time_ms(self, feed: dict[str, np.ndarray], repeat: int = 5, min_repeat_ms: int = 200,
                budget_s: float = 20.0) -> float:
        """Minimum over repeats of the mean latency (ms), with time_evaluator. A first run gauges
        the model: a slow one (an untuned transformer takes minutes) gets fewer repeats, so
        timing stays near ``budget_s``."""
        if self.tail is not None:  # its end runs in onnxruntime: timed from Python
            timed = self.timer(feed, min_repeat_ms)
            return min(timed() for _ in range(repeat))
        self.vm.set_input("main", *self._args(feed))
        t0 = time.perf_counter()
        self.vm.invoke_stateful("main")
        first = time.perf_counter() - t0
        if repeat <= 1 and first > 1.0:  # seconds per run: warm-up effects are lost in it
            return 1e3 * first
        if first * repeat > budget_s:
            if first * 2 > budget_s:
                return 1e3 * first
            repeat, min_repeat_ms = max(1, int(budget_s / first) - 1), 0
        f = self.vm.time_evaluator("invoke_stateful", self.dev, number=1, repeat=repeat,
                                   min_repeat_ms=min_repeat_ms)
        return 1e3 * min(min(f("main").results), first)

    def timer(self, feed: dict[str, np.ndarray], min_repeat_ms: int = 200) -> Callable[[], float]:
        """A function that times one round (ms): the mean of back-to-back runs over at least
        ``min_repeat_ms`` (one run of a slower model). The inputs are set, and the model run
        once to warm up, here: rounds in alternation then pay for nothing but the runs."""
        if self.tail is not None:  # the VM, then onnxruntime on its outputs
            self.run(feed)
            return lambda: _round_ms(lambda: self.run(feed), min_repeat_ms)
        self.vm.set_input("main", *self._args(feed))
        self.vm.invoke_stateful("main")
        f = self.vm.time_evaluator("invoke_stateful", self.dev, number=1, repeat=1, min_repeat_ms=min_repeat_ms)
        return lambda: 1e3 * f("main").results[0]


def onnxruntime_session(model: LoadedModel, threads: int | None = None):
    return ort_session(model.onnx_model, threads)


def ort_session(onnx_model, threads: int | None = None, profile_prefix: str | None = None):
    """An onnxruntime CPU session of an ONNX ModelProto, with TVM's runtime threads; with
    ``profile_prefix``, its profiler writes there."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or runtime_threads()  # the same threads as TVM's runtime
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(onnx_model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def onnxruntime_reference(model: LoadedModel, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime_session(model).run(None, feed)


def _ort_round_ms(sess, feed: dict[str, np.ndarray], min_repeat_ms: int) -> float:
    """One round of an onnxruntime session (ms), as :meth:`CompiledModel.timer` times one."""
    return _round_ms(lambda: sess.run(None, feed), min_repeat_ms)


def _round_ms(run: Callable[[], object], min_repeat_ms: int) -> float:
    """One round (ms): the mean of back-to-back ``run()`` calls over at least ``min_repeat_ms``."""
    n, t0 = 0, time.perf_counter()
    while True:
        run()
        n += 1
        el = time.perf_counter() - t0
        if el * 1e3 >= min_repeat_ms:
            return 1e3 * el / n


# how many units of float16's precision (9.8e-4 near 1) a float16 output may be off
HALF_UNITS = 4


@dataclass
class CheckResult:
    max_abs_error: float
    max_rel_error: float
    outputs: int
    ok: bool
    atol: float
    rtol: float

    def to_json(self) -> dict:
        return self.__dict__.copy()


def check_outputs(got: list[np.ndarray], ref: list[np.ndarray], atol: float = 1e-3,
                  rtol: float = 1e-3) -> CheckResult:
    """Compare outputs; errors are scaled by each reference's magnitude for the verdict.

    A half-precision output is compared to within a few units of its own precision: rounded
    to float16 (a unit of 1e-3 near 1), one rounding apart already exceeds 1e-3."""
    if len(got) != len(ref):
        raise CheckError(f"compiled model has {len(got)} outputs, onnxruntime {len(ref)}")
    max_abs, max_rel, ok = 0.0, 0.0, True
    for g, r in zip(got, ref):
        r = np.asarray(r)
        if g.shape != r.shape:
            raise CheckError(f"output shape {g.shape} differs from onnxruntime's {r.shape}")
        err = float(np.max(np.abs(g.astype(np.float64) - r))) if g.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        units = HALF_UNITS * float(np.finfo(r.dtype).eps) if r.dtype == np.float16 else 0.0
        ok = ok and bool(np.allclose(g, r, atol=max(atol, units) * max(1.0, scale), rtol=max(rtol, units)))
    return CheckResult(max_abs, max_rel, len(got), ok, atol, rtol)


def check_against_onnxruntime(compiled: CompiledModel, model: LoadedModel, seed: int = 0,
                              atol: float = 1e-3, rtol: float = 1e-3) -> CheckResult:
    feed = model.random_inputs(seed)
    try:
        ref = onnxruntime_reference(model, feed) if model.tail is None else cut_reference(model, feed)
    except Exception as e:
        raise TTRankError(f"onnxruntime cannot run this model, so outputs cannot be checked: "
                          f"{str(e).splitlines()[0][:300]}") from None
    if model.tail is not None:
        # the tail is onnxruntime running the graph's own nodes: what the compiled part hands
        # it is what is checked (past it, a threshold or an NMS over near-equal scores turns a
        # 1e-6 difference into another box)
        return check_outputs(compiled.run_compiled(feed), ref, atol, rtol)
    return check_outputs(compiled.run(feed), ref, atol, rtol)


def cut_reference(model: LoadedModel, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's values for what ``model``'s compiled part hands its tail: computed by the
    file as given when it has them all (names survive the rewrites), else by the compiled
    part's own graph."""
    import onnx

    cut, graph = model.tail.cut, model.tail.head
    if set(cut) <= {o for n in model.onnx_model.graph.node for o in n.output}:
        graph = onnx.ModelProto()
        graph.CopyFrom(model.onnx_model)
        del graph.graph.output[:]
        graph.graph.output.extend(onnx.helper.make_empty_tensor_value_info(c) for c in cut)
    return ort_session(graph).run(cut, feed)


def host_cannot_time(target, remote: bool = False) -> str | None:
    """Why a whole-model time taken on this host would not be the target's (None: it would)."""
    if is_foreign(target):
        return f"the target is {target.attrs['mtriple']}, which this host cannot run"
    if remote:
        # the kernels were measured on the devices; the host's CPU is another machine's
        return "the kernels were measured on RPC devices, and this host is not one of them"
    return None


def model_latencies(model: LoadedModel, target, database=None, repeat: int = 3,
                    untuned: bool = True) -> dict:
    """Whole-model latency (ms): untuned, with the database, and onnxruntime, side by side."""
    feed = model.random_inputs()
    out: dict = {}
    if untuned:
        out["untuned"] = CompiledModel.from_executable(compile_model(model, target), model).time_ms(
            feed, repeat=repeat, min_repeat_ms=0)
    built = {}
    if database is not None:
        built["tuned"] = CompiledModel.from_executable(compile_model(model, target, database), model)
        out["check_max_abs_error"] = check_against_onnxruntime(built["tuned"], model).max_abs_error
    out.update(alternate_ms(model, built, rounds=repeat, min_repeat_ms=200))
    out["provenance"] = provenance(target)
    return out


def time_side_by_side(model: LoadedModel, target, databases: dict, rounds: int = 3,
                      onnxruntime: bool = True, min_repeat_ms: int = 300) -> dict[str, float]:
    """Whole-model latency (ms) of several builds, timed in alternation, min over rounds.

    ``databases``: label -> a MetaSchedule database, or None for the default (untuned) pipeline.
    """
    built = {label: CompiledModel.from_executable(compile_model(model, target, db), model)
             for label, db in databases.items()}
    return alternate_ms(model, built, rounds, onnxruntime, min_repeat_ms)


def alternate_ms(model: LoadedModel, built: dict[str, CompiledModel], rounds: int = 3,
                 onnxruntime: bool = True, min_repeat_ms: int = 300, max_rounds: int | None = None,
                 settle: float = 0.01) -> dict[str, float]:
    """Time compiled models (and onnxruntime) in alternation, min over rounds (ms): on a shared
    machine a slow stretch then hits every contender alike, not just the one timed in it.

    After ``rounds``, rounds go on (up to ``max_rounds``, default 3x ``rounds``) while the last
    ``rounds`` of them still lowered some contender's minimum by more than ``settle``: on a
    host whose neighbours come and go, each contender's minimum then comes from a quiet stretch
    (on one such host, five rounds gave minima up to 2x apart between two runs)."""
    feed = model.random_inputs()
    best: dict[str, float] = {}
    sess = onnxruntime_session(model) if onnxruntime else None
    max_rounds = max(rounds, max_rounds if max_rounds is not None else 3 * rounds)
    last_gain = -1  # the last round that lowered some minimum by more than ``settle``

    def keep(label: str, t: float, r: int) -> None:
        nonlocal last_gain
        if label in best and t < best[label] * (1 - settle):
            last_gain = r
        best[label] = min(best.get(label, t), t)

    timers = {label: cm.timer(feed, min_repeat_ms) for label, cm in built.items()}
    if sess is not None:
        sess.run(None, feed)  # warm-up
    for r in range(max_rounds):
        if r - last_gain > rounds:  # ``rounds`` rounds in a row lowered nothing much
            break
        for label, timed in timers.items():
            keep(label, timed(), r)
        if sess is not None:
            keep("onnxruntime", _ort_round_ms(sess, feed, min_repeat_ms), r)
    return best


def write_database(db_dir: Path, kernels, chosen: dict, target, latency_s: dict | None = None,
                   extra_db=None, extra_kernels: Collection[str] = ()):
    """A fresh JSONDatabase holding one record per chosen kernel (written beside, then swapped).

    ``chosen``: kernel name -> a transferred schedule (its ``trace``); ``latency_s``: kernel name
    -> its measured latency, the record's run time (1 s when unknown); ``extra_db``: a database
    whose best record stands for the kernels named in ``extra_kernels`` that nothing was chosen
    for. Only those: a search that found nothing faster than a kernel's default code still
    holds records of it (on rocketlake, a YOLO head's concat at 6.2 ms, against 1.4 untuned),
    and a record in the database replaces the default code."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    db_dir = Path(db_dir)
    tmp = db_dir.with_name(f".{db_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    db = ms.database.JSONDatabase(work_dir=str(tmp))
    for k in kernels:
        func = k.mod[[gv for gv in k.mod.functions][0]]
        if k.name in chosen:
            c = chosen[k.name]
            lat = (latency_s or {}).get(k.name, 1.0)
            wl = db.commit_workload(k.mod)
            db.commit_tuning_record(ms.database.TuningRecord(
                c.trace, wl, [float(lat)], target, ArgInfo.from_prim_func(func)))
        elif extra_db is not None and k.name in extra_kernels and extra_db.has_workload(k.mod):
            for rec in extra_db.get_top_k(extra_db.commit_workload(k.mod), 1):
                wl = db.commit_workload(k.mod)
                db.commit_tuning_record(ms.database.TuningRecord(
                    rec.trace, wl, rec.run_secs, target, ArgInfo.from_prim_func(func)))
    _swap_dir(tmp, db_dir)
    return ms.database.JSONDatabase(work_dir=str(db_dir))


def _swap_dir(src: Path, dst: Path) -> None:
    """Replace folder ``dst`` by ``src`` with renames (the old one is removed afterwards)."""
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
