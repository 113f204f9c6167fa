"""Whole-model compile, export, run, time, and check against onnxruntime."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .coverage import plan_missing
from .donors import user_donor_dir
from .errors import CheckError, OutputError, TTRankError
from .frontend import LoadedModel
from .target import cross_compiler, is_foreign
from .tune import tune
from .util import commit_moves, file_lock, finish_moves, write_failure

log = logging.getLogger("ttrank")

# candidates per measuring batch: enough to keep both build workers busy, few enough that an
# interruption loses little (each finished batch is appended to the measurement table)
MEASURE_CHUNK = 8
# recommend's default budget for tuning what no transferred schedule covers (seconds, all kernels)
TUNE_MISSING_SECONDS = 120.0


def compile_model(model: LoadedModel, target, database=None):
    """Compile with the default CPU pipeline, or with a MetaSchedule database's schedules."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    if database is None:
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(model.mod, target=target)
    return ms.relax_integration.compile_relax(database, model.mod, target, params=None)


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


class CompiledModel:
    """A compiled model loaded in a Relax VM."""

    def __init__(self, lib, inputs):
        import tvm
        from tvm import relax

        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(lib, self.dev)
        self.inputs = inputs

    @classmethod
    def load(cls, path: str | Path, model: LoadedModel) -> CompiledModel:
        import tvm

        return cls(tvm.runtime.load_module(str(path)), model.inputs)

    @classmethod
    def from_executable(cls, executable, model: LoadedModel) -> CompiledModel:
        return cls(executable, model.inputs)

    def _args(self, feed: dict[str, np.ndarray]):
        import tvm

        return [tvm.runtime.tensor(feed[s.name], self.dev) for s in self.inputs]

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.vm["main"](*self._args(feed))
        return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]

    def time_ms(self, feed: dict[str, np.ndarray], repeat: int = 5, min_repeat_ms: int = 200,
                budget_s: float = 20.0) -> float:
        """Minimum over repeats of the mean latency (ms), with time_evaluator. A first run gauges
        the model: a slow one (an untuned transformer takes minutes) gets fewer repeats, so
        timing stays near ``budget_s``."""
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


def onnxruntime_session(model: LoadedModel, threads: int | None = None):
    import onnxruntime as ort

    from .target import runtime_threads

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or runtime_threads()  # the same threads as TVM's runtime
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.onnx_model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def onnxruntime_reference(model: LoadedModel, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime_session(model).run(None, feed)


def _ort_time_ms(sess, feed: dict[str, np.ndarray], repeat: int, min_repeat_ms: int) -> float:
    """Minimum over repeats of the mean latency (ms) of an onnxruntime session."""
    sess.run(None, feed)
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:
            sess.run(None, feed)
            n += 1
            el = time.perf_counter() - t0
            if el * 1e3 >= min_repeat_ms:
                break
        best = min(best, el / n)
    return best * 1e3


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
    """Compare outputs; errors are scaled by each reference's magnitude for the verdict."""
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
        ok = ok and bool(np.allclose(g, r, atol=atol * max(1.0, scale), rtol=rtol))
    return CheckResult(max_abs, max_rel, len(got), ok, atol, rtol)


def check_against_onnxruntime(compiled: CompiledModel, model: LoadedModel, seed: int = 0,
                              atol: float = 1e-3, rtol: float = 1e-3) -> CheckResult:
    feed = model.random_inputs(seed)
    try:
        ref = onnxruntime_reference(model, feed)
    except Exception as e:
        raise TTRankError(f"onnxruntime cannot run this model, so outputs cannot be checked: "
                          f"{str(e).splitlines()[0][:300]}") from None
    return check_outputs(compiled.run(feed), ref, atol, rtol)


def model_latencies(model: LoadedModel, target, database=None, repeat: int = 3,
                    untuned: bool = True) -> dict:
    """Whole-model latency (ms): untuned, with the database, and onnxruntime, side by side."""
    from .target import provenance

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
                 onnxruntime: bool = True, min_repeat_ms: int = 300) -> dict[str, float]:
    """Time compiled models (and onnxruntime) in alternation, min over rounds (ms): on a shared
    machine a slow stretch then hits every contender alike, not just the one timed in it."""
    feed = model.random_inputs()
    best: dict[str, float] = {}
    sess = onnxruntime_session(model) if onnxruntime else None
    for _ in range(rounds):
        for label, cm in built.items():
            t = cm.time_ms(feed, repeat=1, min_repeat_ms=min_repeat_ms)
            best[label] = min(best.get(label, t), t)
        if sess is not None:
            t = _ort_time_ms(sess, feed, repeat=1, min_repeat_ms=min_repeat_ms)
            best["onnxruntime"] = min(best.get("onnxruntime", t), t)
    return best


