"""``ttrank tune``: MetaSchedule tuning that is fast, budgeted, resumable and logged per trial.

The output is a standard MetaSchedule JSONDatabase work_dir (database_workload.json,
database_tuning_record.json), plus ``trials.jsonl`` (one line per measured trial with the
cumulative search time, for convergence curves) and ``tune_manifest.json``.

Resuming: tasks run one at a time, and each task's finished trials are counted from the
database, so a rerun tunes only what is missing. A kill can leave a partial last line in a
database file; :func:`repair_database` moves it aside (never dropping a whole line) first.

Seeding: schedules of a kernel already measured on this CPU (:class:`Seed`: transferred donor
records, say) join its search's first population, as MetaSchedule's evolutionary search takes
the database's best records of a workload (:class:`SeededDatabase`). They are offered to the
search, never written to the database: a donor set holds what its own search measured.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvm_ffi import structural_equal
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.database import PyDatabase, TuningRecord
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from .errors import TTRankError
from .frontend import LoadedModel
from .kernels import describe, fuse
from .measure import RunnerSpec, WarmPoolBuilder
from .runtime import model_latencies
from .target import cpu_tensor_intrinsics, make_target, provenance, runtime_threads
from .util import STOP_REQUESTED, append_jsonl, atomic_write_bytes, stop_at_safe_points
from .workdir import (FAILED_SECS, RECORD_FILE, TRIALS_FILE, WORKLOAD_FILE, open_database, read_manifest,
                      trials, write_manifest)

log = logging.getLogger("ttrank")
# A kernel under this share of the model's FLOPs x weight is "small" (see ``tune(small_trials=)``)
SMALL_SHARE = 0.001



def repair_database(work_dir: str | Path) -> list[str]:
    """Move a torn last line of each database file to ``<file>.torn`` so the database loads."""
    notes = []
    for name in (WORKLOAD_FILE, RECORD_FILE):
        path = Path(work_dir) / name
        data = path.read_bytes() if path.exists() else b""
        if not data:
            continue
        head, _, tail = data.rstrip(b"\n").rpartition(b"\n")
        if _parses(tail):
            if not data.endswith(b"\n"):  # a whole line that only lacks its terminator
                with open(path, "ab") as f:
                    f.write(b"\n")
            continue
        with open(str(path) + ".torn", "ab") as f:
            f.write(tail + b"\n")
        atomic_write_bytes(path, head + b"\n" if head else b"")
        notes.append(f"{name}: moved a torn last line ({len(tail)} bytes) to {name}.torn")
    return notes


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


@dataclass
class TaskProgress:
    name: str
    flops: float
    weight: int
    target_trials: int
    done: int = 0
    best_s: float | None = None


@dataclass
class TuneProgress:
    """What a progress display needs; updated after every measured batch."""

    tasks: list[TaskProgress] = field(default_factory=list)
    current: int = -1
    search_s: float = 0.0
    started: float = field(default_factory=time.time)
    budget_s: float | None = None
    search_started: float | None = None  # when the first task's context was ready
    setup_s: float = 0.0  # task extraction and that context, before any search
    search_clock0: float = 0.0  # trials.jsonl's search clock when the search began

    @property
    def trials_done(self) -> int:
        return sum(t.done for t in self.tasks)

    @property
    def trials_total(self) -> int:
        return sum(t.target_trials for t in self.tasks)

    @property
    def tasks_done(self) -> int:
        return sum(1 for t in self.tasks if t.done >= t.target_trials)

    def estimated_ms(self) -> float | None:
        """Sum of weight x best latency over the tasks that have a valid trial."""
        vals = [t.weight * t.best_s for t in self.tasks if t.best_s is not None]
        return 1e3 * sum(vals) if vals else None


@derived_object
class _TrialLogger(PyMeasureCallback):
    """Appends one line per measured trial with the cumulative search time."""

    def __init__(self, path: Path, task_name: str, workload_hash: str, clock: Callable[[], float],
                 on_batch: Callable[[int, list[float | None]], None]):
        super().__init__()
        self.path = path
        self.task_name = task_name
        self.workload_hash = workload_hash
        self.clock = clock
        self.on_batch = on_batch

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        now = self.clock()
        rows, lat = [], []
        for b, r in zip(builder_results, runner_results):
            secs = [float(s) for s in r.run_secs] if r.run_secs is not None else []
            best = min(secs) if secs and min(secs) < FAILED_SECS else None
            err = b.error_msg or r.error_msg
            lat.append(best)
            rows.append({"task": self.task_name, "workload": self.workload_hash,
                         "latency_s": best, "search_s": round(now, 3),
                         "error": (err or "")[:200] or None, "time": time.time()})
        append_jsonl(self.path, rows)
        # on_batch says whether the budget is spent: then, as on Ctrl-C, leave the native loop
        # now that the batch is logged (the task stays open, and a rerun continues it)
        if self.on_batch(len(rows), lat) or STOP_REQUESTED.is_set():
            raise _StopTuning()


class _StopTuning(Exception):
    pass


@dataclass(frozen=True)
class Seed:
    """A schedule of one kernel, measured on this CPU, for its search to start from: ``trace``
    replays onto the kernel's module (a :class:`ttrank.transfer.Transferred`'s)."""

    workload_hash: str
    trace: Any
    latency_s: float


@derived_object
class SeededDatabase(PyDatabase):
    """``inner`` (the tuning run's JSONDatabase), whose best records of ``workload`` are merged
    with ``seeds``: the search's first population starts from them (MetaSchedule's
    EvolutionarySearch picks its measured part with ``get_top_k``), while every record
    measured goes to ``inner`` alone."""

    def __init__(self, inner, workload, seeds: list):
        super().__init__()
        self.inner, self.workload, self.seeds = inner, workload, seeds  # seeds: TuningRecords

    def has_workload(self, mod) -> bool:
        return self.inner.has_workload(mod)

    def commit_workload(self, mod):
        return self.inner.commit_workload(mod)

    def commit_tuning_record(self, record) -> None:
        self.inner.commit_tuning_record(record)

    def get_top_k(self, workload, top_k: int) -> list:
        own = list(self.inner.get_top_k(workload, top_k))
        if not structural_equal(workload.mod, self.workload.mod):
            return own
        best = sorted(own + list(self.seeds), key=_mean_secs)
        # repeated up to top_k: each copy is mutated apart, so the population searches near them
        return [best[i % len(best)] for i in range(top_k)] if best else []

    def get_all_tuning_records(self) -> list:
        return list(self.inner.get_all_tuning_records())

    def __len__(self) -> int:
        return len(self.inner)


def _mean_secs(record) -> float:
    secs = [float(s) for s in record.run_secs or []]
    return sum(secs) / len(secs) if secs else FAILED_SECS


def seeded(database, task_mod, seeds: list[Seed], target):
    """``database`` with ``seeds`` offered for ``task_mod``'s search (none: ``database`` itself)."""
    if not seeds:
        return database
    workload = database.commit_workload(task_mod)
    func = next(iter(task_mod.functions.values()))
    records = [TuningRecord(s.trace, workload, [float(s.latency_s)], target, ArgInfo.from_prim_func(func))
               for s in seeds]
    return SeededDatabase(database, workload, records)


