"""MetaSchedule's convergence, the baseline every speed claim is measured against.

A tuning run's ``trials.jsonl`` gives each task's best latency against search seconds; the
JSONDatabase holds the schedules, one record per trial in the same order. Latencies logged
during a long run were measured under whatever else the machine was doing, so a fair
comparison re-measures the schedules that set a new best (the curve's steps) side by side with
the competitor's: :func:`remeasure`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .donors import index_work_dir, scheduled
from .kernels import describe
from .workdir import MANIFEST_FILE, TRIALS_FILE, read_manifest, records, trials, workload_lines


@dataclass
class TaskCurve:
    """One task's search: (seconds spent on this task, best latency so far) after each batch."""

    task: str
    workload: str
    points: list[tuple[float, float | None]] = field(default_factory=list)

    @property
    def best_s(self) -> float | None:
        vals = [b for _, b in self.points if b is not None]
        return min(vals) if vals else None


def task_curves(work_dir: str | Path) -> tuple[dict[str, TaskCurve], list[tuple[float, str, float | None]]]:
    """Per-task curves, and the run's own order of batches as (search_s, task, best so far).

    Tasks are tuned one at a time, so the seconds between two logged events belong to the
    task of the later one.
    """
    curves: dict[str, TaskCurve] = {}
    order: list[tuple[float, str, float | None]] = []
    for row, t, spent, new_batch in _trial_rows(work_dir):
        c = curves.setdefault(row["task"], TaskCurve(row["task"], row.get("workload", "")))
        if new_batch:
            c.points.append((spent, c.best_s))
        lat = row.get("latency_s")
        if lat is not None and (c.points[-1][1] is None or lat < c.points[-1][1]):
            c.points[-1] = (c.points[-1][0], lat)
        if order and order[-1][0] == t and order[-1][1] == row["task"]:
            order[-1] = (t, row["task"], c.points[-1][1])
        else:
            order.append((t, row["task"], c.points[-1][1]))
    return curves, order


def _trial_rows(work_dir: str | Path):
    """Each trial of ``trials.jsonl`` as (row, run seconds, seconds its own task had been searched,
    first row of a new batch?). Every row of one batch carries the same time."""
    last_t, batch, spent = 0.0, None, {}
    for row in trials(work_dir):
        t = float(row.get("search_s") or 0.0)
        if row.get("event") == "task_complete":
            last_t, batch = max(last_t, t), None
            continue
        name = row["task"]
        new_batch = (name, t) != batch
        if new_batch:
            spent[name] = spent.get(name, 0.0) + max(0.0, t - last_t)
            last_t, batch = max(last_t, t), (name, t)
        yield row, t, spent[name], new_batch


def model_curve(curves: dict[str, TaskCurve], order, weights: dict[str, int],
                untuned_s: dict[str, float]) -> list[tuple[float, float]]:
    """Sum over kernels of weight x latency (untuned until a task has a valid trial), against
    the run's cumulative search seconds."""
    cur = {name: untuned_s.get(name) for name in weights}
    out = []
    for t, task, best in order:
        if best is not None and task in cur:
            cur[task] = min(best, cur[task]) if cur[task] is not None else best
        if all(v is not None for v in cur.values()):
            out.append((t, sum(weights[n] * cur[n] for n in weights)))
    return out


def seconds_to_match(curves: dict[str, TaskCurve], order, weights: dict[str, int],
                     untuned_s: dict[str, float], goal_s: float) -> dict[str, float | None]:
    """MetaSchedule search seconds until the kernel sum reaches ``goal_s``.

    ``as_run``: in the order the run actually tuned its tasks. ``oracle``: the least total time
    over any split of seconds among tasks (greedy on each task's lower convex hull of
    weight x best latency against its own seconds), a bound no task scheduler beats.
    None when the run never got there.
    """
    as_run = next((t for t, v in model_curve(curves, order, weights, untuned_s) if v <= goal_s), None)
    total = sum(weights[n] * untuned_s[n] for n in weights)
    segments = []
    for name, w in weights.items():
        c = curves.get(name)
        if c is None:
            continue
        pts = [(0.0, w * untuned_s[name])] + [(t, w * b) for t, b in c.points if b is not None]
        hull: list[tuple[float, float]] = []
        for p in pts:  # lower convex hull of the decreasing staircase
            if hull and p[1] >= hull[-1][1]:
                continue
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        segments += [(a[1] - b[1], b[0] - a[0]) for a, b in zip(hull, hull[1:])]
    segments.sort(key=lambda g: -g[0] / max(g[1], 1e-9))
    spent, level, oracle = 0.0, total, (0.0 if total <= goal_s else None)
    for gain, dt in segments:
        if oracle is not None:
            break
        spent += dt
        level -= gain
        if level <= goal_s:
            oracle = spent
    return {"as_run": as_run, "oracle": oracle}


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def finished_run(*work_dirs: str | Path) -> Path | None:
    """The first of ``work_dirs`` holding a finished tuning run (a run still going does not count)."""
    for d in map(Path, work_dirs):
        if (d / TRIALS_FILE).exists() and (d / MANIFEST_FILE).exists() and read_manifest(d).get("complete"):
            return d
    return None


# --------------------------------------------------------------------------------------------
# the schedules behind the curve, re-measured side by side


@dataclass
class Step:
    """A trial that set a new best for its task."""

    task: str
    seconds: float  # seconds this task had been searched when the trial finished
    global_s: float  # the run's cumulative search seconds then
    logged_s: float  # latency as logged during tuning
    trace_json: object