# ============================================================================================
# recommend: rank -> measure top-k -> choose -> database -> compile -> check


@dataclass
class KernelReport:
    """What happened to one kernel in a recommend run."""

    name: str
    workload_class: str
    extents: list
    weight: int
    flops: float
    untuned_s: float | None = None
    status: str = "untuned"  # tuned / untuned / tuned-missing
    why: str = ""
    tuning: dict | None = None  # recommend's own MetaSchedule run: seconds, trials, before/after
    chosen: dict | None = None  # donor network, kernel, record, rank, score, latency_s, method
    candidates: int = 0  # compatible candidates ranked
    top_k: int = 0  # how many of them were to be measured
    measured: list = field(default_factory=list)  # per measured candidate: donor, rank, status, latency
    rejections: list = field(default_factory=list)  # (donor record, reason)

    @property
    def best_s(self) -> float | None:
        return self.chosen["latency_s"] if self.chosen else self.untuned_s

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Result:
    """The outcome of :func:`recommend`."""

    model: str
    kernels: list[KernelReport]
    database: str | None
    library: str | None
    model_latency_ms: dict
    max_abs_error_vs_onnxruntime: float | None
    search_seconds: dict
    target: str
    compiled: object = field(default=None, repr=False)
    provenance: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"model": self.model, "target": self.target, "database": self.database,
                "library": self.library, "model_latency_ms": self.model_latency_ms,
                "max_abs_error_vs_onnxruntime": self.max_abs_error_vs_onnxruntime,
                "search_seconds": self.search_seconds, "provenance": self.provenance,
                "kernels": [k.to_json() for k in self.kernels]}


def rank_kernel(kernel, store, ranker, exclude_networks=frozenset()) -> list:
    """Every compatible donor schedule for ``kernel``, scored and sorted best first (no measuring)."""
    import numpy as np

    from .features import vector, workload_features
    from .transfer import Candidate

    pairs = store.compatible(kernel, set(exclude_networks))
    if not pairs:
        return []
    tf = workload_features(kernel, "t")
    feats = [store.pair_features(kernel, w, r, tf) for w, r in pairs]
    scores = ranker.predict(np.asarray([vector(f) for f in feats], dtype=np.float32))
    cands = [Candidate(kernel, w, r, score=float(s), features=f)
             for (w, r), s, f in zip(pairs, scores, feats)]
    cands.sort(key=lambda c: -c.score)
    return cands


def second_stage(ranker, store, target, exclude_networks=frozenset()):
    """The ranker's second stage, if its evaluation enabled one: (blend weight, shortlist
    length, cost model, featurizer), else None. Leave-one-out runs get a cost model that never
    saw the excluded networks' tuning logs."""
    from .programs import DEFAULT_COST_MODEL, CostModel, Featurizer, cost_model_without

    st = ranker.metadata.get("stage2") or {}
    if not st.get("enabled"):
        return None
    if exclude_networks:
        cm = cost_model_without(exclude_networks, [Path(r.work_dir) for r in store.reports], target)
    else:
        path = Path(ranker.path).with_name(st["cost_model"]) if ranker.path else DEFAULT_COST_MODEL
        cm = CostModel.load(path)
    return float(st["weight"]), int(st["shortlist"]), cm, Featurizer(target)