def count_trials(work_dir: str | Path, workloads: dict[str, str] | None = None) -> dict[str, dict]:
    """Per task: trials logged and best latency, from trials.jsonl.

    ``workloads`` (task name -> workload hash): count only the rows of that workload. A task
    name can stand for another kernel after the model's passes change (a max-pool now packed):
    its old trials are not this kernel's."""
    out: dict[str, dict] = {}
    last: dict[str, str | None] = {}  # each task's latest workload: older events do not name it
    for row in trials(work_dir):
        name = row["task"]
        wl = row.get("workload") or last.get(name)
        if row.get("workload"):
            last[name] = row["workload"]
        if workloads is not None and name in workloads and wl is not None and wl != workloads[name]:
            continue
        t = out.setdefault(name, {"done": 0, "best_s": None, "search_s": 0.0, "complete": False})
        if row.get("event") == "task_complete":
            # MetaSchedule stops early when a task's search space is exhausted
            t["complete"] = True
            t["target"] = row.get("target")
            continue
        t["done"] += 1
        t["search_s"] = max(t["search_s"], row.get("search_s") or 0.0)
        if row.get("latency_s") is not None and (t["best_s"] is None or row["latency_s"] < t["best_s"]):
            t["best_s"] = row["latency_s"]
    return out


def tune(mod, work_dir: str | Path, trials_per_task: int = 64, budget_minutes: float | None = None,
         target=None, injective_trials: int | None = None, trials_per_iter: int = 32,
         model_name: str = "model", seed: int | None = None,
         on_progress: Callable[[TuneProgress], None] | None = None,
         build_timeout_sec: float = 60.0, runner=None,
         only: list[str] | None = None, prepare: Callable | None = None,
         layout: str = "nchw", small_trials: int | None = None,
         seeds: dict[str, list[Seed]] | None = None, search_size: SearchSize | None = None) -> TuneProgress:
    """Tune every kernel of a Relax module (as imported) into a JSONDatabase work_dir.

    Kernels are tuned one at a time, heaviest (FLOPs x weight) first, each up to
    ``trials_per_task`` trials (injective kernels, which do no arithmetic, get
    ``injective_trials``). The run stops starting new batches when the budget is spent.
    ``only``: tune just the kernels whose task name contains one of these strings.
    ``runner``: a MetaSchedule Runner, or a :class:`~ttrank.measure.RunnerSpec` (over RPC, every
    device under its key measures at once, and the manifest records their CPU, not the host's).
    ``prepare``: a function applied to the fused module before task extraction (for example
    ``relax.transform.AttachAttrLayoutFreeBuffers()``, which lets MetaSchedule's RewriteLayout
    pre-pack the weights). ``layout``: the convs' layout ``mod`` was loaded with
    (:func:`ttrank.frontend.load`), recorded in the manifest. ``small_trials``: the most a kernel
    under :data:`SMALL_SHARE` of the model's FLOPs gets (a max-pool, a global mean, the
    classifier's matmul), which a deep donor set would otherwise search as long as a conv.
    ``seeds``: workload hash -> schedules of that kernel measured on this CPU, for its search to
    start from (:class:`SeededDatabase`). ``search_size``: a smaller evolutionary search than a
    batch's default (:func:`fit_search`), for kernels whose candidates are slow to generate.
    """
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when tuning

    started = time.time()
    work_dir = Path(work_dir)
    earlier = read_manifest(work_dir)
    earlier = earlier.get("layout", "nchw") if earlier else layout  # runs before layouts: NCHW
    if earlier != layout:  # its kernels are other kernels: resuming would mix two searches
        raise TTRankError(f"{work_dir} holds a {earlier} tuning run; tune the {layout} layout "
                          "into another folder")
    work_dir.mkdir(parents=True, exist_ok=True)
    for note in repair_database(work_dir):
        log.warning("%s: %s", work_dir, note)
    target = target if target is not None else make_target()
    if injective_trials is None:
        injective_trials = max(4, trials_per_task // 8)
    fused = fuse(mod)
    if prepare is not None:
        fused = prepare(fused)
    extracted = ms.relax_integration.extract_tasks(fused, target)
    if only:
        # a kernel's full name selects it alone (fused_conv2d1 is not fused_conv2d11); any
        # other string selects every kernel whose name contains it
        names = {t.task_name for t in extracted}
        extracted = [t for t in extracted
                     if any(t.task_name == o if o in names else o in t.task_name for o in only)]
        if not extracted:
            raise TTRankError(f"--only {' '.join(only)} matches no kernel of this model")
    kernels = [describe(t.dispatched[0], t.task_name, t.weight) for t in extracted]
    order = sorted(range(len(extracted)), key=lambda i: -kernels[i].flops * kernels[i].weight)

    total_flops = sum(k.flops * k.weight for k in kernels)
    done = count_trials(work_dir, {k.name: k.workload_hash for k in kernels})
    progress = TuneProgress(budget_s=budget_minutes * 60 if budget_minutes else None)
    prior_search = max((d["search_s"] for d in count_trials(work_dir).values()), default=0.0)
    old = read_manifest(work_dir)
    for i in order:
        k = kernels[i]
        want = trials_per_task if k.flops > 0 else injective_trials
        if small_trials is not None and 0 < k.flops * k.weight < SMALL_SHARE * total_flops:
            want = min(want, small_trials)
        d = done.get(k.name, {})
        # a finished task is re-opened when more trials are asked for, unless its search space
        # ran out before the target it had then (logs before the target was recorded: the manifest)
        then = d.get("target") or (
            old.get("first_trials_per_task", old.get("trials_per_task", want)) if k.flops > 0
            else old.get("first_injective_trials", old.get("injective_trials", want)))
        exhausted = d.get("complete") and d.get("done", 0) < then
        target_trials = d["done"] if exhausted or (d.get("complete") and d["done"] >= want) else want
        progress.tasks.append(TaskProgress(k.name, k.flops, k.weight, target_trials,
                                           d.get("done", 0), d.get("best_s")))
    database = ms.database.JSONDatabase(work_dir=str(work_dir))
    # from the first worker pool to the last cleanup, the first Ctrl-C only asks to stop (checked
    # before each task and after each batch): raised inside a pool's shutdown, a KeyboardInterrupt
    # would leave the pool's lock held and the process hung (ttrank.util)
    with stop_at_safe_points():
        builder = WarmPoolBuilder(timeout_sec=build_timeout_sec)
        runner = runner or RunnerSpec(**TUNING_PROTOCOL)
        machine, made = None, None
        if isinstance(runner, RunnerSpec):
            machine = runner.provenance(target)
            runner = made = runner.create()
        manifest = functools.partial(_write_manifest, work_dir, model_name, target, trials_per_task,
                                     injective_trials, kernels, layout=layout, machine=machine,
                                     small_trials=small_trials)
        manifest(progress, prior_search)
        t0 = time.time()

        def clock() -> float:
            return prior_search + (time.time() - t0)

        def over_budget() -> bool:
            # search time: from when the first task's context is ready. Making it costs a one-time
            # import of TVM's tensor intrinsics (30 s or more per process), which is set-up, not search
            return (progress.budget_s is not None and progress.search_started is not None
                    and time.time() - progress.search_started >= progress.budget_s)

        def search(task, tp: TaskProgress, kernel, task_seeds: list[Seed], on_batch) -> None:
            """MetaSchedule's search of one task for the trials it has left, from ``task_seeds``."""
            remaining = tp.target_trials - tp.done
            # batches never exceed what the budget leaves, measured by this run's pace
            # it creates MetaSchedule's loggers, as tune_tasks does
            batch = min(trials_per_iter, remaining)
            strategy = search_strategy(batch, seeded=bool(task_seeds), size=search_size)
            with metaschedule_logging(), cpu_tensor_intrinsics(target):
                ctxs, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                    [task], str(work_dir), strategy=strategy, seed=seed)
            if progress.search_started is None:
                progress.search_started = time.time()
                progress.setup_s = progress.search_started - started
                progress.search_clock0 = clock()
            if STOP_REQUESTED.is_set():  # asked while the task's context was made
                raise KeyboardInterrupt
            callbacks = list(ms.measure_callback.MeasureCallback.create("default"))
            callbacks.append(_TrialLogger(work_dir / TRIALS_FILE, tp.name, kernel.workload_hash, clock, on_batch))
            with metaschedule_logging(), cpu_tensor_intrinsics(target):
                ms.tune.tune_tasks(
                    tasks=ctxs, task_weights=weights, work_dir=str(work_dir),
                    max_trials_global=remaining, max_trials_per_task=remaining,
                    num_trials_per_iter=batch, builder=builder,
                    runner=runner, database=seeded(database, ctxs[0].mod, task_seeds, target),
                    measure_callbacks=callbacks, task_scheduler="round-robin", cost_model="xgb")

        try:
            for pos, i in enumerate(order):
                tp = progress.tasks[pos]
                progress.current = pos
                remaining = tp.target_trials - tp.done
                if remaining <= 0:
                    continue
                if STOP_REQUESTED.is_set():  # a Ctrl-C that native code swallowed
                    raise KeyboardInterrupt
                if over_budget():
                    log.info("budget spent; stopping before %s", tp.name)
                    break
                task = extracted[i]

                def on_batch(n: int, lat: list[float | None], tp=tp) -> bool:
                    tp.done += n
                    ok = [x for x in lat if x is not None]
                    if ok and (tp.best_s is None or min(ok) < tp.best_s):
                        tp.best_s = min(ok)
                    progress.search_s = clock()
                    if on_progress:
                        on_progress(progress)
                    return over_budget()

                if on_progress:
                    on_progress(progress)
                task_seeds = (seeds or {}).get(kernels[i].workload_hash, [])
                for attempt in ([task_seeds, []] if task_seeds else [[]]):
                    try:
                        search(task, tp, kernels[i], attempt, on_batch)
                        break
                    except Exception as e:
                        if STOP_REQUESTED.is_set() or over_budget():
                            break
                        if not attempt:
                            raise
                        # a seed's mutation that the search cannot replay aborts the whole search
                        # (a failed check, not a rejected candidate): its trials so far are kept,
                        # and the rest are searched without seeds
                        log.warning("%s: the search from %d seeds stopped (%s); the rest of its trials "
                                    "go unseeded", tp.name, len(attempt), str(e).strip().splitlines()[0][:200])
                        if tp.done >= tp.target_trials:
                            break
                if STOP_REQUESTED.is_set():  # the logged trials and the database are kept
                    raise KeyboardInterrupt
                if over_budget() and tp.done < tp.target_trials:
                    log.info("budget spent during %s; a rerun continues it", tp.name)
                    break
                append_jsonl(work_dir / TRIALS_FILE, {"task": tp.name, "event": "task_complete",
                                                      "workload": kernels[i].workload_hash,
                                                      "search_s": round(clock(), 3),
                                                      "target": tp.target_trials})
                tp.target_trials = tp.done  # finished, possibly early on an exhausted space
                progress.search_s = clock()
                manifest(progress, prior_search)
        finally:
            builder.close()
            progress.search_s = clock()
            manifest(progress, prior_search)
            if hasattr(made, "close"):  # the fleet runner made here: its worker pool
                made.close()
    return progress