@dataclass
class TuningLog:
    work_dir: Path
    manifest: dict
    kernels: dict  # task name -> Kernel (with .mod)
    weights: dict[str, int]
    steps: dict[str, list[Step]]
    curves: dict[str, TaskCurve]
    order: list

    @property
    def final_s(self) -> dict[str, float | None]:
        return {n: c.best_s for n, c in self.curves.items()}


def read_log(work_dir: str | Path) -> TuningLog:
    """A ``ttrank tune`` work_dir: its curves, and per task the schedules that improved it."""
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when a log is read

    work_dir = Path(work_dir)
    manifest = json.loads((work_dir / MANIFEST_FILE).read_text())
    curves, order = task_curves(work_dir)
    name_of = {c.workload: n for n, c in curves.items()}
    kernels, by_index = {}, {}
    for i, (_, line) in enumerate(workload_lines(work_dir)):
        k = describe(ms.database.Workload.from_json(json.loads(line)).mod)
        name = name_of.get(k.workload_hash)
        if name:
            k.name = name
            kernels[name] = k
            by_index[i] = name
    traces: dict[str, list] = {n: [] for n in kernels}
    for _, rec in records(work_dir):
        if rec is not None and rec.workload in by_index:
            traces[by_index[rec.workload]].append(rec.trace_json)
    # trials and records are written in the same order, one each per measured candidate
    steps: dict[str, list[Step]] = {n: [] for n in kernels}
    seen: dict[str, int] = {}
    for row, t, spent, _ in _trial_rows(work_dir):
        name = row["task"]
        i = seen.get(name, 0)
        seen[name] = i + 1
        lat = row.get("latency_s")
        if name not in traces or i >= len(traces[name]) or lat is None:
            continue
        best = steps[name][-1].logged_s if steps[name] else None
        if best is None or lat < best:
            st = Step(name, spent, t, lat, traces[name][i])
            if steps[name] and steps[name][-1].global_s == t:
                steps[name][-1] = st  # the curve moves once per batch: keep that batch's best
            else:
                steps[name].append(st)
    weights = {t["name"]: t["weight"] for t in manifest["tasks"]}
    return TuningLog(work_dir, manifest, kernels, weights, steps, curves, order)


def step_module(kernel, step: Step):
    """The task's kernel scheduled by a step's trace (postprocessing included, same shapes)."""
    from tvm import s_tir

    sch = s_tir.Schedule(kernel.mod)
    s_tir.Trace.apply_json_to_schedule(step.trace_json, sch)
    return sch.mod


def remeasured_curves(log: TuningLog, latency: dict[str, list[float | None]]
                      ) -> tuple[dict[str, TaskCurve], list]:
    """Curves whose steps carry re-measured latencies (``latency[task][i]`` for step i)."""
    curves, order = {}, []
    for name, steps in log.steps.items():
        c = curves[name] = TaskCurve(name, log.kernels[name].workload_hash)
        best = None
        for st, lat in zip(steps, latency.get(name, [])):
            if lat is not None and (best is None or lat < best):
                best = lat
            c.points.append((st.seconds, best))
            order.append((st.global_s, name, best))
    order.sort(key=lambda x: x[0])
    return curves, order


def database_schedules(work_dir: str | Path) -> dict[str, object]:
    """workload hash -> the kernel scheduled by the database's best record for it."""
    workloads, _ = index_work_dir(work_dir, top_k=1)
    return {w.kernel.workload_hash: scheduled(w, w.records[0]) for w in workloads if w.records}


@dataclass
class SideBySide:
    """Kernel latencies measured in one run: untuned, each curve step, and the competitors."""

    untuned: dict[str, float | None] = field(default_factory=dict)
    steps: dict[str, list[float | None]] = field(default_factory=dict)
    others: dict[str, dict[str, float | None]] = field(default_factory=dict)  # label -> task -> s

    def kernel_sum(self, weights: dict[str, int], label: str | None = None) -> float:
        """Sum of weight x latency; a kernel ``label`` has no schedule for counts as untuned."""
        tot = 0.0
        for n, w in weights.items():
            lat = self.others.get(label, {}).get(n) if label else None
            if label is None:
                lat = min((x for x in self.steps.get(n, []) if x is not None), default=None)
            tot += w * (lat if lat is not None else (self.untuned.get(n) or 0.0))
        return tot

    def to_json(self) -> dict:
        return {"untuned": self.untuned, "steps": self.steps, "others": self.others}


def remeasure(log: TuningLog, others: dict[str, dict[str, object]], measurer,
              on_progress=None) -> SideBySide:
    """Measure, kernel by kernel in one batch each: the untuned kernel, every step of the
    curve, and ``others[label][workload_hash]`` (a scheduled module) where given."""
    out = SideBySide()
    baseline = measurer.baseline()
    names = sorted(log.kernels, key=lambda n: -log.weights.get(n, 1) * log.kernels[n].flops)
    for i, name in enumerate(names):
        k = log.kernels[name]
        out.untuned[name] = baseline.measure([k.mod])[0].latency_s
        mods, slots = [], []
        for j, st in enumerate(log.steps.get(name, [])):
            try:
                mods.append(step_module(k, st))
                slots.append(("step", j))
            except Exception:  # a schedule this TVM no longer replays: the step drops out
                pass
        for label, by_hash in others.items():
            if k.workload_hash in by_hash:
                mods.append(by_hash[k.workload_hash])
                slots.append((label, None))
        res = measurer.measure(mods, reference=k.mod, reference_key=k.workload_hash) if mods else []
        out.steps[name] = [None] * len(log.steps.get(name, []))
        for (label, j), m in zip(slots, res):
            lat = m.latency_s if m.ok else None
            if label == "step":
                out.steps[name][j] = lat
            else:
                out.others.setdefault(label, {})[name] = lat
        if on_progress:
            on_progress(i + 1, len(names), name)
    return out