def rerank_kernel(kernel, cands: list, stage, target) -> tuple[list, dict]:
    """Transfer the ranker's shortlist onto ``kernel``, score the programs with the cost model
    and reorder the shortlist by the blend. Returns (candidates, transferred by record id)."""
    import numpy as np

    from .programs import WIDTH, blend
    from .transfer import transfer

    weight, n, cost_model, featurizer = stage
    short = cands[:n]
    if len(short) < 2:
        return cands, {}
    done, vecs = {}, []
    for c in short:
        t = transfer(c.record, kernel, c.donor, target)
        t.score, t.features = c.score, c.features
        done[c.record.id] = t
        vecs.append(featurizer.of_module(t.mod) if t.ok else np.full(WIDTH, np.nan, dtype=np.float32))
    X = np.stack(vecs)
    cost = cost_model.predict(X).astype(np.float64)
    cost[np.isnan(X).any(axis=1)] = np.nan
    for c, v in zip(short, cost):
        c.cost_score = done[c.record.id].cost_score = None if np.isnan(v) else float(v)
    order = np.argsort(-blend(np.array([c.score for c in short]), cost, weight), kind="stable")
    return [short[i] for i in order] + cands[n:], done


def _cache_rows(path: Path) -> dict[tuple[str, str], dict]:
    from .collect import measurement_key
    from .util import read_jsonl

    return {measurement_key(r): r for r in read_jsonl(path)}