# How tuning runs time a trial: MetaSchedule's own protocol (3 calls of at least 50 ms in all,
# warm caches), so that donor records from any run compare directly.
TUNING_PROTOCOL = {"cache_flush": False, "repeat": 1, "number": 3, "min_repeat_ms": 50}


# of a seeded search's first population, the share drawn from the database (its seeds, repeated
# by SeededDatabase up to that share, then the best measured): MetaSchedule's 0.2 left 4 seeds
# among 508 random samples, and 64 trials of ResNet-18's 3x3 conv ended at 1.87 ms against seeds
# of 1.53 ms (2.37 ms unseeded).
SEEDED_MEASURED_RATIO = 0.85


# What one candidate of an evolutionary search costs to generate, in draws of the kernel's
# design space (one post-order-apply, :func:`ttrank.space.draw_seconds`) per core: sampling it,
# and each generation's mutation and cost-model scoring. Measured on YOLOv5's fused box
# decoding (three heads' sigmoids, grids and concats in one kernel of ~100 blocks): a draw took
# 2.7 s; the first batch sampled 128 candidates in 112 s, then each of 4 generations took 60 s,
# on 2 cores. A conv's draw takes 0.04 s, so its search is not limited by this.
SAMPLE_DRAWS = 0.66
EVOLVE_DRAWS = 0.36
# the smallest population worth a search; and MetaSchedule's generations per batch
MIN_POPULATION = 16
GENERATIONS = 4


