"""``recommend``: the stages of transfer-tuning composed, each handing its result to the next.

kernels -> rank (ranker, second stage) -> shortlist per kernel (transfer) -> measure (budgeted,
appended to the measurement table) -> choose -> tune what transfer left untuned -> database ->
compile -> check against onnxruntime -> time. Each stage lives in its own module; this one
only wires them, keeps the per-kernel report and replaces the outputs as one step.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tvm.s_tir import meta_schedule as ms

from . import measurements
from .coverage import TuningPlan, plan_missing, plan_refine
from .donors import DonorStore, tuned_here_dir, user_donor_dir
from .errors import CheckError, TTRankError
from .features import parse_trace
from .fleet import last_line
from .frontend import LoadedModel
from .kernels import Kernel, model_kernels
from .measure import COLD_CACHE, Measurer, RunnerSpec
from .measurements import UNTUNED, compact_provenance, is_current, same_cpu
from .ranker import Ranker, data_cpus
from .ranking import (Candidate, FixedK, Pick, SecondStage, native_candidate, policy_of, rank_kernel, same_anchor,
                      shortlist)
from .runtime import (CompiledModel, alternate_ms, check_against_onnxruntime, compile_model, export_staged,
                      drop_stale_tail, stage_tail, tail_path, write_database)
from .space import SMALL_SPACE_DRAWS, SPACE_NETWORK, draw_seconds, small_space, space_candidates
from .templates import template_candidates
from .target import (ForeignLoad, cpu_description, cpu_family, host_cores, host_mcpu, is_foreign, make_target, provenance,
                     target_key)
from .training import ranker_without
from .transfer import Transferred, postprocessors, transfer
from .tune import TUNING_PROTOCOL, Seed, fit_search, tune
from .util import (STOP_REQUESTED, append_jsonl, cache_dir, commit_moves, file_lock, finish_moves, read_jsonl,
                   stop_at_safe_points)
from .workdir import WORKLOAD_FILE, open_database, write_loaded_as

# candidates per measuring batch: a batch's builds end with its slowest one, while the other
# workers idle, so a batch needs many builds per worker (R18's 70 candidates, simulated from
# their compile times on 2 workers: 8 per batch lose 22% to that wait, 16 lose 5%), and few
# enough that an interruption loses little (each finished batch is appended to the table)
MEASURE_CHUNK = 16

# recommend's own tuning cuts off a trial that runs this many times the kernel's best latency
# known (per call), after at least TRIAL_TIMEOUT_FLOOR_S: MetaSchedule's space for a [40, 6625]
# softmax (untuned 2.7 ms) holds schedules of 2.1 s a call and more, and one batch of 8 trials
# with one of each took 54 s of a 20 s budget, 30 of them the runner's timeout.
TRIAL_TIMEOUT_FACTOR = 10.0
TRIAL_TIMEOUT_FLOOR_S = 3.0
# recommend's default budget for native search (seconds, all kernels): first for what no
# transferred schedule covers, then, with what that left, for the heaviest transferred kernels
TUNE_MISSING_SECONDS = 120.0
# what the search past a transferred schedule must gain to replace it: its best is one minimum
# among many close mutants of that schedule, the transferred one's is of a few rounds
REFINE_MARGIN = 0.03
# the least a search past a transferred schedule is started with
REFINE_MIN_S = 30.0
# a matmul whose transfer seeds no search is searched from MetaSchedule's own samples only below
# this share of the FLOP rate the model's fastest kernel reaches: ConvNeXt-T's matmuls at 0.40
# and 0.57 of it gained 24% and 15% in 33-37 s, one at 0.72 and ViT-B/32's at 0.97 nothing
# (znver3)
UNSEEDED_REFINE_RATE = 0.75
# its searches measure batches of this many trials, checking the budget after each; the first
# batch's generation (which nothing interrupts) may take this share of a search's budget: the
# rest builds and measures it. YOLOv5's fused box decoding, at MetaSchedule's full population,
# generated its first batch in 340 s against a 22 s budget
MISSING_BATCH = 8
FIRST_BATCH_SHARE = 0.7
# candidates measured for a kernel whose anchor computation (a conv, a matmul) a heavier kernel of
# the model shares, fused with another epilogue: the heavier one's fastest. Such siblings rank the
# same schedules the same: R18 on znver1, 22 schedules measured on both of a pair ran within 0-8%
# of each other (median 1%), and 3 of the 4 pairs chose the same schedule.
SIBLING_K = 1
# a record whose program took longer than this to compile on its own workload (its set's
# build_seconds.json, bench/build_seconds.py) is measured only as its kernel's first pick: on
# znver2, three builds of one ResNet-50 record family (7 s to compile, 10 s with the output
# check, where the rest take 0.1-0.4 s) were 30 of ResNet-18's 54 s of search
SLOW_BUILD_S = 4.0
# the command line's default measuring budget: 3 minutes on 2 cores for ResNet-50
MEASURE_SECONDS = 120.0
# candidates measured next, in rank order, for a kernel whose picks all failed or lost to its
# untuned kernel: the ranker's top was wrong for this CPU, and its next often is not. On rocketlake
# an EfficientNet-B4 depthwise conv (stride 2) measured one pick, 0.441 ms against 0.369 untuned,
# and stayed untuned; the candidate ranked next in another run ran 0.028 ms.
SECOND_LOOK = 3
# the most template schedules (:func:`ttrank.templates.tiles`) measured beside a packed conv's
# picks: one fewer than its policy's bound, so a kernel the policy gives one candidate gets none
TEMPLATE_TILES = 3

Progress = Callable[[str, int, int, str], None]


@dataclass
class KernelReport:
    """What happened to one kernel in a recommend run."""

    name: str
    workload_class: str
    extents: list
    weight: int
    flops: float
    untuned_s: float | None = None
    status: str = "untuned"  # tuned / untuned / tuned-missing / refined
    why: str = ""
    tuning: dict | None = None  # recommend's own MetaSchedule run: seconds, trials, before/after
    chosen: dict | None = None  # donor network, kernel, record, rank, score, latency_s, method
    candidates: int = 0  # compatible candidates ranked
    top_k: int = 0  # the most the policy measures for a kernel of this share of the model
    k: int = 0  # how many the policy chose to measure (the ranker's confidence, the share)
    beside: list = field(default_factory=list)  # record ids measured besides the k (a schedule
    # tuned on this CPU that the ranker left out)
    sibling_of: str = ""  # the heavier kernel of the same anchor whose fastest candidates it measured
    second_look: int = 0  # candidates measured after its first picks all failed or lost to untuned
    late_picks: int = 0  # candidates added once the model as tuned so far showed its share bigger
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
    # the model's estimated latency (sum of weight x best kernel so far) after the untuned
    # kernels, after each measured batch and after tuning: what more time bought, and would buy
    anytime: list[dict] = field(default_factory=list)
    # the graph's data-dependent end, run by onnxruntime after the library (ttrank.partition):
    # the ops that start it, its nodes and its file
    onnxruntime_tail: dict | None = None

    def to_json(self) -> dict:
        return {"model": self.model, "target": self.target, "database": self.database,
                "library": self.library, "onnxruntime_tail": self.onnxruntime_tail,
                "model_latency_ms": self.model_latency_ms,
                "max_abs_error_vs_onnxruntime": self.max_abs_error_vs_onnxruntime,
                "search_seconds": self.search_seconds, "anytime": self.anytime,
                "provenance": self.provenance, "kernels": [k.to_json() for k in self.kernels]}




def recommend(model: LoadedModel, *, target=None, store: DonorStore | None = None,
              ranker: Ranker | None = None, top_k: int | None = None,
              output: str | Path | None = None, database_dir: str | Path | None = None,
              runner: RunnerSpec | None = None, data_dir: str | Path | None = None,
              exclude_networks=frozenset(), leave_one_out: bool = False,
              tune_missing: float = TUNE_MISSING_SECONDS, refine: bool = True,
              check: bool = True, time_model: bool = True,
              time_untuned: bool = False, untuned_run_limit_s: float = 15.0, minor_share: float = 0.002,
              measure_budget_s: float | None = None, on_progress: Progress | None = None,
              on_note: Callable[[str], None] | None = None, policy: FixedK | None = None,
              adaptive: bool = True) -> Result:
    """Transfer-tune ``model``: rank, measure the top candidates per kernel, compile with the winners.

    How many candidates a kernel gets is ``policy``'s (:mod:`ttrank.ranking`); by default
    :class:`~ttrank.ranking.AdaptiveK`: the candidates the ranker cannot tell from its top-1, at
    most ``top_k`` (default: the k chosen when the ranker was trained, its metadata), fewer for
    kernels with a small share of the untuned model time (weight x untuned latency), and only
    the top-1 under ``minor_share``: more could not move the model's latency by more than a
    fraction of that. ``adaptive=False``: ``top_k`` for every kernel over ``minor_share``.
    With ``measure_budget_s``, measuring stops once that many seconds have gone (after at least
    one batch): candidates are measured by rank, every kernel's first before any kernel's second,
    and larger shares of the untuned model first, so a short budget still covers every kernel.
    Measurements are appended to ``data_dir/measurements/<model>.jsonl`` as they finish (the
    collector's format, so ``ttrank train`` learns from them), and a rerun reuses them.
    ``leave_one_out``: ignore the donors of the model's own network, and refit the ranker
    without its measurements (for evaluation). ``on_note`` receives one-line notes for the user.
    ``time_untuned``: also compile and time the untuned model (else the sum of its measured
    kernels stands in, as the report says).
    """
    t_start = time.time()
    note = on_note or (lambda line: None)

    def progress(phase: str, done: int, total: int, info: str = "") -> None:
        if on_progress:
            on_progress(phase, done, total, info)

    runner = runner or RunnerSpec(**COLD_CACHE)
    # over RPC, by default the target the devices report (their CPU, not the host's)
    target = target if target is not None else make_target(runner.target() if runner.kind == "rpc" else None)
    store = store if store is not None else DonorStore.load()
    if not store.workloads:
        raise TTRankError("the donor store is empty: no donor schedules under datasets/donors/ "
                          "or added with `ttrank donors add DIR`")
    ranker = ranker if ranker is not None else Ranker.load()
    # the store, the ranker and TVM are a million objects that live as long as the process:
    # frozen, the collector stops rescanning them (8 full collections and 4.8 s of ResNet-18's
    # run). Once per process: a later run's garbage is the collector's again
    if not gc.get_freeze_count():
        gc.freeze()
    exclude_networks = set(exclude_networks)
    t_refit = 0.0
    if leave_one_out:
        exclude_networks.add(model.name)
        if model.name in ranker.metadata.get("training_networks", []):
            note(f"leave-one-out: refitting the ranker without {model.name}'s measurements")
            t0 = time.time()
            ranker = ranker_without(model.name, ranker, store)
            t_refit = time.time() - t0
    if runner.kind == "local" and (why := cpu_mismatch(ranker, target, top_k)):
        note(why)
    # at most the k the ranker's leave-one-network-out evaluation found worth measuring
    policy = policy or policy_of(ranker, top_k, minor_share, adaptive)
    top_k = policy.max_k
    # the measuring machine's CPU: over RPC, what the devices report, never the host's
    prov = compact_provenance(runner.provenance(target))
    if runner.cache_flush:  # cold-cache latencies are not warm ones: rows say which they are
        prov["cache_flush"] = True
    cpu = cpu_description(prov)  # what the ranker's CPU features read
    tkey = target_key(target)
    data_dir = Path(data_dir) if data_dir else cache_dir() / "data"
    table = data_dir / "measurements" / f"{model.name}.jsonl"
    db_dir = Path(database_dir) if database_dir else (
        Path(output).with_suffix("") if output else data_dir / "databases" / model.name)
    # a run killed while replacing these outputs left its plan: finish it, so they agree again
    finish_moves(_commit_plan(db_dir))
    # the last row of a key counts; one measured on a busy machine is measured again
    rows = {measurements.key(r): r for r in read_jsonl(table) if not measurements.disturbed(r)}
    cached = {key: r for key, r in rows.items() if r.get("target_key", tkey) == tkey and same_cpu(r, prov)}

    # the build and run workers start while the kernels are ranked (Measurer.warm)
    measurer = Measurer(target, runner)
    try:  # the build pool compiles the model's kernels at the end, in parallel; then it closes
        measurer.warm()
        # 1-3: kernels and ranking. The second stage (cost model on the transferred shortlist) runs
        # per kernel below, once the kernel's share of the model is known: minor kernels get top-1
        t0 = time.time()
        kernels = model_kernels(model, target)
        # the table's rows are training data (ttrank train) only with their kernels described
        measurements.write_kernels(table.parent / "kernels" / f"{model.name}.json", kernels)
        reports: dict[str, KernelReport] = {}
        ranked: dict[str, list[Candidate]] = {}
        for i, k in enumerate(kernels):
            reports[k.name] = KernelReport(k.name, k.workload_class, k.extents, k.weight, k.flops)
            ranked[k.name] = rank_kernel(k, store, ranker, exclude_networks, cpu)
            reports[k.name].candidates = len(ranked[k.name])
            progress("ranking", i + 1, len(kernels), k.name)
        stage2 = SecondStage.of(ranker, store, target, exclude_networks)
        t_rank = time.time() - t0

        # 4-5: measure the top-k (plus the untuned kernel), keep the fastest correct one. The
        # candidates of all kernels go through the builder together, in chunks, so both build
        # workers stay busy; over RPC each chunk builds while the one before it runs (locally the
        # builds would skew the timed runs: Measurer.measure_stream), and each chunk's rows
        # are appended as it finishes (Ctrl-C keeps them).
        t0 = time.time()
        phases: dict[str, float] = {}  # the measuring phase's parts
        stamp = {"provenance": prov, "target_key": tkey}  # what every row of this run carries
        # the first Ctrl-C stops after the batch being measured (its rows are kept); raised inside
        # the measurer's worker pools it could leave one hung on its lock (ttrank.util)
        with stop_at_safe_points():
            chosen, unmeasured, anytime = _measure(
                model, kernels, ranked, reports, policy, stage2, cached, target, measurer, table, stamp,
                measure_budget_s, t0, t_start, progress, phases, store.build_seconds())
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        t_measure = time.time() - t0
        busiest = measurer.busiest()
        if busiest is not None and busiest.cores >= measurements.disturbed_limit():
            note(f"other work took {busiest.others:.1f} cores (other virtual machines {busiest.steal:.1f}) "
                 "while candidates ran: their timings may be skewed, so those rows are neither reused "
                 "nor learned from; rerun on a quiet machine")
        t_build, t_run = measurer.seconds["build"], measurer.seconds["run"]
        if (busy := measurer.build_busy_s) is not None:
            phases["measuring_build_busy"] = round(busy, 2)
        t0 = time.time()
        extra_db = _tune_missing(model, kernels, store, exclude_networks, chosen, reports, tune_missing,
                                 target, progress, runner)
        t_tune = time.time() - t0
        if extra_db is not None:  # what tuning the missing kernels bought, on the same curve
            anytime.append(_after_search("tuned missing", t_start, anytime, reports))
        t0 = time.time()
        # what the kernels no donor covers left of the native budget: the heaviest transferred
        # ones, searched further from their schedules
        refined_db = (_refine(model, kernels, store, exclude_networks, chosen, reports, tune_missing - t_tune,
                              target, progress, runner) if refine else None)
        t_refine = time.time() - t0
        if refined_db is not None:
            extra_db = refined_db  # the same tuned-here folder: it holds both searches' records
            anytime.append(_after_search("refined", t_start, anytime, reports))

        # 6-8: the database, compile, export, check; the outputs replace the old ones as one step
        t0 = time.time()
        compiled, max_err = _build(model, target, db_dir, output, kernels, chosen, reports, extra_db, check,
                                   measurer.compile_objects, measurer.kept_objects)
        t_compile = time.time() - t0
    finally:
        measurer.close()

    # another architecture (compiled is None): the host can neither load the model nor time it
    t0 = time.time()
    lat = (_time(model, target, compiled, reports, untuned_run_limit_s if time_untuned else 0.0, progress)
           if time_model and compiled is not None else {})
    t_time = time.time() - t0
    if measurements.disturbed(lat):
        f = lat["foreign_load"]
        note(f"other work took {f['others']:.1f} cores (other virtual machines {f['steal']:.1f}) while the "
             "model was timed: its latencies may be skewed")
    return Result(model.name, list(reports.values()), str(db_dir), str(output) if output else None, lat,
                  max_err, {"ranking": round(t_rank, 2),
                            **({"refitting_ranker": round(t_refit, 2)} if t_refit else {}),
                            "measuring": round(t_measure, 2), **phases,
                            "measuring_build": round(t_build, 2), "measuring_run": round(t_run, 2),
                            "tuning_missing": round(t_tune, 2), "refining": round(t_refine, 2),
                            "compiling": round(t_compile, 2),
                            "timing": round(t_time, 2), "total": round(time.time() - t_start, 2)},
                  str(target), compiled, {**provenance(target), "fast_math": model.fast_math, "layout": model.layout,
                                          "top_k": top_k, "minor_share": policy.minor_share,
                                          **({"foreign_load_max": busiest.to_json()} if busiest else {}),
                                          "policy": policy.to_json(),
                                          "ranker_data_cpus": data_cpus(ranker.metadata),
                                          "ranker_own_cpu": cpu["mcpu"] if cpu["mcpu"] in ranker.own_cpus() else None,
                                          "ranker_family": (cpu_family(cpu["mcpu"])
                                                            if cpu["mcpu"] in ranker.family_cpus() else None),
                                          "measure_budget_s": measure_budget_s,
                                          "candidates_left_unmeasured": unmeasured},
                  anytime, model.tail and {"ops": model.tail.ops, "nodes": model.tail.nodes,
                                           "file": str(tail_path(output)) if output else None})


def cpu_mismatch(ranker: Ranker, target, top_k: int | None = None) -> str:
    """A note when the ranker learned on other CPUs than the target's ("" when it did not):
    rankings carry over between x86 CPUs, and what is measured here decides the winner."""
    trained = data_cpus(ranker.metadata)
    if not trained or target.attrs.get("mcpu") in trained:
        return ""
    return (f"note: the ranker learned from measurements on {', '.join(trained)}; this CPU is "
            f"{target.attrs.get('mcpu') or host_mcpu()}. Up to {top_k or ranker.metadata.get('top_k', 3)} of its "
            "candidates per kernel are measured here; `ttrank adapt --budget-minutes 60` tunes "
            "the common kernels natively on this CPU and teaches the ranker its rows.")


def _measure(model: LoadedModel, kernels: list[Kernel], ranked: dict[str, list[Candidate]],
             reports: dict[str, KernelReport], policy: FixedK, stage2: SecondStage | None, cached: dict,
             target, measurer: Measurer, table: Path, stamp: dict, budget_s: float | None, t0: float,
             t_start: float, progress: Progress, phases: dict[str, float],
             build_s: dict[str, float] | None = None):
    """Steps 4-5: the untuned kernels, then each kernel's shortlist, measured; the fastest correct
    pick per kernel. Returns (chosen, candidates left unmeasured, the anytime curve); the seconds
    of its first two parts go to ``phases``. ``build_s``: records' compile seconds by trace hash
    (:data:`SLOW_BUILD_S`)."""
    t = time.time()
    _measure_untuned(model.name, kernels, measurer, cached, table, reports, stamp)
    phases["measuring_untuned"] = round(time.time() - t, 2)
    t = time.time()
    picks: dict[str, list[Pick] | None] = {}
    shares: dict[str, float] = {}
    leads = _sibling_leads(kernels, reports, ranked)
    drawn: dict[tuple[str, int], list[Candidate]] = {}  # design-space draws, drawn once per run
    first = [k for k in kernels if k.name not in leads]
    postprocessors(target)  # initialised once, before the threads share them

    def lists(ks: list[Kernel]) -> None:
        # a transfer is TVM's C++ (replay, postprocessors, features; the GIL is released): the
        # kernels' shortlists are independent, so one thread per core transfers them
        with ThreadPoolExecutor(host_cores(), thread_name_prefix="ttrank-transfer") as ex:
            made = ex.map(lambda k: _shortlist(k, ranked[k.name], reports[k.name], reports, policy,
                                               stage2, cached, target, build_s, drawn), ks)
            for k, (picks[k.name], shares[k.name]) in zip(ks, made):
                progress("transferring", len(picks), len(kernels), k.name)

    lists(first)
    phases["transferring"] = round(time.time() - t, 2)
    anytime = [_anytime_point("untuned", t_start, _best_so_far(kernels, picks, {}, reports), reports, 0)]
    fresh: dict[int, dict] = {}  # row by id(pick), of both phases
    counts = {"measured": 0, "left": 0}

    def tuned_so_far(rows: dict[int, dict] | None = None) -> dict[str, float | None]:
        # each kernel's fastest known; a sibling none of whose picks is measured yet, its lead's
        # (the same conv): siblings measure last, and their untuned time would hide the progress
        rows = fresh if rows is None else rows
        best = _best_so_far(kernels, picks, rows, reports)
        for name, lead in leads.items():
            measured = any(p.row is not None or id(p) in rows for p in picks.get(name) or [])
            if not measured and best.get(lead.name) is not None:
                best[name] = min(best[name] or math.inf, best[lead.name])
        return best

    def measure(ks: list[Kernel], budget: float | None, todo_picks: dict[str, list[Pick]] | None = None,
                phase: str = "measuring") -> None:
        todo_picks = picks if todo_picks is None else todo_picks

        def on_batch(new: dict[int, dict], n: int) -> None:
            anytime.append(_anytime_point(phase, t_start, tuned_so_far({**fresh, **new}), reports,
                                          counts["measured"] + n))
        todo = sum(1 for k in ks for p in todo_picks[k.name] or [] if p.row is None)
        new, left = _measure_picks(model.name, ks, todo_picks, shares, measurer, table, reports, stamp, budget,
                                   t0, progress, on_batch)
        fresh.update(new)
        counts["measured"] += todo - left
        counts["left"] += left

    def spent() -> bool:
        return budget_s is not None and time.time() - t0 > budget_s

    def late_picks(ks: list[Kernel]) -> None:
        # the shares that gave each kernel its k are of the untuned model, where a conv's default
        # code runs 10-100x its tuned time and a reduction's or a depthwise conv's 2-4x: the model
        # as tuned so far shows what those weigh. EfficientNet-B0's squeeze-excite means held 0.1%
        # of its untuned model and measured their top-1 only; the largest is 1.4% of the tuned model
        # (rocketlake). Adapted, leave-one-out, back to back: EfficientNet-B0 0.960 -> 0.887x
        # onnxruntime, -B4 1.043 -> 0.979, MnasNet 1.198 -> 1.101
        if spent():
            return
        t = time.time()
        best = tuned_so_far()
        model_s = sum(reports[n].weight * (s or 0.0) for n, s in best.items())
        more: dict[str, list[Pick]] = {}
        for k in ks:
            rep = reports[k.name]
            if not model_s or not (picks[k.name] or small_space(k)):  # a small space: its donors may all fail
                continue
            share = k.weight * (best[k.name] or 0.0) / model_s
            want = policy.k([c.score for c in ranked.get(k.name) or []] or [0.0] * SMALL_SPACE_DRAWS, share)
            got = (_next_picks(k, ranked[k.name], picks[k.name] or [], rep, stage2, cached, target, build_s,
                               want - rep.k) if ranked.get(k.name) and picks[k.name] and want > rep.k else [])
            if small_space(k) and share >= policy.minor_share:
                got += _space_picks(k, [*(picks[k.name] or []), *got], want, rep, stage2, cached, target, drawn)
            if got:
                more[k.name] = got
                rep.top_k, rep.k, rep.late_picks = max(rep.top_k, policy.bound(share)), max(rep.k, want), len(got)
                rep.beside += [p.candidate.record.id for p in got if p.beside]
                shares[k.name] = share
        for name, got in more.items():
            picks[name] = [*(picks[name] or []), *got]
        phases["transferring"] = round(phases["transferring"] + time.time() - t, 2)
        if more:
            measure([k for k in ks if k.name in more], budget_s, more)

    def second_look(ks: list[Kernel], missed: Callable[..., bool] = _missed) -> None:
        # the next candidates of the kernels whose picks all missed, within the same budget; only
        # where the untuned kernel is worth minor_share of the model as tuned so far (a pooling
        # kernel of microseconds that its picks did not beat gains nothing to speak of)
        if spent():  # no batch more
            return
        t = time.time()
        model_s = sum(reports[n].weight * (s or 0.0) for n, s in tuned_so_far().items())
        more = {k.name: got for k in ks if ranked.get(k.name) and missed(picks[k.name], fresh, reports[k.name])
                and k.weight * (reports[k.name].untuned_s or 0.0) >= policy.minor_share * model_s
                and (got := _next_picks(k, ranked[k.name], picks[k.name] or [], reports[k.name], stage2,
                                        cached, target, build_s))}
        for name, got in more.items():
            picks[name] = [*(picks[name] or []), *got]
            reports[name].second_look = len(got)
        phases["transferring"] = round(phases["transferring"] + time.time() - t, 2)
        if more:
            measure([k for k in ks if k.name in more], budget_s, more)

    measure(first, budget_s)
    late_picks(first)
    second_look(first)
    # then each sibling measures its lead's fastest (one candidate each, even past the budget:
    # without it the kernel would stay untuned), or its own shortlist when the lead has none
    t = time.time()
    shared, orphans = [], []
    for k in (k for k in kernels if k.name in leads):
        got = _sibling_picks(k, leads[k.name], picks[leads[k.name].name], fresh, shares, reports, cached, target)
        if got:
            picks[k.name] = got
            shared.append(k)
        else:
            orphans.append(k)
    lists(orphans)
    phases["transferring"] = round(phases["transferring"] + time.time() - t, 2)
    measure(shared, None, phase="siblings")
    # a sibling on which its lead's fastest failed (Xception's 1x1 conv with a strided slice and
    # a residual add after it: the schedule transferred from the lead's wrote past its output)
    # looks at its own next candidates; one it ran slower than the untuned kernel does not
    second_look(shared, _all_failed)
    measure(orphans, budget_s)
    late_picks(orphans)
    second_look(orphans)
    unmeasured = counts["left"]
    chosen = {k.name: t for k in kernels
              if (t := _choose(k, picks[k.name], fresh, reports[k.name], target)) is not None}
    return chosen, unmeasured, anytime


def _measure_untuned(network: str, kernels: list[Kernel], measurer: Measurer, cached: dict, table: Path,
                     reports: dict[str, KernelReport], stamp: dict) -> None:
    """Every untuned kernel first (once each, reused across runs): their shares of the model
    decide how many candidates each kernel gets, and their sum how the whole model is timed."""
    need = [k for k in kernels if (k.workload_hash, UNTUNED) not in cached]
    # each build also leaves the kernel's outputs as the reference its candidates are checked against
    done = measurer.baseline().measure([k.mod for k in need], as_references=[k.workload_hash for k in need])
    for k, m in zip(need, done):
        r = cached[(k.workload_hash, UNTUNED)] = measurements.row(
            network, k, m.status, m.latency_s, m.error, stamp["provenance"], target_key=stamp["target_key"],
            devices=m.devices, foreign=m.foreign_json)
        append_jsonl(table, r)
    for k in kernels:
        reports[k.name].untuned_s = cached[(k.workload_hash, UNTUNED)]["latency_s"]


def _shortlist(k: Kernel, ranked: list[Candidate], rep: KernelReport, reports: dict[str, KernelReport],
               policy: FixedK, stage2: SecondStage | None, cached: dict, target,
               build_s: dict[str, float] | None = None,
               drawn: dict[tuple[str, int], list[Candidate]] | None = None) -> tuple[list[Pick] | None, float]:
    """The kernel's candidates to measure (as many as ``policy`` gives it for the ranker's
    scores and its share of the untuned model), and that share; None when it has no candidate.
    A pick after the first whose record is known to compile slowly (``build_s``, by trace hash)
    is left out (:data:`SLOW_BUILD_S`)."""
    share = _share(k, reports)
    rep.top_k = policy.bound(share)
    if not ranked:
        rep.why = "no compatible donor schedule"
        # MetaSchedule's design space stands in (parallel, vectorised): samples of it, ordered
        # by the second stage's cost model when there is one, are measured like a donor's
        # schedules and kept only if one beats the default
        ranked = _draws(k, target, SMALL_SPACE_DRAWS if small_space(k)
                        else max(rep.top_k, stage2.shortlist if stage2 else 0), drawn)
        if not ranked:
            return None, 0.0
    rep.k = policy.k([c.score for c in ranked], share)

    # a schedule tuned on this very CPU (else on one of its vector class) is measured too, when
    # the ranker (which learned mostly on other CPUs) did not put it among the k: on znver3
    # (AVX2), a conv natively tuned for 128 trials ran 1.8 ms where schedules from AVX-512
    # donors ran 2.7
    also = ([native_candidate(ranked, target.attrs.get("mcpu"), str(target.attrs.get("mtriple") or ""))]
            if rep.top_k > 1 else [])
    # and a packed conv's template schedules (:mod:`ttrank.templates`) when no donor was tuned on
    # its very shape: YOLO's convs (52, 26 and 13 pixels wide) took a template on 18 of 45 and
    # the whole model ran 10% faster (rocketlake, side by side). Where donors of the same shape
    # exist (ResNet-50's from ResNet-18's) templates won on kernel sums (-4%) but not in the
    # model, and cost 60 candidates
    if not any(c.donor.network != SPACE_NETWORK and c.donor.kernel.extents == k.extents for c in ranked):
        also += template_candidates(k, target, min(TEMPLATE_TILES, rep.top_k - 1))
    # the second stage still reorders a kernel the policy gives one candidate (its top-1 may
    # change); only minor kernels skip it
    stage = stage2 if rep.top_k > 1 else None
    if ranked[0].record.network == SPACE_NETWORK:
        stage = _scoring_every_draw(stage, ranked)
    picks = shortlist(k, ranked, rep.k, target, stage, _known(k, cached, rep), rep.rejections,
                      [c for c in also if c is not None])
    picks = [picks[0], *(p for p in picks[1:] if not _slow_build(p, build_s or {}, rep))] if picks else picks
    rep.beside = [p.candidate.record.id for p in picks if p.beside]
    return picks, share


def _measured(picks: list[Pick] | None, fresh: dict[int, dict]) -> tuple[list[dict], list[float]]:
    """The rows of a kernel's measured picks, and the latencies of those that ran correctly."""
    rows = [r for p in picks or [] if (r := p.row or fresh.get(id(p))) is not None]
    return rows, [r["latency_s"] for r in rows if r["status"] == "ok" and r["latency_s"]]