def recommend(model: LoadedModel, *, target=None, store=None, ranker=None, top_k: int | None = None,
              output: str | Path | None = None, database_dir: str | Path | None = None,
              runner=None, data_dir: str | Path | None = None, exclude_networks=frozenset(),
              tune_missing: float = TUNE_MISSING_SECONDS, check: bool = True, time_model: bool = True,
              untuned_run_limit_s: float = 15.0, minor_share: float = 0.002,
              measure_budget_s: float | None = None, on_progress=None) -> Result:
    """Transfer-tune ``model``: rank, measure the top-k per kernel, compile with the winners.

    ``top_k`` defaults to the k chosen when the ranker was trained (its metadata). Kernels
    under ``minor_share`` of the untuned model time (weight x untuned latency) get only their
    top-1 candidate: more could not move the model's latency by more than a fraction of that.
    With ``measure_budget_s``, measuring stops once that many seconds have gone (after at least
    one batch): candidates are measured by rank, every kernel's first before any kernel's second,
    and larger shares of the untuned model first, so a short budget still covers every kernel.
    Measurements are appended to ``data_dir/measurements/<model>.jsonl`` as they finish (the
    collector's format, so ``ttrank train`` learns from them), and a rerun reuses them.
    """
    from tvm.s_tir import meta_schedule as ms

    from . import kernels as kmod
    from .collect import UNTUNED, compact_provenance, is_current, same_cpu
    from .donors import DonorStore
    from .measure import Measurer, RunnerSpec
    from .ranker import Ranker, data_cpus
    from .target import make_target, provenance, target_key
    from .transfer import transfer
    from .util import append_jsonl, cache_dir

    t_start = time.time()
    runner = runner or RunnerSpec()
    # over RPC, by default the target the devices report (their CPU, not the host's)
    target = target if target is not None else make_target(runner.target() if runner.kind == "rpc" else None)
    store = store if store is not None else DonorStore.load()
    if not store.workloads:
        raise TTRankError("the donor store is empty: no donor schedules under datasets/donors/ "
                          "or added with `ttrank donors add DIR`")
    ranker = ranker if ranker is not None else Ranker.load()
    # the ranker's own choice: the k its leave-one-network-out evaluation found worth measuring
    top_k = top_k or int(ranker.metadata.get("top_k") or 3)
    # the measuring machine's CPU: over RPC, what the devices report, never the host's
    prov = compact_provenance(runner.provenance(target))
    tkey = target_key(target)
    data_dir = Path(data_dir) if data_dir else cache_dir() / "data"
    table = data_dir / "measurements" / f"{model.name}.jsonl"
    db_dir = Path(database_dir) if database_dir else (
        Path(output).with_suffix("") if output else data_dir / "databases" / model.name)
    # a run killed while replacing these outputs left its plan: finish it, so they agree again
    finish_moves(_commit_plan(db_dir))
    cached = {k: r for k, r in _cache_rows(table).items()
              if r.get("target_key", tkey) == tkey and same_cpu(r, prov)}

    def progress(phase: str, done: int, total: int, info: str = "") -> None:
        if on_progress:
            on_progress(phase, done, total, info)

    # 1-3: kernels and ranking
    t0 = time.time()
    kernels = [k for k in kmod.extract(model.mod, target)]
    reports: dict[str, KernelReport] = {}
    ranked: dict[str, list] = {}
    for i, k in enumerate(kernels):
        reports[k.name] = KernelReport(k.name, k.workload_class, k.extents, k.weight, k.flops)
        ranked[k.name] = rank_kernel(k, store, ranker, exclude_networks)
        reports[k.name].candidates = len(ranked[k.name])
        progress("ranking", i + 1, len(kernels), k.name)
    # the second stage (cost model on the transferred shortlist) runs per kernel below, once the
    # kernel's share of the model is known: minor kernels measure only their top-1
    stage2 = second_stage(ranker, store, target, exclude_networks)
    t_rank = time.time() - t0

    # 4-5: measure the top-k (plus the untuned kernel), keep the fastest correct one. The
    # candidates of all kernels go through the builder together, in chunks, so both build
    # workers stay busy; each chunk's rows are appended before the next starts (Ctrl-C keeps them).
    t0 = time.time()
    measurer = Measurer(target, runner)
    baseline = measurer.baseline()
    chosen: dict[str, object] = {}
    picked_of: dict[str, list] = {}
    fresh: dict[int, dict] = {}

    def untuned_row(k, m) -> dict:
        return {"network": model.name, "kernel": k.name, "workload": k.workload_hash,
                "class": k.workload_class, "record": UNTUNED, "status": m.status,
                "latency_s": m.latency_s, "reason": m.error[:300], "provenance": prov,
                "target_key": tkey}

    try:
        # every untuned kernel first (once each): their shares of the model decide how many
        # candidates each kernel gets, and their sum how the whole model can be timed
        need = [k for k in kernels if (k.workload_hash, UNTUNED) not in cached]
        for k, m in zip(need, baseline.measure([k.mod for k in need]) if need else []):
            row = cached[(k.workload_hash, UNTUNED)] = untuned_row(k, m)
            append_jsonl(table, row)
        for k in kernels:
            reports[k.name].untuned_s = cached[(k.workload_hash, UNTUNED)]["latency_s"]
        total = sum(k.weight * (reports[k.name].untuned_s or 0.0) for k in kernels)

        todo: list[tuple[object, object, int]] = []  # (kernel, transferred candidate, its place)
        shares: dict[str, float] = {}
        for k in kernels:
            rep = reports[k.name]
            if not ranked[k.name]:
                rep.why = "no compatible donor schedule"
                continue
            share = k.weight * rep.untuned_s / total if (rep.untuned_s and total) else 1.0
            rep.top_k = top_k if share >= minor_share else 1
            picked = []  # transfer in rank order until k candidates apply (a rejection costs little)
            shares[k.name] = share
            pre: dict = {}
            if stage2 and rep.top_k > 1:
                ranked[k.name], pre = rerank_kernel(k, ranked[k.name], stage2, target)
            for c in ranked[k.name]:
                if len(picked) >= rep.top_k:
                    break
                cached_row = cached.get((k.workload_hash, c.record.id))
                if cached_row is not None and is_current(cached_row, c.record):
                    if cached_row["status"] != "ok":
                        rep.rejections.append((c.record.id, cached_row.get("reason", cached_row["status"])))
                    picked.append((c, cached_row))
                    continue
                t = pre.get(c.record.id)
                if t is None:
                    t = transfer(c.record, k, c.donor, target)
                    t.score, t.features = c.score, c.features
                if not t.ok:
                    rep.rejections.append((c.record.id, t.reason))
                    continue
                picked.append((t, None))
                todo.append((k, t, len(picked) - 1))
            picked_of[k.name] = picked
            progress("transferring", len(picked_of), len(kernels), k.name)

        # every kernel's first candidate before any kernel's second; big shares of the model first
        todo.sort(key=lambda x: (x[2], -shares[x[0].name]))
        chunk = MEASURE_CHUNK
        parts: list[list] = []  # chunks handed to the measurer, not yet measured
        measured = 0

        def chunks():
            for s in range(0, len(todo), chunk):
                parts.append([(k, t) for k, t, _ in todo[s:s + chunk]])
                yield [t.mod for _, t in parts[-1]], [(k.mod, k.workload_hash) for k, _ in parts[-1]]

        # each chunk builds while the one before it runs; the budget is checked before each runs
        over = (None if measure_budget_s is None else lambda: time.time() - t0 > measure_budget_s)
        for results in measurer.measure_stream(chunks(), stop=over):
            part = parts.pop(0)
            measured += len(part)
            rows = []
            for (k, t), m in zip(part, results):
                r = {"network": model.name, "kernel": k.name, "workload": k.workload_hash,
                     "class": k.workload_class, "record": t.record.id,
                     "donor_network": t.donor.network, "donor_kernel": t.donor.kernel.name,
                     "donor_rank": t.record.rank, "record_hash": t.record.trace_hash,
                     "status": m.status if not m.ok else "ok",
                     "reason": m.error[:300], "latency_s": m.latency_s,
                     "untuned_s": reports[k.name].untuned_s, "method": t.method, "adapt": t.adapt,
                     "tile_changes": len(t.tile_changes), "score": t.score, "cost_score": t.cost_score,
                     "provenance": prov, "target_key": tkey}
                if m.devices:  # a fleet: which devices ran it
                    r["devices"] = m.devices
                rows.append(r)
                fresh[id(t)] = r
            append_jsonl(table, rows)
            progress("measuring", measured, len(todo), part[-1][0].name)
        unmeasured = len(todo) - measured

        for k in kernels:
            rep = reports[k.name]
            if k.name not in picked_of:
                continue
            best, waited = None, 0
            for rank_pos, (t, r) in enumerate(picked_of[k.name]):
                r = r or fresh.get(id(t))
                if r is None:  # its turn came after the measuring budget
                    waited += 1
                    continue
                rep.measured.append({"donor": t.record.id, "rank": rank_pos, "score": t.score,
                                     "cost_score": t.cost_score, "status": r["status"],
                                     "latency_s": r["latency_s"]})
                if r["status"] != "ok":
                    if (t.record.id, r.get("reason")) not in rep.rejections:
                        rep.rejections.append((t.record.id, r.get("reason") or r["status"]))
                    continue
                if best is None or r["latency_s"] < best[1]["latency_s"]:
                    best = (t, r, rank_pos)
            if best is None and waited and not rep.measured:
                rep.why = "the measuring budget ran out before its turn"
            elif best is None:
                rep.why = ("every measured candidate failed" if rep.measured else
                           "no candidate applied to this kernel")
            elif rep.untuned_s is not None and best[1]["latency_s"] >= rep.untuned_s:
                rep.why = "no candidate beat the untuned kernel"
            else:
                t, r, pos = best
                if t.trace is None:  # measured in an earlier run: re-apply (deterministic)
                    scores = t.score, t.cost_score
                    t = transfer(t.record, k, t.donor, target)
                    t.score, t.cost_score = scores
                if t.ok:
                    chosen[k.name] = t
                    rep.status = "tuned"
                    rep.chosen = {"donor_network": t.donor.network, "donor_kernel": t.donor.kernel.name,
                                  "record": t.record.id, "rank": pos, "score": t.score,
                                  "cost_score": t.cost_score, "latency_s": r["latency_s"], "method": t.method,
                                  "tile_changes": [c.to_json() for c in t.tile_changes]}
    finally:
        measurer.close()
    t_measure = time.time() - t0
    t_build, t_run = measurer.seconds["build"], measurer.seconds["run"]

    # MetaSchedule for what transfer left at the default schedule, when it matters: a budget
    # split by each kernel's share of the estimated model time. The records go to the user's
    # donor store, so the next model with such a kernel gets them by transfer, and a rerun of
    # this model reuses them instead of tuning again.
    t0 = time.time()
    # a kernel some donor was tuned on (this one's own earlier run, say) is not tuned again
    tuned_before = {w.kernel.workload_hash for w in store.workloads
                    if w.network not in exclude_networks}
    done = set(chosen) | {k.name for k in kernels if k.workload_hash in tuned_before}
    plans = plan_missing(kernels, {n: r.best_s for n, r in reports.items()}, done,
                         budget_s=tune_missing)
    extra_db = None
    if plans:
        work = user_donor_dir() / model.name
        for i, plan in enumerate(plans):
            k, t_k = plan.kernel, time.time()
            progress("tuning", i + 1, len(plans), k.name)
            # small batches, so that the budget is checked often. MetaSchedule appends to the
            # database itself: a second recommend of this model waits here (the lock `ttrank
            # tune` holds), then finds the trials done
            with file_lock(work / "tune"):
                run = tune(model.mod, work, trials_per_task=plan.trials, injective_trials=plan.trials,
                           budget_minutes=plan.seconds / 60, target=target, model_name=model.name,
                           only=[k.name], trials_per_iter=8,
                           # over RPC, tuned on the devices, with tune's own runner settings
                           runner=(dataclasses.replace(runner, number=3, repeat=1, min_repeat_ms=50)
                                   if runner.kind == "rpc" else None))
            extra_db = ms.database.JSONDatabase(work_dir=str(work))
            recs = extra_db.get_top_k(extra_db.commit_workload(k.mod), 1)
            rep = reports[k.name]
            best = min(float(x) for x in recs[0].run_secs) if recs else None
            wall = time.time() - t_k
            rep.tuning = {"seconds": round(wall, 1), "budget_s": round(plan.seconds, 1),
                          "search_seconds": round(wall - run.setup_s, 1), "setup_s": round(run.setup_s, 1),
                          "search_began_at": round(run.search_clock0, 3),  # on trials.jsonl's clock
                          "trials": plan.trials, "share": round(plan.share, 4),
                          "before_s": rep.best_s, "after_s": best, "work_dir": str(work)}
            if best is None or (rep.best_s is not None and best >= rep.best_s):
                rep.why = f"{rep.why}; MetaSchedule found nothing faster in {rep.tuning['seconds']:.0f} s"
            else:
                rep.status = "tuned-missing"
                rep.why = (f"tuned with MetaSchedule ({rep.tuning['seconds']:.0f} s): "
                           f"{rep.why or 'no transferred schedule'}")
                chosen.pop(k.name, None)
                rep.chosen = {"donor_network": "metaschedule", "donor_kernel": k.name,
                              "record": None, "rank": 0, "score": None, "latency_s": best,
                              "method": "tuned"}
    t_tune = time.time() - t0

    # 6: the MetaSchedule database
    t0 = time.time()
    # written beside the final place, and moved there only once the outputs check out
    staged = db_dir.with_name(f".{db_dir.name}.staged")
    database = write_database(staged, kernels, chosen, target, reports, extra_db)

    # 7-8: compile, export, check
    ex = compile_model(model, target, database)
    # another architecture: the host can neither load it, check it nor time it
    foreign = is_foreign(target)
    compiled = None if foreign else CompiledModel.from_executable(ex, model)
    max_err = None
    if check and not foreign:
        res = check_against_onnxruntime(compiled, model)
        max_err = res.max_abs_error
        if not res.ok:
            culprits = _find_culprits(model, target, db_dir, [k for k in kernels if k.name in chosen],
                                      chosen, reports, extra_db)
            import shutil

            shutil.rmtree(staged, ignore_errors=True)
            raise CheckError(f"compiled outputs differ from onnxruntime (max abs error "
                             f"{res.max_abs_error:.3g}); kernels at fault: {', '.join(culprits)}; "
                             f"no database or library was written")
    # the database and the library replace the previous ones as one step (a kill between the
    # renames is finished by the next run): never a database of one run beside another's library
    moves = [(staged, db_dir)]
    try:
        if output:
            moves.append((export_staged(ex, output, target), Path(output)))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    commit_moves(moves, _commit_plan(db_dir))
    library = str(output) if output else None
    t_compile = time.time() - t0

    lat = {}
    if time_model and not foreign:
        feed = model.random_inputs()
        lat["untuned_estimated_from_kernels"] = 1e3 * sum(
            r.weight * r.untuned_s for r in reports.values() if r.untuned_s)
        complete = all(r.untuned_s for r in reports.values())
        # the whole untuned model is timed once when that is cheap; else the kernel sum stands in
        if complete and lat["untuned_estimated_from_kernels"] <= 1e3 * untuned_run_limit_s:
            progress("timing", 0, 1, "untuned model")
            lat["untuned"] = CompiledModel.from_executable(compile_model(model, target), model).time_ms(
                feed, repeat=1, min_repeat_ms=0)
            lat["untuned_source"] = "measured"
        else:
            lat["untuned"] = lat["untuned_estimated_from_kernels"]
            lat["untuned_source"] = "sum of untuned kernels"
        side = alternate_ms(model, {"tuned": compiled}, rounds=5, min_repeat_ms=200)
        lat["tuned"], lat["onnxruntime"] = side["tuned"], side["onnxruntime"]
        progress("timing", 1, 1, "")
    return Result(model.name, list(reports.values()), str(db_dir), library, lat, max_err,
                  {"ranking": round(t_rank, 2), "measuring": round(t_measure, 2),
                   "measuring_build": round(t_build, 2), "measuring_run": round(t_run, 2),
                   "tuning_missing": round(t_tune, 2), "compiling": round(t_compile, 2),
                   "total": round(time.time() - t_start, 2)},
                  str(target), compiled, {**provenance(target), "fast_math": model.fast_math,
                                          "top_k": top_k, "minor_share": minor_share,
                                          "ranker_data_cpus": data_cpus(ranker.metadata),
                                          "measure_budget_s": measure_budget_s,
                                          "candidates_left_unmeasured": unmeasured})


