"""The MetaSchedule work_dir format, read and written in one place.

A work_dir is MetaSchedule's JSONDatabase (``database_workload.json`` and
``database_tuning_record.json``, either optionally gzipped) plus what ``ttrank tune`` adds:
``trials.jsonl`` (every trial with its cumulative search time) and ``tune_manifest.json``.
Donor logs from others are data: parsed as JSON here, never evaluated (see :mod:`ttrank.safety`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import StoreError
from .safety import unsafe_annotation
from .util import (atomic_write_bytes, atomic_write_json, atomic_write_text, cache_dir, file_lock, open_text,
                   read_jsonl, sha256_of)

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
TRIALS_FILE = "trials.jsonl"
MANIFEST_FILE = "tune_manifest.json"
# how the model whose kernels a database holds was loaded (written by recommend)
LOADED_AS_FILE = "loaded_as.json"
# per record (by trace hash), the seconds its program took to compile on its own workload
# (bench/build_seconds.py): recommend keeps the rare very slow builds for a kernel's first pick
BUILD_FILE = "build_seconds.json"
# MetaSchedule records a failed build or run as 1e10 s; anything from 1e9 s on is a failure
FAILED_SECS = 1e9


def db_file(work_dir: str | Path, name: str) -> Path | None:
    """``work_dir/name``, or its gzipped copy, whichever exists."""
    work_dir = Path(work_dir)
    for p in (work_dir / name, work_dir / (name + ".gz")):
        if p.exists():
            return p
    return None


def is_work_dir(path: str | Path) -> bool:
    return db_file(path, WORKLOAD_FILE) is not None


def database_files(work_dir: str | Path, what: str = "") -> tuple[Path, Path]:
    """(workload file, record file) of a work_dir, or a :class:`StoreError` naming both."""
    wl, rec = db_file(work_dir, WORKLOAD_FILE), db_file(work_dir, RECORD_FILE)
    if wl is None or rec is None:
        raise StoreError(f"{work_dir}: not a MetaSchedule work_dir (needs {WORKLOAD_FILE} and "
                         f"{RECORD_FILE}{what})")
    return wl, rec


@dataclass
class Record:
    """One line of the record file: a trace of the ``workload``-th workload and its run times."""

    lineno: int
    workload: int
    trace_json: Any
    run_secs: list[float]
    target_json: Any

    @property
    def latency_s(self) -> float:
        """The best run (a record with no runs counts as failed)."""
        return min(self.run_secs) if self.run_secs else FAILED_SECS * 10

    @property
    def failed(self) -> bool:
        return self.latency_s >= FAILED_SECS


def workload_lines(work_dir: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of each non-blank line of the workload file; the records refer to
    workloads by their position in this sequence."""
    with open_text(db_file(work_dir, WORKLOAD_FILE)) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def records(work_dir: str | Path) -> Iterator[tuple[int, Record | None]]:
    """(line number, :class:`Record`) of each non-blank line of the record file; None for a
    line that is not a record (the caller decides whether that matters)."""
    with open_text(db_file(work_dir, RECORD_FILE)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                idx, rec = json.loads(line)
                yield lineno, Record(lineno, idx, rec[0], [float(s) for s in rec[1]], rec[2])
            except Exception:
                yield lineno, None


def open_database(work_dir: str | Path):
    """Open a work_dir as TVM's JSONDatabase (gzipped files are unpacked to a cache), refusing
    one whose records carry annotations TVM's code generator reads as code."""
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when a database is opened

    work_dir = Path(work_dir)
    wl, rec = database_files(work_dir, ", optionally .gz")
    if wl.suffix == ".gz" or rec.suffix == ".gz":
        out = cache_dir() / "unpacked" / sha256_of(wl, rec)[:16]
        for src in (wl, rec):
            dst = out / src.name.removesuffix(".gz")
            if not dst.exists():
                with open_text(src) as f:
                    atomic_write_bytes(dst, f.read().encode())
        wl, rec = out / WORKLOAD_FILE, out / RECORD_FILE
    # compiling with a database replays its traces: the same door as a donor's (safety.py)
    with open_text(rec) as f:
        for lineno, line in enumerate(f, 1):
            try:
                key = unsafe_annotation(json.loads(line)[1][0])
            except (ValueError, IndexError, TypeError, KeyError):
                continue  # malformed: TVM's loader decides
            if key is not None:
                raise StoreError(f"{work_dir}: record {lineno} annotates with {key!r}, which TVM's "
                                 "code generator reads as code; refused")
    return ms.database.JSONDatabase(path_workload=str(wl), path_tuning_record=str(rec),
                                    allow_missing=False)


def read_manifest(work_dir: str | Path) -> dict:
    """``tune_manifest.json`` ({} when absent or unreadable)."""
    try:
        return json.loads((Path(work_dir) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_manifest(work_dir: str | Path, manifest: dict) -> None:
    atomic_write_json(Path(work_dir) / MANIFEST_FILE, manifest)


def write_loaded_as(work_dir: str | Path, layout: str, fast_math: bool) -> None:
    """Record how the model whose kernels ``work_dir`` holds was loaded: workloads match only a
    model loaded the same way (its convs' layout, its math)."""
    atomic_write_json(Path(work_dir) / LOADED_AS_FILE, {"layout": layout, "fast_math": fast_math})


def loaded_as(work_dir: str | Path) -> dict:
    """How the model of ``work_dir``'s kernels was loaded: {"layout", "fast_math"} as recommend
    wrote them, the layout of a tune run's manifest, or {} when neither says."""
    try:
        return json.loads((Path(work_dir) / LOADED_AS_FILE).read_text())
    except (OSError, ValueError):
        layout = read_manifest(work_dir).get("layout")
        return {"layout": layout} if layout else {}


def read_build_seconds(work_dir: str | Path) -> dict[str, float]:
    """``build_seconds.json``'s seconds by record trace hash ({} when absent or unreadable)."""
    try:
        return {str(k): float(v) for k, v in
                json.loads((Path(work_dir) / BUILD_FILE).read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_build_seconds(work_dir: str | Path, seconds: dict[str, float], provenance: dict) -> None:
    atomic_write_json(Path(work_dir) / BUILD_FILE, {
        "what": "seconds to compile each record's program on its own workload (tvm.compile, one "
                "process), by the record's trace hash: python bench/build_seconds.py",
        "provenance": provenance, "seconds": {k: round(v, 3) for k, v in sorted(seconds.items())}})


def merge_work_dir(src: str | Path, dest: str | Path) -> dict[str, int]:
    """Add ``src``'s tuning (workloads, records, trials, manifest tasks) to the work_dir ``dest``
    (made when absent), as one database: a workload both hold is kept once and ``src``'s records
    point at it; a record or trial ``dest`` already holds is not added again, so a merge can be
    repeated. Plain (not gzipped) work_dirs, as ``ttrank tune`` writes them. Returns the counts
    added."""
    src, dest = Path(src), Path(dest)
    database_files(src)
    if any(p.suffix == ".gz" for p in (db_file(dest, WORKLOAD_FILE), db_file(dest, RECORD_FILE)) if p):
        raise StoreError(f"{dest}: gzipped; merge into a plain work_dir")
    dest.mkdir(parents=True, exist_ok=True)
    with file_lock(dest):
        old_wl = [line.rstrip("\n") for _, line in workload_lines(dest)] if is_work_dir(dest) else []
        index = {line: i for i, line in enumerate(old_wl)}
        remap, new_wl = {}, []
        for i, (_, line) in enumerate(workload_lines(src)):
            line = line.rstrip("\n")
            if line not in index:
                index[line] = len(old_wl) + len(new_wl)
                new_wl.append(line)
            remap[i] = index[line]
        old_rec = [line for line in (dest / RECORD_FILE).read_text().splitlines() if line.strip()] \
            if (dest / RECORD_FILE).exists() else []
        seen = {_canonical(line) for line in old_rec}
        new_rec = []
        with open_text(db_file(src, RECORD_FILE)) as f:
            for line in f:
                if not line.strip():
                    continue
                idx, rec = json.loads(line)  # the record as TVM wrote it, its workload renumbered
                if idx not in remap:
                    raise StoreError(f"{src}: a record names workload {idx}; the log has {len(remap)}")
                line = json.dumps([remap[idx], rec], separators=(",", ":"))
                if (key := _canonical(line)) not in seen:
                    seen.add(key)
                    new_rec.append(line)
        old_trials = (dest / TRIALS_FILE).read_text().splitlines() if (dest / TRIALS_FILE).exists() else []
        have = set(old_trials)
        add_trials = [line for line in (src / TRIALS_FILE).read_text().splitlines()
                      if line.strip() and line not in have] if (src / TRIALS_FILE).exists() else []
        if not (new_wl or new_rec or add_trials):  # merged before: the manifest counted it then
            return {"workloads": 0, "records": 0, "trials": 0}
        # the workload file first: a reader between the two writes sees records it can resolve
        atomic_write_text(dest / WORKLOAD_FILE, "".join(f"{w}\n" for w in [*old_wl, *new_wl]))
        atomic_write_text(dest / RECORD_FILE, "".join(f"{r}\n" for r in [*old_rec, *new_rec]))
        atomic_write_text(dest / TRIALS_FILE, "".join(f"{t}\n" for t in [*old_trials, *add_trials]))
        write_manifest(dest, _merged_manifest(read_manifest(dest), read_manifest(src)))
    return {"workloads": len(new_wl), "records": len(new_rec), "trials": len(add_trials)}


def _canonical(line: str) -> str:
    return json.dumps(json.loads(line), separators=(",", ":"), sort_keys=True)


def _merged_manifest(old: dict, new: dict) -> dict:
    """One manifest for two tuning runs of one network: their tasks (the later run's where both
    tuned one), trial counts and search time summed, complete only if both are."""
    if not old:
        return dict(new)
    tasks = {t["name"]: t for t in [*old.get("tasks", []), *new.get("tasks", [])]}
    out = {**old, "last_run": new.get("last_run", new.get("provenance")),
           "tasks": list(tasks.values()), "kernels": len(tasks),
           "trials_done": sum(t.get("trials", 0) for t in tasks.values()),
           "trials_target": sum(t.get("target_trials", 0) for t in tasks.values()),
           "complete": bool(old.get("complete") and new.get("complete")),
           "search_seconds": round((old.get("search_seconds") or 0) + (new.get("search_seconds") or 0), 1),
           "cpus": sorted({*old.get("cpus", []), *new.get("cpus", [])}),
           "estimated_ms": None, "model_latency_ms": None}  # neither run's estimate covers both
    return out


def trials(work_dir: str | Path) -> Iterator[dict]:
    """The rows of ``trials.jsonl`` (none when absent)."""
    return read_jsonl(Path(work_dir) / TRIALS_FILE)


def task_names(work_dir: str | Path) -> dict[str, str]:
    """workload hash -> task name, from the trials log (absent in foreign logs)."""
    return {row["workload"]: row["task"] for row in trials(work_dir)
            if row.get("workload") and row.get("task")}


# How a work_dir's folder names its network (the store, leave-one-out and the cost model read it)
NATIVE_PREFIX = "native-"  # native-<mcpu>-<network>: ttrank adapt's native tuning
# here-<model>: what recommend tuned for a model on this machine. Never a shipped set's name: a
# user's resnet18.onnx would otherwise share the folder name, and so the record ids, of v1's resnet18
HERE_PREFIX = "here-"
# "<network>@<set>": a donor set beside v1 (bench/tune_donors.py --layout/--threads)
SET_SEPARATOR = "@"


def network_of(work_dir: str | Path) -> str:
    """The donor network a work_dir holds: its folder name, or for a native one or another
    donor set's the network it was tuned in, so leaving a network out leaves them out too."""
    name = Path(work_dir).name.split(SET_SEPARATOR, 1)[0]
    if name.startswith(NATIVE_PREFIX) and name.count("-") >= 2:
        return name[len(NATIVE_PREFIX):].split("-", 1)[1]
    return name.removeprefix(HERE_PREFIX)