def _missed(picks: list[Pick] | None, fresh: dict[int, dict], rep: KernelReport) -> bool:
    """Whether a kernel's picks were measured and none ran correctly faster than its untuned
    kernel (a kernel whose picks the budget left unmeasured has not missed)."""
    rows, ok = _measured(picks, fresh)
    return bool(rows) and (not ok or (rep.untuned_s is not None and min(ok) >= rep.untuned_s))


def _all_failed(picks: list[Pick] | None, fresh: dict[int, dict], rep: KernelReport) -> bool:
    """Whether a kernel's picks were measured and none ran correctly (a wrong result, a crash):
    unlike a pick that ran slower than the untuned kernel, this says nothing of the next ones."""
    rows, ok = _measured(picks, fresh)
    return bool(rows) and not ok


def _next_picks(k: Kernel, ranked: list[Candidate], picks: list[Pick], rep: KernelReport,
                stage2: SecondStage | None, cached: dict, target,
                build_s: dict[str, float] | None = None, n: int = SECOND_LOOK) -> list[Pick]:
    """The ``n`` candidates after ``picks`` in the kernel's shortlist order (their programs not
    among ``picks``'), for :func:`_measure`'s late picks and second look."""
    fresh = shortlist(k, ranked, n, target, stage2 if rep.top_k > 1 else None,
                      _known(k, cached, rep), rep.rejections, taken=picks)
    return [p for p in fresh if not _slow_build(p, build_s or {}, rep)]