def write_database(db_dir: Path, kernels, chosen: dict, target, reports=None, extra_db=None):
    """A fresh JSONDatabase holding one record per chosen kernel (written beside, then swapped)."""
    import shutil

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
            lat = (reports[k.name].chosen or {}).get("latency_s", 1.0) if reports else 1.0
            wl = db.commit_workload(k.mod)
            db.commit_tuning_record(ms.database.TuningRecord(
                c.trace, wl, [float(lat)], target, ArgInfo.from_prim_func(func)))
        elif extra_db is not None and extra_db.has_workload(k.mod):
            for rec in extra_db.get_top_k(extra_db.commit_workload(k.mod), 1):
                wl = db.commit_workload(k.mod)
                db.commit_tuning_record(ms.database.TuningRecord(
                    rec.trace, wl, rec.run_secs, target, ArgInfo.from_prim_func(func)))
    _swap_dir(tmp, db_dir)
    return ms.database.JSONDatabase(work_dir=str(db_dir))


def _commit_plan(db_dir: Path) -> Path:
    """Where a recommend run writes its plan for replacing its outputs (see commit_moves)."""
    return db_dir.with_name(f".{db_dir.name}.commit.json")


def _swap_dir(src: Path, dst: Path) -> None:
    """Replace folder ``dst`` by ``src`` with renames (the old one is removed afterwards)."""
    import shutil

    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _find_culprits(model, target, db_dir: Path, tuned_kernels, chosen, reports, extra_db) -> list[str]:
    """Bisect the transferred kernels for the ones that change the model's outputs."""
    suspects = list(tuned_kernels)
    probe = db_dir.with_name(f".{db_dir.name}.probe")

    def bad(subset) -> bool:
        db = write_database(probe, subset, {k.name: chosen[k.name] for k in subset}, target, reports)
        cm = CompiledModel.from_executable(compile_model(model, target, db), model)
        return not check_against_onnxruntime(cm, model).ok

    try:
        if not suspects:
            return ["(none transferred: the untuned model itself differs)"]
        while len(suspects) > 1:
            half = suspects[: len(suspects) // 2]
            suspects = half if bad(half) else suspects[len(suspects) // 2:]
        return [suspects[0].name]
    except Exception:
        return [k.name for k in tuned_kernels]
    finally:
        import shutil

        shutil.rmtree(probe, ignore_errors=True)