@dataclass(frozen=True)
class SearchSize:
    """An evolutionary search's population and generations per batch."""

    population: int
    generations: int = GENERATIONS


def population_for(batch: int) -> int:
    """The population a batch of ``batch`` measured candidates is drawn from."""
    return max(64, min(512, 16 * batch))


def fit_search(draw_s: float, seconds: float, batch: int, cores: int) -> SearchSize | None:
    """The largest search of a kernel whose draws take ``draw_s`` that generates a batch in
    ``seconds``: MetaSchedule cannot be interrupted while it generates, so a budget is kept
    only by a search that fits it. Fewer generations before a population under 64; None when
    even :data:`MIN_POPULATION` and one generation would not fit."""
    full = population_for(batch)
    per = draw_s / max(1, cores)
    for generations in (GENERATIONS, 2, 1):
        population = min(full, int(seconds / (per * (SAMPLE_DRAWS + EVOLVE_DRAWS * generations))))
        if population >= min(full, 64) or (generations == 1 and population >= MIN_POPULATION):
            return SearchSize(population, generations)
    return None


def search_strategy(batch: int, seeded: bool = False, size: SearchSize | None = None):
    """MetaSchedule's evolutionary search with its population scaled to the batch it measures.

    Each batch samples and evolves a population (512 by default, for batches of 64) through the
    cost model: a fixed cost whatever the batch. Batches of 8 (a small task, or recommend's own
    tuning, which checks its budget after every batch) spent most of their time there: a task
    of 8 trials took 49 s, 40 of them sampling. 16 candidates per trial measured (64 to 512);
    from batches of 32, as ttrank's donors are tuned, it is MetaSchedule's 512. ``seeded`` (a
    :class:`SeededDatabase` search): most of the population starts from the seeds (and, after
    the first batch, the best measured). ``size``: a smaller search (:func:`fit_search`)."""
    from tvm.s_tir.meta_schedule.search_strategy import EvolutionarySearch  # as in tune()

    pop = size.population if size else population_for(batch)
    generations = size.generations if size else GENERATIONS
    if not seeded:
        if size is None:
            return EvolutionarySearch(population_size=pop)
        # MetaSchedule gives up when fewer than init_min_unmeasured (50) samples were drawn
        return EvolutionarySearch(population_size=pop, genetic_num_iters=generations,
                                  init_min_unmeasured=min(50, pop // 2))
    # the random part, 15% of the population, must count as enough for the search to go on
    return EvolutionarySearch(population_size=pop, init_measured_ratio=SEEDED_MEASURED_RATIO,
                              genetic_num_iters=generations,
                              init_min_unmeasured=max(1, min(50, int(pop * (1 - SEEDED_MEASURED_RATIO)) // 2)))


MS_LOGGER = "tvm.s_tir.meta_schedule"


@contextlib.contextmanager
def metaschedule_logging():
    """Let MetaSchedule (re)configure its logger, and keep every handler an application put there.

    Each ``tune_tasks`` call runs a ``logging.config.dictConfig`` that lists the handlers already
    on MetaSchedule's logger *by name*; a handler it did not create (unnamed, or unknown to that
    config: pytest >= 9.2 attaches its capture handler to every non-propagating logger, and a
    service may attach its own) makes it raise ``'NoneType' object has no attribute 'format'``
    or "Unable to configure handler". So such handlers are detached for the call and put back.
    """
    ms_logger = logging.getLogger(MS_LOGGER)
    foreign = [h for h in ms_logger.handlers
               if not (h.get_name() or "").startswith(MS_LOGGER + ".")]
    for h in foreign:
        ms_logger.removeHandler(h)
    # MetaSchedule re-creates its console handler per task at DEBUG: follow the CLI's -v
    level = logging.INFO if logging.getLogger("ttrank").isEnabledFor(logging.INFO) else logging.ERROR
    for h in ms_logger.handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(level)
    try:
        yield
    finally:
        for h in foreign:
            if h not in ms_logger.handlers:
                ms_logger.addHandler(h)


def _write_manifest(work_dir: Path, model_name: str, target, trials_per_task: int,
                    injective_trials: int, kernels, progress: TuneProgress,
                    prior_search: float, machine: dict | None = None, layout: str = "nchw",
                    small_trials: int | None = None) -> None:
    old = read_manifest(work_dir)
    prov = machine or provenance(target)  # machine: the RPC devices' own report
    earlier_cpus = old.get("cpus") or [(old.get("provenance") or {}).get("mcpu")]
    manifest = {
        "model": model_name,
        "layout": layout,
        "trials_per_task": trials_per_task,
        "injective_trials": injective_trials,
        "small_trials": small_trials,
        # what the first run asked for: how older logs without per-task targets are read
        "first_trials_per_task": old.get("first_trials_per_task", old.get("trials_per_task", trials_per_task)),
        "first_injective_trials": old.get("first_injective_trials",
                                          old.get("injective_trials", injective_trials)),
        "kernels": len(kernels),
        "trials_done": progress.trials_done,
        "trials_target": progress.trials_total,
        "complete": progress.trials_done >= progress.trials_total,
        "search_seconds": round(max(progress.search_s, prior_search), 1),
        "estimated_ms": progress.estimated_ms(),
        # a run resumed from a log written before threads were recorded ran with these
        "provenance": {"threads": runtime_threads(), **(old.get("provenance") or prov)},
        "last_run": prov,
        # every CPU the search measured on: a run resumed on another machine says so
        "cpus": sorted({*earlier_cpus, prov["mcpu"]} - {None}),
        "model_latency_ms": old.get("model_latency_ms") if old.get("trials_done") == progress.trials_done else None,
        "tasks": [{"name": t.name, "flops": t.flops, "weight": t.weight, "trials": t.done,
                   "target_trials": t.target_trials, "best_s": t.best_s} for t in progress.tasks],
    }
    write_manifest(work_dir, manifest)


def measure_model(model: LoadedModel, target, work_dir: str | Path,
                  on_start: Callable[[], None] | None = None) -> dict | None:
    """Record the whole model's latency (untuned, tuned with the work_dir, onnxruntime) in the
    tune manifest, once; returns it, or None when the manifest already had it."""
    manifest = read_manifest(work_dir)
    if manifest.get("model_latency_ms"):
        return None
    if on_start is not None:
        on_start()
    manifest["model_latency_ms"] = lat = model_latencies(model, target, open_database(work_dir))
    write_manifest(work_dir, manifest)
    return lat