def _draws(k: Kernel, target, n: int, drawn: dict[tuple[str, int], list[Candidate]] | None) -> list[Candidate]:
    """``n`` design-space draws of ``k``, drawn once per run (``drawn``): a second shortlist of
    them finds their cost scores (:attr:`Candidate.cost_scored`) and transfers none again."""
    if drawn is None:
        return space_candidates(k, target, n)
    if (k.name, n) not in drawn:
        drawn[(k.name, n)] = space_candidates(k, target, n)
    return drawn[(k.name, n)]


def _scoring_every_draw(stage: SecondStage | None, draws: list[Candidate]) -> SecondStage | None:
    """``stage`` with a shortlist that holds every draw: draws carry no ranker score, so only the
    cost model orders them."""
    return dataclasses.replace(stage, shortlist=max(stage.shortlist, len(draws))) if stage is not None else None


def _space_picks(k: Kernel, taken: list[Pick], n: int, rep: KernelReport, stage2: SecondStage | None,
                 cached: dict, target, drawn: dict[tuple[str, int], list[Candidate]] | None = None) -> list[Pick]:
    """Draws of a small design space (:func:`small_space`) to measure beside ``k``'s donor
    schedules: the second stage's top ``n`` of :data:`SMALL_SPACE_DRAWS` (the first ``n`` without
    one), less the draws already among ``taken``."""
    taken_draws = sum(1 for p in taken if p.candidate is not None and p.candidate.record.network == SPACE_NETWORK)
    if n <= taken_draws:
        return []
    draws = _draws(k, target, SMALL_SPACE_DRAWS, drawn)
    got = shortlist(k, draws, n - taken_draws, target, _scoring_every_draw(stage2, draws), _known(k, cached, rep),
                    rep.rejections, taken=taken)
    for p in got:
        p.beside = True
    return got


def _slow_build(p: Pick, build_s: dict[str, float], rep: KernelReport) -> bool:
    """Whether a pick (not yet measured) would take over :data:`SLOW_BUILD_S` to build; the
    report's rejections say so."""
    if p.row is not None or p.candidate is None:
        return False
    secs = build_s.get(p.candidate.record.trace_hash)
    if secs is None or secs <= SLOW_BUILD_S:
        return False
    rep.rejections.append((p.candidate.record.id, f"slow build: its program took {secs:.1f} s to compile "
                                                   f"(over {SLOW_BUILD_S:g} s), measured only as a first pick"))
    return True


def _sibling_leads(kernels: list[Kernel], reports: dict[str, KernelReport],
                   ranked: dict[str, list[Candidate]]) -> dict[str, Kernel]:
    """For each kernel whose anchor computation a heavier kernel of the model shares (the same
    conv, other epilogue: :func:`ttrank.ranking.same_anchor`), that heavier one (the group's
    largest weight x untuned latency), whose measurements choose its candidates."""
    leads: dict[str, Kernel] = {}
    heads: list[Kernel] = []
    by_share = sorted((k for k in kernels if ranked.get(k.name)),
                      key=lambda k: -(k.weight * (reports[k.name].untuned_s or 0.0)))
    for k in by_share:
        head = next((h for h in heads if same_anchor(h, k)), None)
        if head is None:
            heads.append(k)
        else:
            leads[k.name] = head
    return leads


def _sibling_picks(k: Kernel, lead: Kernel, lead_picks: list[Pick] | None, rows: dict[int, dict],
                   shares: dict[str, float], reports: dict[str, KernelReport], cached: dict,
                   target) -> list[Pick] | None:
    """``k``'s picks: the fastest :data:`SIBLING_K` of its lead's measured candidates, moved onto
    ``k``; none when the lead measured none that ran (then ``k`` takes its own shortlist)."""
    ok = sorted(((r["latency_s"], i, p) for i, p in enumerate(lead_picks or [])
                 if (r := p.row or rows.get(id(p))) is not None and r["status"] == "ok" and r["latency_s"]),
                key=lambda x: x[:2])
    if not ok:
        return None
    rep = reports[k.name]
    shares[k.name] = _share(k, reports)
    rep.sibling_of = lead.name
    rep.top_k = rep.k = SIBLING_K
    return shortlist(k, [p.candidate for _, _, p in ok], SIBLING_K, target, None, _known(k, cached, rep),
                     rep.rejections)


def _share(k: Kernel, reports: dict[str, KernelReport]) -> float:
    """``k``'s share of the untuned model time (weight x untuned latency; 1 when unknown)."""
    total = sum(r.weight * (r.untuned_s or 0.0) for r in reports.values())
    rep = reports[k.name]
    return k.weight * rep.untuned_s / total if (rep.untuned_s and total) else 1.0


def _known(k: Kernel, cached: dict, rep: KernelReport) -> Callable[[Candidate], dict | None]:
    """The row of a candidate of ``k`` measured by an earlier run (it counts, and is not measured
    again), or None; a failed one is noted among ``rep``'s rejections."""
    def known(c: Candidate) -> dict | None:
        r = cached.get((k.workload_hash, c.record.id))
        if r is None or not is_current(r, c.record):
            return None
        if r["status"] != "ok":
            rep.rejections.append((c.record.id, r.get("reason", r["status"])))
        return r
    return known


def _estimate_ms(best_s: dict[str, float | None], reports: dict[str, KernelReport]) -> float:
    """The model's estimated latency (ms): weight x each kernel's best latency so far."""
    return round(1e3 * sum(r.weight * (best_s.get(n) or r.untuned_s or 0.0) for n, r in reports.items()), 4)


def _anytime_point(phase: str, t_start: float, best_s: dict[str, float | None],
                   reports: dict[str, KernelReport], measured: int) -> dict:
    """One point of the anytime curve: seconds since the run began, candidates measured so far,
    and the model's estimated latency with ``best_s``, the fastest correct latency known per
    kernel (the first point, "untuned", counts what earlier runs measured)."""
    return {"seconds": round(time.time() - t_start, 2), "phase": phase, "measured": measured,
            "estimated_ms": _estimate_ms(best_s, reports)}


def _best_so_far(kernels: list[Kernel], picks: dict[str, list[Pick] | None], fresh: dict[int, dict],
                 reports: dict[str, KernelReport]) -> dict[str, float | None]:
    """Per kernel, the fastest correct latency known: its measured picks' and its untuned code's."""
    best: dict[str, float | None] = {}
    for k in kernels:
        rep = reports[k.name]
        _, lats = _measured(picks.get(k.name), fresh)
        best[k.name] = min([*lats, rep.untuned_s] if rep.untuned_s else lats, default=None)
    return best


def _measure_picks(network: str, kernels: list[Kernel], picks: dict[str, list[Pick]], shares: dict,
                   measurer: Measurer, table: Path, reports: dict[str, KernelReport], stamp: dict,
                   budget_s: float | None, t0: float, progress: Progress,
                   on_batch: Callable[[dict[int, dict], int], None] | None = None
                   ) -> tuple[dict[int, dict], int]:
    """Measure the transferred picks in batches: every kernel's first before any kernel's
    second, big shares of the model first, until the budget runs out. ``on_batch(rows so far,
    candidates measured)`` after each batch. Returns (row by id(pick), candidates left
    unmeasured)."""
    todo = [(k, p, i) for k in kernels for i, p in enumerate(picks[k.name] or []) if p.row is None]
    todo.sort(key=lambda x: (x[2], -shares[x[0].name]))
    fresh: dict[int, dict] = {}
    chunk = MEASURE_CHUNK
    parts: list[list] = []  # chunks handed to the measurer, not yet measured
    measured = 0
    # per kernel, the fastest correct latency known so far: the untuned kernel's too, as a
    # candidate slower than it is never chosen (_choose)
    best: dict[str, float] = {}

    def note_best(k: Kernel, r: dict | None) -> None:
        if r is not None and r["status"] == "ok" and r["latency_s"]:
            best[k.name] = min(best.get(k.name, r["latency_s"]), r["latency_s"])

    for k in kernels:
        if reports[k.name].untuned_s:
            best[k.name] = reports[k.name].untuned_s
        for p in picks[k.name] or []:
            note_best(k, p.row)

    def chunks():
        for s in range(0, len(todo), chunk):
            # the slow builds first (longest first: the batch's last build then ends soonest)
            part = sorted(todo[s:s + chunk], key=lambda x: -_build_cost(x[1]))
            parts.append(part)
            # a candidate far slower than its kernel's best so far is run no more (or not at
            # all, when its output check was slow enough: Measurer.measure_stream)
            yield ([p.transferred.mod for _, p, _ in part], [(k.mod, k.workload_hash) for k, _, _ in part],
                   lambda part=part: [best.get(k.name) for k, _, _ in part])

    # the budget is asked before each chunk but the first runs (over RPC, a chunk built ahead
    # is then dropped unrun)
    def over() -> bool:
        return STOP_REQUESTED.is_set() or (budget_s is not None and time.time() - t0 > budget_s)

    for results in measurer.measure_stream(chunks(), stop=over):
        part = parts.pop(0)
        measured += len(part)
        rows = []
        for (k, p, _), m in zip(part, results):
            c = p.candidate
            r = fresh[id(p)] = measurements.row(
                network, k, m.status if not m.ok else "ok", m.latency_s, m.error, stamp["provenance"],
                p.transferred, untuned_s=reports[k.name].untuned_s, scores=(c.score, c.cost_score),
                target_key=stamp["target_key"], devices=m.devices,  # devices: a fleet's, that ran it
                build_s=m.build_s, foreign=m.foreign_json)
            rows.append(r)
            note_best(k, r)
        append_jsonl(table, rows)
        if on_batch:
            on_batch(fresh, measured)
        progress("measuring", measured, len(todo), part[-1][0].name)
    return fresh, len(todo) - measured


def _build_cost(p: Pick) -> float:
    """How long a pick's build is likely to take, relative to the others: its unroll depth.
    Explicitly unrolled programs (MetaSchedule's 512 steps) took 1.2 s to compile on average and
    up to 7 s in LLVM's SLP vectorizer, against 0.25-0.4 s for the rest (R18's candidates)."""
    return parse_trace(p.transferred.record.trace_json)["unroll"]


def _choose(k: Kernel, picks: list[Pick] | None, fresh: dict[int, dict], rep: KernelReport,
            target) -> Transferred | None:
    """The fastest correct measured pick, if it beats the untuned kernel; the report says why not
    (``picks`` None: the kernel had no candidate, as the report already says)."""
    if picks is None:
        return None
    best, waited = None, 0
    for pos, p in enumerate(picks):
        r = p.row or fresh.get(id(p))
        if r is None:  # its turn came after the measuring budget
            waited += 1
            continue
        c = p.candidate
        rep.measured.append({"donor": c.record.id, "rank": pos, "score": c.score,
                             "cost_score": c.cost_score, "status": r["status"], "latency_s": r["latency_s"],
                             **({"build_s": r["build_s"]} if r.get("build_s") is not None else {}),
                             **({"same_program": p.same_program} if p.same_program else {})})
        if r["status"] != "ok":
            if (c.record.id, r.get("reason")) not in rep.rejections:
                rep.rejections.append((c.record.id, r.get("reason") or r["status"]))
            continue
        if best is None or r["latency_s"] < best[1]["latency_s"]:
            best = (p, r, pos)
    if best is None and waited and not rep.measured:
        rep.why = "the measuring budget ran out before its turn"
    elif best is None:
        rep.why = "every measured candidate failed" if rep.measured else "no candidate applied to this kernel"
    elif rep.untuned_s is not None and best[1]["latency_s"] >= rep.untuned_s:
        rep.why = "no candidate beat the untuned kernel"
    else:
        p, r, pos = best
        c = p.candidate
        # measured in an earlier run: re-apply (deterministic)
        t = p.transferred or transfer(c.record, k, c.donor, target)
        if t.ok:
            rep.status = "tuned"
            rep.chosen = {"donor_network": t.donor.network, "donor_kernel": t.donor.kernel.name,
                          "record": t.record.id, "rank": pos, "score": c.score,
                          "cost_score": c.cost_score, "latency_s": r["latency_s"], "method": t.method,
                          "tile_changes": [ch.to_json() for ch in t.tile_changes],
                          **({"thread_split": t.thread_split} if t.thread_split else {})}
            return t
    return None


def _tune_missing(model: LoadedModel, kernels: list[Kernel], store: DonorStore, exclude_networks: set,
                  chosen: dict[str, Transferred], reports: dict[str, KernelReport], budget_s: float,
                  target, progress: Progress, runner: RunnerSpec | None = None):
    """MetaSchedule for what transfer left at the default schedule, when it matters: a budget
    split by each workload class's share of the estimated model time, the kernels of a class
    in one search (:func:`ttrank.coverage.plan_missing`). The records go to the user's
    donor store, so the next model with such a kernel gets them by transfer, and a rerun of
    this model reuses them instead of tuning again. Over RPC (``runner``), the search measures
    on the devices, with tune's own runner settings. Returns that database, or None."""
    # a design-space sample is a start, not a tuned schedule: a big share still gets searched
    done = ({n for n, t in chosen.items() if t.donor.network != SPACE_NETWORK}
            | _tuned_before(kernels, store, exclude_networks))
    plans = plan_missing(kernels, {n: r.best_s for n, r in reports.items()}, done, budget_s=budget_s)
    remote = (dataclasses.replace(runner, **TUNING_PROTOCOL)
              if runner is not None and runner.kind == "rpc" else None)
    return _search(model, plans, chosen, reports, target, progress, "tuning", "tuned-missing",
                   lambda slowest: remote or RunnerSpec(**TUNING_PROTOCOL, timeout_sec=trial_timeout_s(slowest)))


def _refine(model: LoadedModel, kernels: list[Kernel], store: DonorStore, exclude_networks: set,
            chosen: dict[str, Transferred], reports: dict[str, KernelReport], budget_s: float,
            target, progress: Progress, runner: RunnerSpec):
    """Native search, seeded with their transferred schedule, for the heaviest kernels that
    transfer covered (:func:`ttrank.coverage.plan_refine`): a donor's schedule fits its own
    shape, and a few dozen trials from it on this CPU often find a faster one (ViT-B/32's MLP
    down-projection, 2.1 ms transferred, 1.4 ms after 128 trials). Measured as recommend
    measures (``runner``'s protocol, cold caches), so the search's best replaces the transferred
    schedule only when it is :data:`REFINE_MARGIN` faster on the same terms. A kernel whose
    transfer cannot seed a search (an anchor-trace replay) is searched from MetaSchedule's own
    samples when it is a matrix product, whose design space such a short search covers, well
    below the FLOP rate of the model's fastest kernel (:data:`UNSEEDED_REFINE_RATE`):
    ConvNeXt-T's MLP matmuls (42% of the model on znver3, all anchor transfers at 76-138
    GFLOP/s) gained 15% and 24% in two of three 33-37 s searches. Not a conv's: four such
    searches (ResNet-34, EfficientNetV2-S) ended 2.4-6.6x slower than the transferred schedule,
    their budget spent for nothing. Not searched either: a kernel searched already (in this
    run, or one whose records the tuned-here folder holds, which a warm-cache search may have
    written), and one that a search of this user's tuned on exactly (another model's run).
    A shipped donor tuned on exactly is no reason: on znver3, ResNet-34's 3x3 convs ran a
    znver4 schedule 1.4x faster than ResNet-18's own, tuned on that very CPU. A search that
    fails leaves the transferred schedule. Returns the search's database, or None."""
    work = tuned_here_dir(model.name, model.layout)
    db = open_database(work) if (work / WORKLOAD_FILE).exists() else None
    held = {k.name for k in kernels if db is not None and db.has_workload(k.mod)}
    rate = {k.name: k.flops / reports[k.name].best_s for k in kernels if k.flops > 0 and reports[k.name].best_s}
    slow = UNSEEDED_REFINE_RATE * max(rate.values(), default=0.0)
    skip = ({n for n, r in reports.items() if r.status != "tuned" or r.tuning is not None} | held
            | {n for n, t in chosen.items() if not t.seedable and not (t.kernel.is_matmul and rate.get(n, slow) < slow)}
            | _tuned_before(kernels, store, exclude_networks, users_only=True))
    plans = plan_refine(kernels, {n: r.best_s for n, r in reports.items()}, skip, budget_s=budget_s,
                        min_seconds=REFINE_MIN_S)
    return _search(model, plans, chosen, reports, target, progress, "refining", "refined",
                   lambda slowest: dataclasses.replace(runner, timeout_sec=(
                       runner.timeout_sec if runner.kind == "rpc" else trial_timeout_s(slowest))),
                   deadline=time.time() + budget_s, margin=REFINE_MARGIN)


def _after_search(phase: str, t_start: float, anytime: list[dict], reports: dict[str, KernelReport]) -> dict:
    """The anytime curve's point after one of recommend's own searches."""
    return {"seconds": round(time.time() - t_start, 2), "phase": phase, "measured": anytime[-1]["measured"],
            "estimated_ms": _estimate_ms({n: r.best_s for n, r in reports.items()}, reports)}


def _tuned_before(kernels: list[Kernel], store: DonorStore, exclude_networks: set,
                  users_only: bool = False) -> set[str]:
    """The kernels some donor was tuned on (the model's own earlier run, say): not tuned again.
    ``users_only``: only the donors of the user's own store (their searches, ``adapt``'s)."""
    mine = None
    if users_only:  # the user's folders never take a shipped set's name (donors.tuned_here_dir)
        root = user_donor_dir()
        mine = {p.name for p in root.iterdir()} if root.is_dir() else set()
    hashes = {w.kernel.workload_hash for w in store.workloads if w.network not in exclude_networks
              and (mine is None or (w.source or w.network) in mine)}
    return {k.name for k in kernels if k.workload_hash in hashes}


def _search(model: LoadedModel, plans: list[TuningPlan], chosen: dict[str, Transferred],
            reports: dict[str, KernelReport], target, progress: Progress, phase: str, status: str,
            runner_for: Callable[[float | None], RunnerSpec], deadline: float | None = None,
            margin: float = 0.0):
    """Run ``plans``' searches into the user's tuned-here donors, each seeded with what its
    kernels have; a kernel whose search beat it by ``margin`` gets ``status``. ``runner_for``:
    the runner, given the slowest kernel's best latency (a trial's timeout). ``deadline`` (a
    time.time()): an optional phase, whose budget covers each search's set-up too; no search
    starts that could not have its least, and one that fails is noted, not raised. Returns
    that database, or None."""
    extra_db = None
    work = tuned_here_dir(model.name, model.layout)
    for i, plan in enumerate(plans):
        k, t_k = plan.kernel, time.time()
        if deadline is not None:
            left = deadline - t_k
            if left < min(plan.seconds, REFINE_MIN_S):
                break
            plan = dataclasses.replace(plan, seconds=min(plan.seconds, left))
        progress(phase, i + 1, len(plans), k.name)
        # MetaSchedule generates a batch without a chance to stop: a kernel whose candidates are
        # slow to generate gets a search that fits the budget, or none
        draw_s = max(draw_seconds(kk, target) for kk in plan.kernels)
        size = fit_search(draw_s, plan.seconds * FIRST_BATCH_SHARE - (time.time() - t_k), MISSING_BATCH,
                          host_cores())
        if size is None:
            for kk in plan.kernels:
                reports[kk.name].why = _also(reports[kk.name].why, f"not searched: a draw of its design "
                                             f"space takes {draw_s:.1f} s, so even the smallest search "
                                             f"would overrun its {plan.seconds:.0f} s")
            continue
        # the search starts from what transfer reached (a design-space sample, a weak donor)
        seeds = {}
        for kk in plan.kernels:
            start, best_s = chosen.get(kk.name), reports[kk.name].best_s
            if start is not None and start.seedable and best_s:
                seeds[kk.workload_hash] = [Seed(kk.workload_hash, start.trace, best_s)]
        # a trial may run as long as the slowest kernel of the search needs
        slowest = max(reports[kk.name].best_s or 0.0 for kk in plan.kernels) or None
        # small batches, so that the budget is checked often. MetaSchedule appends to the
        # database itself: a second recommend of this model waits here (the lock `ttrank
        # tune` holds), then finds the trials done
        try:
            with file_lock(work / "tune"):
                run = tune(model.mod, work, trials_per_task=plan.trials, injective_trials=plan.trials,
                           budget_minutes=plan.seconds / 60, target=target, model_name=model.name,
                           only=[kk.name for kk in plan.kernels], trials_per_iter=MISSING_BATCH,
                           seeds=seeds or None, search_size=size, runner=runner_for(slowest))
        except Exception as e:  # noqa: BLE001 - an optional search keeps what transfer gave
            if deadline is None:
                raise
            failed = f"its further search failed: {last_line(str(e)) or type(e).__name__}"
            for kk in plan.kernels:
                reports[kk.name].why = _also(reports[kk.name].why, failed)
            continue
        extra_db = ms.database.JSONDatabase(work_dir=str(work))
        wall = time.time() - t_k
        for kk in plan.kernels:
            _take_tuned(kk, reports[kk.name], extra_db, chosen, plan, run, wall, work, status, margin,
                        seeded=kk.workload_hash in seeds)
    return extra_db


def _take_tuned(k: Kernel, rep: KernelReport, db, chosen: dict[str, Transferred], plan: TuningPlan,
                run, wall: float, work: Path, status: str = "tuned-missing", margin: float = 0.0,
                seeded: bool = False) -> None:
    """``k``'s report after the search of ``plan`` (which tuned ``k`` alone or with its
    siblings): its best record chosen when it beats what ``k`` had by ``margin``. ``seeded``:
    the search began from what ``k`` had."""
    recs = db.get_top_k(db.commit_workload(k.mod), 1)
    best = min(float(x) for x in recs[0].run_secs) if recs else None
    rep.tuning = {"seconds": round(wall, 1), "budget_s": round(plan.seconds, 1),
                  "search_seconds": round(wall - run.setup_s, 1), "setup_s": round(run.setup_s, 1),
                  "search_began_at": round(run.search_clock0, 3),  # on trials.jsonl's clock
                  "trials": plan.trials, "share": round(plan.share, 4),
                  "kernels_in_search": len(plan.kernels),
                  "before_s": rep.best_s, "after_s": best, "work_dir": str(work)}
    if best is None and plan.siblings:
        rep.why = _also(rep.why, f"the search of its class ({len(plan.kernels)} kernels, "
                                 f"{rep.tuning['seconds']:.0f} s) measured none for it")
        return
    if best is None or (rep.best_s is not None and best >= rep.best_s * (1 - margin)):
        rep.why = _also(rep.why, f"MetaSchedule found nothing {f'{100 * margin:.0f}% ' if margin else ''}faster "
                                 f"in {rep.tuning['seconds']:.0f} s")
        return
    rep.status = status
    start = "from its transferred schedule" if seeded else "from its own samples (its transfer seeds no search)"
    rep.why = (f"tuned with MetaSchedule ({rep.tuning['seconds']:.0f} s): {rep.why or 'no transferred schedule'}"
               if status == "tuned-missing" else
               f"searched further with MetaSchedule {start} ({rep.tuning['seconds']:.0f} s): "
               f"{1e3 * rep.best_s:.3f} -> {1e3 * best:.3f} ms")
    chosen.pop(k.name, None)
    rep.chosen = {"donor_network": "metaschedule", "donor_kernel": k.name, "record": None,
                  "rank": 0, "score": None, "latency_s": best, "method": "tuned"}


def _also(why: str | None, more: str) -> str:
    return f"{why}; {more}" if why else more


def trial_timeout_s(best_s: float | None, default_s: float = RunnerSpec.timeout_sec) -> float:
    """How long one trial of recommend's own tuning may run locally: :data:`TRIAL_TIMEOUT_FACTOR`
    times the kernel's best latency known, for each call of a trial, at least
    :data:`TRIAL_TIMEOUT_FLOOR_S` (loading and arguments), at most the runner's default."""
    if not best_s:
        return default_s
    calls = 1 + TUNING_PROTOCOL["number"]  # the evaluator's warm-up call, then the timed ones
    # whole seconds: a local runner is kept per timeout (ttrank.measure._shared_runner)
    return min(default_s, max(TRIAL_TIMEOUT_FLOOR_S, math.ceil(TRIAL_TIMEOUT_FACTOR * calls * best_s)))


def _latencies(chosen: dict, reports: dict[str, KernelReport]) -> dict[str, float]:
    return {n: reports[n].chosen["latency_s"] for n in chosen}


def _build(model: LoadedModel, target, db_dir: Path, output, kernels: list[Kernel],
           chosen: dict[str, Transferred], reports: dict[str, KernelReport], extra_db, check: bool,
           compile_objects=None, kept_objects=None) -> tuple[CompiledModel | None, float | None]:
    """Write the database beside its place, compile, check; then the database and the library
    replace the previous ones as one step (a kill between the renames is finished by the next
    run): never a database of one run beside another's library. For another architecture
    (cross-compiled), the host can neither load nor check the model: no CompiledModel then.
    ``compile_objects``: the build pool's, to compile the kernels in parallel (the model is
    exported then, as its parts are linked at export); ``kept_objects``: its measured builds,
    linked instead of compiled again."""
    staged = db_dir.with_name(f".{db_dir.name}.staged")
    # their search beat the default, or the transferred schedule
    tuned = {n for n, r in reports.items() if r.status in ("tuned-missing", "refined")}
    database = write_database(staged, kernels, chosen, target, _latencies(chosen, reports), extra_db, tuned)
    write_loaded_as(staged, model.layout, model.fast_math)  # what `ttrank compile --database` loads it as
    ex = compile_model(model, target, database, compile_objects if output else None,
                       kept_objects if output else None)
    foreign = is_foreign(target)
    moves = [(staged, db_dir)]
    try:
        # the library is exported first and the check runs on it: LLVM emits the machine code
        # once (a JIT for the check and an export after it emitted it twice: 5 s for ResNet-50)
        lib = export_staged(ex, output, target) if output else None
        if lib is not None:
            moves.append((lib, Path(output)))
            if (tail := stage_tail(model, output)) is not None:
                moves.append((tail, tail_path(output)))
        compiled = None
        if not foreign:
            compiled = CompiledModel.load(lib, model) if lib else CompiledModel.from_executable(ex, model)
        max_err = None
        if check and not foreign:
            res = check_against_onnxruntime(compiled, model)
            max_err = res.max_abs_error
            if not res.ok:
                culprits = _find_culprits(model, target, db_dir, [k for k in kernels if k.name in chosen],
                                          chosen, reports)
                raise CheckError(f"compiled outputs differ from onnxruntime (max abs error "
                                 f"{res.max_abs_error:.3g}); kernels at fault: {', '.join(culprits)}; "
                                 f"no database or library was written")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        for src, _ in moves[1:]:
            Path(src).unlink(missing_ok=True)
        raise
    commit_moves(moves, _commit_plan(db_dir))
    if output:
        drop_stale_tail(model, output)
    return compiled, max_err


def _time(model: LoadedModel, target, compiled: CompiledModel, reports: dict[str, KernelReport],
          untuned_run_limit_s: float, progress: Progress) -> dict:
    """Whole-model latency: tuned and onnxruntime in alternation; the untuned model compiled and
    timed once when its kernels say that takes under ``untuned_run_limit_s``, else the sum of
    its kernels (measured anyway) stands in."""
    feed = model.random_inputs()
    lat: dict = {"untuned_estimated_from_kernels": 1e3 * sum(
        r.weight * r.untuned_s for r in reports.values() if r.untuned_s)}
    complete = all(r.untuned_s for r in reports.values())
    if complete and lat["untuned_estimated_from_kernels"] <= 1e3 * untuned_run_limit_s:
        progress("timing", 0, 1, "untuned model")
        lat["untuned"] = CompiledModel.from_executable(compile_model(model, target), model).time_ms(
            feed, repeat=1, min_repeat_ms=0)
        lat["untuned_source"] = "measured"
    else:
        lat["untuned"] = lat["untuned_estimated_from_kernels"]
        lat["untuned_source"] = "sum of untuned kernels"
    load = ForeignLoad()
    load.start()
    # rounds of 100 ms each: five or more of them in alternation (up to 15 while a noisy stretch
    # passes) keep each side's minimum steady; 200 ms ones made the timing a tenth of the run
    side = alternate_ms(model, {"tuned": compiled}, rounds=5, min_repeat_ms=100)
    lat["tuned"], lat["onnxruntime"] = side["tuned"], side["onnxruntime"]
    if (timed := load.stop()) is not None:  # what else ran meanwhile: a benchmark reads it
        lat["foreign_load"] = timed.to_json()
    progress("timing", 1, 1, "")
    return lat


def _commit_plan(db_dir: Path) -> Path:
    """Where a recommend run writes its plan for replacing its outputs (see commit_moves)."""
    return db_dir.with_name(f".{db_dir.name}.commit.json")


def _find_culprits(model: LoadedModel, target, db_dir: Path, tuned_kernels: list[Kernel],
                   chosen: dict[str, Transferred], reports: dict[str, KernelReport]) -> list[str]:
    """Bisect the transferred kernels for the ones that change the model's outputs."""
    suspects = list(tuned_kernels)
    probe = db_dir.with_name(f".{db_dir.name}.probe")
    latency = _latencies(chosen, reports)

    def bad(subset) -> bool:
        db = write_database(probe, subset, {k.name: chosen[k.name] for k in subset}, target, latency)
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
        shutil.rmtree(probe, ignore_errors=True)
