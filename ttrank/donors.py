"""Donor schedules: MetaSchedule JSONDatabase work_dirs, indexed by workload class.

A store is a list of work_dirs (ours under ``datasets/donors/<network>/``, or anyone's
MetaSchedule logs). Each is parsed once into an index (cached by the files' content hash):
per workload, its :class:`~ttrank.kernels.Kernel` description and its best few records,
with provenance. Bad lines, records for another target and unparsable workloads are skipped
and counted, never fatal. The whole store is then kept as one compact index (the work_dirs'
indexes plus every record's donor features, the workloads' TIR left as text until a transfer
needs it), keyed by the database files' paths, sizes and mtimes: a run that finds it loads
the store without reading, hashing or parsing any log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import gzip
import hashlib
import json
import logging
import math
import pickle
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from . import locations
from .errors import StoreError
from .features import FEATURE_NAMES, FEATURE_VERSION, PairFeaturizer, donor_features, donor_row, tile_items
from .kernels import Kernel, anchor_family, describe
from .safety import unsafe_annotation
from .target import host_cpu_model, target_key
from .util import atomic_write_bytes, atomic_write_json, cache_dir, file_lock, fill_caches, sha256_of
from .workdir import (HERE_PREFIX, MANIFEST_FILE, NATIVE_PREFIX, RECORD_FILE, SET_SEPARATOR, TRIALS_FILE, WORKLOAD_FILE,  # noqa: F401 - NATIVE_PREFIX, SET_SEPARATOR, network_of: the store's names
                      database_files, db_file, is_work_dir, merge_work_dir, network_of, read_build_seconds,
                      read_manifest, records, task_names, workload_lines)

log = logging.getLogger("ttrank")

INDEX_VERSION = 4  # 3: records with annotations TVM reads as code are skipped; 4: ids by source
STORE_INDEX_VERSION = 2  # the whole-store index (see _store_index); + INDEX_VERSION and FEATURE_VERSION
EXPECTED_SKIPS = ("failed trial", "other target")  # skips that say nothing is wrong with a log


@dataclass
class DonorRecord:
    """One tuned schedule of one donor kernel, with provenance."""

    id: str  # "<network>/<workload hash>/<rank>"
    network: str
    kernel: str  # the donor kernel's task name (or its class where unknown)
    workload_key: str  # "<network>/<workload hash>"
    rank: int  # 0 = the best record of this donor kernel
    latency_s: float
    trace_json: Any = field(repr=False)
    target: str = ""
    provenance: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @cached_property
    def trace_hash(self) -> str:
        """The schedule's content hash. ``id`` names a rank, and while a donor log still grows
        the record at a rank can change: a measurement keeps this hash to know it is stale."""
        return hashlib.sha256(json.dumps(self.trace_json, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class DonorWorkload:
    network: str
    kernel: Kernel
    # the JSONDatabase workload line, parsed; or its JSON text (the store index keeps the TIR,
    # most of its bytes, unparsed: only the few workloads a transfer touches are ever read)
    workload_json: Any = field(repr=False)
    records: list[DonorRecord] = field(default_factory=list)
    # the work_dir's folder name: two sets of one network (v1 and a native or packed set) tune
    # some of the same workloads, and their records must not share ids
    source: str = ""

    _mod: Any = field(default=None, repr=False, compare=False)
    _workload: Any = field(default=None, repr=False, compare=False)  # MetaSchedule's, for :meth:`add`

    @property
    def key(self) -> str:
        return f"{self.source or self.network}/{self.kernel.workload_hash}"

    def module(self):
        """The donor workload's IRModule, parsed once."""
        if self._mod is None:
            from tvm.s_tir import meta_schedule as ms

            wl = json.loads(self.workload_json) if isinstance(self.workload_json, str) else self.workload_json
            self._mod = ms.database.Workload.from_json(wl).mod
        return self._mod

    @property
    def best_s(self) -> float:
        return self.records[0].latency_s if self.records else float("inf")

    @classmethod
    def of_kernel(cls, network: str, kernel: Kernel) -> DonorWorkload:
        """``kernel`` itself as a donor workload with no records yet: schedules made for the
        kernel (design-space draws, templates) enter as its records (:meth:`add`)."""
        from tvm.s_tir import meta_schedule as ms

        workload = ms.database.Workload(kernel.mod)
        return cls(network, kernel, workload.as_json(), source=network, _mod=kernel.mod, _workload=workload)

    def add(self, name: str, sch, target) -> DonorRecord:
        """A schedule of this workload (an ``s_tir.Schedule``) as its next record, unmeasured,
        with the id ``<network>/<workload hash>/<name>``."""
        from tvm.s_tir import meta_schedule as ms

        if self._workload is None:
            self._workload = ms.database.Workload(self.module())
        # the trace as a database line holds it (a donor record's form)
        trace = ms.database.TuningRecord(sch.trace, self._workload).as_json()[0]
        rec = DonorRecord(id=f"{self.network}/{self.kernel.workload_hash}/{name}", network=self.network,
                          kernel=self.kernel.name, workload_key=self.key, rank=len(self.records),
                          latency_s=math.nan, trace_json=trace, target=str(target))
        self.records.append(rec)
        return rec


@dataclass
class LoadReport:
    work_dir: str
    network: str
    workloads: int = 0
    records: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)

    def skip(self, why: str, message: str | None = None) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1
        if message and len(self.messages) < 5:
            self.messages.append(message)


def _parse_target_key(target_json: Any) -> str:
    try:
        d = target_json if isinstance(target_json, dict) else json.loads(str(target_json))
        return target_key(d)
    except (ValueError, TypeError):
        return str(target_json)


def index_work_dir(work_dir: str | Path, network: str | None = None, top_k: int = 5,
                   target=None) -> tuple[list[DonorWorkload], LoadReport]:
    """Parse a JSONDatabase work_dir into donor workloads with their best ``top_k`` records.

    ``target``: keep only records whose target has the same kind/mcpu/mtriple (None: any).
    """
    return _index_work_dir(Path(work_dir), network, top_k, target_key(target) if target is not None else None)


def _index_work_dir(work_dir: Path, network: str | None, top_k: int, want_target: str | None
                    ) -> tuple[list[DonorWorkload], LoadReport]:
    """:func:`index_work_dir` with the target as its key (what a worker process is given)."""
    from tvm.s_tir import meta_schedule as ms  # TVM loads slowly: only when a log is parsed

    source = network or work_dir.name
    network = network or network_of(work_dir)
    report = LoadReport(str(work_dir), network)
    wl_path, rec_path = database_files(work_dir)
    names = task_names(work_dir)
    manifest = read_manifest(work_dir)

    workloads: list[DonorWorkload | None] = []
    for lineno, line in workload_lines(work_dir):
        try:
            wl_json = json.loads(line)
            wl = ms.database.Workload.from_json(wl_json)
            kernel = describe(wl.mod)
        except Exception as e:  # malformed JSON, or TIR this TVM cannot parse
            report.skip("bad workload", f"{wl_path.name}:{lineno}: {type(e).__name__}")
            workloads.append(None)  # keep indices aligned with the records' references
            continue
        kernel.name = names.get(kernel.workload_hash, kernel.name)
        workloads.append(DonorWorkload(network, kernel, wl_json, source=source))
    report.workloads = sum(1 for w in workloads if w is not None)

    per_wl: dict[int, list[tuple[float, Any, str]]] = defaultdict(list)
    for lineno, rec in records(work_dir):
        report.records += 1
        if rec is None:
            report.skip("malformed line", f"{rec_path.name}:{lineno}: malformed record")
            continue
        key = unsafe_annotation(rec.trace_json)
        if key is not None:  # code for TVM's code generator, not a schedule (see safety.py)
            report.skip("unsafe annotation", f"{rec_path.name}:{lineno}: annotation {key[:60]!r}")
            continue
        idx = rec.workload
        if not (0 <= idx < len(workloads)) or workloads[idx] is None:
            report.skip("unknown workload")
            continue
        tkey = _parse_target_key(rec.target_json)
        if want_target is not None and tkey != want_target:
            report.skip("other target")
            continue
        if rec.failed:
            report.skip("failed trial")
            continue
        target_json = rec.target_json
        per_wl[idx].append((rec.latency_s, rec.trace_json,
                            json.dumps(target_json) if not isinstance(target_json, str) else target_json))

    prov = (manifest or {}).get("provenance", {})
    out = []
    for idx, recs in per_wl.items():
        dw = workloads[idx]
        recs.sort(key=lambda r: r[0])
        seen = set()
        for lat, trace_json, tjson in recs:
            sig = json.dumps(trace_json, sort_keys=True)
            if sig in seen:  # the same schedule measured twice
                continue
            seen.add(sig)
            rank = len(dw.records)
            dw.records.append(DonorRecord(f"{dw.key}/{rank}", network, dw.kernel.name, dw.key, rank,
                                          lat, trace_json, tjson, prov))
            if len(dw.records) >= top_k:
                break
        report.kept += len(dw.records)
        out.append(dw)
    # failed trials and other targets' records are what any MetaSchedule log holds; the rest is damage
    damage = {why: n for why, n in report.skipped.items() if why not in EXPECTED_SKIPS}
    if damage:
        log.warning("%s: skipped %s", work_dir, ", ".join(f"{n} {why}" for why, n in damage.items()))
    elif report.skipped:
        log.info("%s: skipped %s", work_dir, ", ".join(f"{n} {why}" for why, n in report.skipped.items()))
    return out, report


# --------------------------------------------------------------------------------------------
# The store


class DonorStore:
    """Donor workloads from several work_dirs, indexed by anchor op and workload class."""

    def __init__(self, workloads: list[DonorWorkload], reports: list[LoadReport] | None = None,
                 donor_features: dict[str, tuple] | None = None):
        self.workloads = workloads
        self.reports = reports or []
        self._by_anchor: dict[str, list[DonorWorkload]] = defaultdict(list)
        self._by_class: dict[str, list[DonorWorkload]] = defaultdict(list)
        # per record id, :func:`ttrank.features.donor_features` (the store index brings them)
        self._donor_features: dict[str, tuple] = dict(donor_features or {})
        # per record id, for ranking: (parsed trace, d_ and s_ row, its tiles hashable)
        self._donor_rows: dict[str, tuple] = {}
        self._build_seconds: dict[str, float] | None = None
        # what a measurement row names, indexed on first use (:meth:`measured`): records by id, and
        # by (workload key, trace hash) for rows whose record changed rank, and by (donor network,
        # workload hash, trace hash) for rows whose record moved to another set
        self._by_id: dict[str, tuple[DonorWorkload, DonorRecord]] | None = None
        self._by_trace: dict[tuple, str] | None = None
        for w in workloads:
            self._by_anchor[w.kernel.anchor_op].append(w)
            self._by_class[w.kernel.workload_class].append(w)

    @classmethod
    def load(cls, work_dirs: list[str | Path] | None = None, top_k: int = 5, target=None,
             use_cache: bool = True) -> DonorStore:
        """Load work_dirs (default: the shipped datasets plus the user's added donors): from
        the store index when one matches their files, else indexed (and the index written)."""
        dirs = [Path(d) for d in work_dirs] if work_dirs is not None else default_work_dirs()
        with contextlib.ExitStack() as locks:
            for d in dirs:  # never halfway through a `donors add` into one of them
                locks.enter_context(file_lock(d, shared=True))
            return cls(*_store_index(dirs, top_k, target, use_cache))

    def features_of_records(self) -> dict[str, tuple]:
        """Every record's donor features (computed where missing): what the store index keeps."""
        for w in self.workloads:
            for r in w.records:
                if r.id not in self._donor_features:
                    self._donor_features[r.id] = donor_features(w.kernel, r.trace_json)
        return self._donor_features

    def pair_features(self, target: Kernel, w: DonorWorkload, r: DonorRecord,
                      cpu: dict | None = None) -> dict[str, float]:
        """The features of one pair by name (:meth:`pair_rows`); ``cpu``:
        :func:`ttrank.target.cpu_description` of the CPU that will run it."""
        return dict(zip(FEATURE_NAMES, map(float, self.pair_rows(target, [(w, r)], cpu)[0])))

    def pair_rows(self, target: Kernel, pairs: list[tuple[DonorWorkload, DonorRecord]],
                  cpu: dict | None = None) -> np.ndarray:
        """The feature rows of ``target`` paired with each of ``pairs``, in
        :data:`~ttrank.features.FEATURE_NAMES` order (what the ranker reads); each record's own
        part is computed once per store."""
        fz = PairFeaturizer(target, cpu)
        rows = []
        for w, r in pairs:
            part = self._donor_rows.get(r.id)
            if part is None:
                trace, df = self._donor_features.get(r.id) or donor_features(w.kernel, r.trace_json)
                self._donor_features[r.id] = (trace, df)
                part = self._donor_rows[r.id] = (trace, donor_row(df), tile_items(trace))
            trace, ds, tiles = part
            rows.append(fz.row(w.kernel, trace, ds, r.latency_s, w.best_s, r.rank, r.provenance, tiles))
        return np.asarray(rows, dtype=np.float32).reshape(len(rows), len(FEATURE_NAMES))

    def build_seconds(self) -> dict[str, float]:
        """Each record's measured compile seconds, by trace hash, where its set has them."""
        if self._build_seconds is None:
            self._build_seconds = {}
            for r in self.reports:
                self._build_seconds.update(read_build_seconds(r.work_dir))
        return self._build_seconds

    @property
    def networks(self) -> list[str]:
        return sorted({w.network for w in self.workloads})

    def records(self) -> list[DonorRecord]:
        return [r for w in self.workloads for r in w.records]

    def by_record_id(self) -> dict[str, tuple[DonorWorkload, DonorRecord]]:
        """Every record by its id, with its workload (a measurement row names its record by id)."""
        return {r.id: (w, r) for w in self.workloads for r in w.records}

    def measured(self, row: dict) -> tuple[DonorWorkload, DonorRecord] | None:
        """The workload and record a measurement ``row`` measured, as the store holds them now,
        or None. A row names its record by rank, and a set that gains better records (a
        published adaptation merged into it) ranks its old ones lower: the row follows its
        schedule (its ``record_hash``) to the new rank, where the store still keeps it: one
        publish of znver3's adaptation had made 382 rows of four other CPUs stale, and 247 of
        them follow their schedules (the rest fell out of the kept top-k). A row that names
        another set (an adaptation's ``native-MCPU-NET`` records, published since as
        ``NET@LAYOUT-tN-MCPU``) follows its schedule of the same workload into a set of the same
        donor network."""
        if self._by_id is None:
            self._by_id = self.by_record_id()
        hit = self._by_id.get(row["record"])
        h = row.get("record_hash")
        if hit is not None and (h is None or hit[1].trace_hash == h):
            return hit
        if h is None:
            return None
        if self._by_trace is None:
            self._by_trace = {}
            for r in sorted(self.records(), key=lambda r: r.id):
                self._by_trace.setdefault((r.workload_key, r.trace_hash), r.id)
                # the same schedule of the same workload in any set of the same donor network
                self._by_trace.setdefault((r.network, r.workload_key.rsplit("/", 1)[-1], r.trace_hash), r.id)
        key = str(row["record"]).rsplit("/", 1)[0]
        rid = self._by_trace.get((key, h))
        if rid is None and row.get("donor_network"):
            rid = self._by_trace.get((row["donor_network"], key.rsplit("/", 1)[-1], h))
        return self._by_id.get(rid) if rid is not None else None

    def by_class(self, workload_class: str) -> list[DonorWorkload]:
        return list(self._by_class.get(workload_class, []))

    def compatible(self, kernel: Kernel, exclude_networks: set[str] | frozenset = frozenset()
                   ) -> list[tuple[DonorWorkload, DonorRecord]]:
        """Every donor record whose kernel has the same loop nest under the same anchor op
        (or a variant of it, as a transposed conv is of a conv)."""
        out = []
        for w in (w for op in anchor_family(kernel.anchor_op) for w in self._by_anchor.get(op, [])):
            if w.network in exclude_networks or not kernel.compatible(w.kernel):
                continue
            out.extend((w, r) for r in w.records)
        return out

    def without(self, networks: set[str]) -> DonorStore:
        return DonorStore([w for w in self.workloads if w.network not in networks], self.reports,
                          self._donor_features)


def shipped_work_dirs() -> list[Path]:
    """The shipped donor datasets alone (``datasets/donors/*`` of the data home)."""
    root = locations.shipped_donors(required=True)
    return sorted(p for p in root.iterdir() if p.is_dir())


def default_work_dirs() -> list[Path]:
    """The shipped donor datasets, then the donors the user added."""
    dirs = []
    shipped = locations.shipped_donors()
    for root in (shipped, user_donor_dir()):
        if root is not None and root.exists():
            dirs.extend(sorted(p for p in root.iterdir() if p.is_dir() and is_work_dir(p)))
    if not dirs and shipped is None:  # not "an empty store": no data was found at all
        locations.data_home(required=True)
    return dirs


def user_donor_dir() -> Path:
    return cache_dir() / "donors"


def native_dir(network: str, mcpu: str, layout: str = "nchw") -> Path:
    """Where ``ttrank adapt`` tunes ``network``'s kernels natively on CPU ``mcpu`` (a donor
    work_dir of the user's store; one per conv layout)."""
    name = f"{NATIVE_PREFIX}{mcpu}-{network}"
    return user_donor_dir() / (name if layout == "nchw" else f"{name}{SET_SEPARATOR}{layout}")


def native_sets(network: str, mcpu: str, layout: str = "nchw") -> list[Path]:
    """Every work_dir holding ``network``'s kernels tuned on CPU ``mcpu`` in ``layout``: the
    user's native tuning (:func:`native_dir`) and the shipped donor sets of that CPU (an earlier
    adaptation's, published as ``NET@LAYOUT-tN-MCPU``)."""
    shipped = locations.shipped_donors()
    found = sorted(shipped.glob(f"{network}{SET_SEPARATOR}{layout}-t*-{mcpu}")) if shipped else []
    return [d for d in (native_dir(network, mcpu, layout), *found) if d.is_dir()]


def publish_native(src_root: Path, dest_root: Path, mcpu: str | None = None) -> list[tuple[Path, Path, dict]]:
    """Publish the native tuning under ``src_root`` (an adaptation's donor store: its
    ``native-MCPU-NET[@LAYOUT]`` work_dirs) as donor sets of ``dest_root``
    (``NET@LAYOUT-tTHREADS-MCPU``), merged into a set an earlier adaptation of that CPU began.
    Only ``mcpu``'s, when given. Returns (source, set, what was added) per work_dir."""
    out = []
    for src in sorted(p for p in src_root.glob(f"{NATIVE_PREFIX}*") if is_work_dir(p)):
        prov = read_manifest(src).get("provenance") or {}
        if not prov.get("mcpu") or (mcpu and prov["mcpu"] != mcpu):
            continue
        layout = src.name.split(SET_SEPARATOR, 1)[1] if SET_SEPARATOR in src.name else "nchw"
        dest = donor_set_dir(dest_root, network_of(src), layout, prov.get("threads", 1), prov["mcpu"])
        out.append((src, dest, merge_work_dir(src, dest)))
    return out


def write_store_manifest(root: Path) -> Path:
    """``datasets/donors/manifest.json``: per donor set, its layout, trials, search time, CPU and
    runtime threads, read from each set's own ``tune_manifest.json``."""
    nets = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST_FILE).exists()):
        m = read_manifest(d)
        prov = m.get("provenance", {})
        nets[d.name] = {
            "layout": m.get("layout", "nchw"),
            "trials_per_task": m.get("trials_per_task"), "trials": m.get("trials_done"),
            "trials_target": m.get("trials_target"), "complete": m.get("complete"),
            "search_seconds": m.get("search_seconds"), "kernels": m.get("kernels"),
            "model_latency_ms": {k: v for k, v in (m.get("model_latency_ms") or {}).items()
                                 if k != "provenance"} or None,
            "cpu": prov.get("cpu"), "mcpu": prov.get("mcpu"), "cores": prov.get("cores"),
            # runs from before ttrank recorded it used TVM's default here: one thread
            "runtime_threads": prov.get("threads", 1),
            "tvm": prov.get("tvm"), "started": prov.get("date")}
    path = root / "manifest.json"
    atomic_write_json(path, {
        "how": "python bench/tune_donors.py --budget-minutes M (ttrank tune per network, resumable); "
               "NET@LAYOUT-tN-MCPU: a set of another layout, thread count or CPU (tune_donors.py "
               "--layout/--threads, or an adaptation's native tuning: bench/publish_native.py)",
        "runtime_threads": "per set: the TVM runtime threads it was tuned with (v1: one, TVM's default "
                           "on a 2-core host); recommend and the cross-measurements run with one per core",
        "search_seconds_total": round(sum(n["search_seconds"] or 0 for n in nets.values()), 1),
        "networks": nets})
    return path


def tuned_here_dir(model: str, layout: str = "nchw") -> Path:
    """Where recommend tunes what no donor covers in ``model`` (a folder per layout: a tuning
    run holds one), named apart from every shipped set (:data:`HERE_PREFIX`)."""
    name = f"{HERE_PREFIX}{model}"
    return user_donor_dir() / (name if layout == "nchw" else f"{name}{SET_SEPARATOR}{layout}")


def donor_set_dir(root: Path, network: str, layout: str, threads: int, mcpu: str) -> Path:
    """Where a donor set other than v1 (NCHW, one thread) keeps ``network``'s tuning run."""
    return root / f"{network}{SET_SEPARATOR}{layout}-t{threads}-{mcpu}"


def store_index_path(dirs: list[Path], top_k: int = 5, target=None) -> Path:
    """Where the store index of ``dirs`` lives: its name is a hash of each work_dir's database
    files (path, size, mtime; a `donors add`, a retune or a growing log changes them), the
    index formats, ``top_k`` and the target. Stat, not content: no log is read to find it."""
    h = hashlib.sha256(f"v{STORE_INDEX_VERSION}.{INDEX_VERSION}.{FEATURE_VERSION} {top_k} "
                       f"{target_key(target) if target is not None else 'any'}".encode())
    for d in dirs:
        for f in (db_file(d, WORKLOAD_FILE), db_file(d, RECORD_FILE)):
            if f is None:
                raise StoreError(f"{d}: not a MetaSchedule work_dir")
            st = f.stat()
            h.update(f"\n{f.resolve()} {st.st_size} {st.st_mtime_ns}".encode())
    return cache_dir() / "index" / f"store-{h.hexdigest()[:24]}.pkl"


def _store_index(dirs: list[Path], top_k: int, target, use_cache: bool
                 ) -> tuple[list[DonorWorkload], list[LoadReport], dict[str, tuple]]:
    """(workloads, reports, donor features) of ``dirs``, from the store index if it is there.

    The index is a pickle that only ttrank writes, in the user's own cache (donor logs
    themselves are never unpickled: they are parsed as JSON, see ``index_work_dir``)."""
    path = store_index_path(dirs, top_k, target)
    if use_cache and path.exists():
        try:
            with open(path, "rb") as f, _no_gc():
                data = pickle.load(f)
            if data.get("version") == STORE_INDEX_VERSION and len(data["reports"]) == len(dirs):
                for rep, d in zip(data["reports"], dirs):
                    rep.work_dir = str(d)  # as given (an index written before this was fixed)
                return data["workloads"], data["reports"], data["donor_features"]
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, KeyError, TypeError):
            log.info("store index %s unreadable; rebuilding", path)
    tkey = target_key(target) if target is not None else "any"
    paths = {d: _index_cache_path(d, top_k, tkey) for d in dirs}  # each hashes its logs: once
    if use_cache:
        # a new store (a fresh install: 40 work_dirs, 40 s on one core) is indexed on every core;
        # the parent then reads the workers' caches
        fill_caches(paths, _write_index_cache, top_k, tkey)
    workloads, reports = [], []
    for d in dirs:
        ws, rep = _cached_index(d, top_k, target, use_cache, paths[d])
        workloads.extend(ws)
        reports.append(rep)
    store = DonorStore(workloads, reports)
    feats = store.features_of_records()
    if use_cache:
        # the TIR as text: most of the index's bytes, read back only for the workloads transferred
        # (and no TVM object: a freshly parsed kernel holds its IRModule, rebuilt from the text)
        compact = [DonorWorkload(w.network, dataclasses.replace(w.kernel, mod=None),
                                 w.workload_json if isinstance(w.workload_json, str)
                                 else json.dumps(w.workload_json), w.records, w.source)
                   for w in workloads]
        atomic_write_bytes(path, pickle.dumps({"version": STORE_INDEX_VERSION, "workloads": compact,
                                               "reports": reports, "donor_features": feats},
                                              protocol=pickle.HIGHEST_PROTOCOL))
    return workloads, reports, feats


@contextlib.contextmanager
def _no_gc():
    """The cyclic garbage collector paused: the index's traces are about a million small lists,
    and the collector, triggered over and over while they are created, made loading it 5-10x
    slower (no cycle is made here)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _index_cache_path(work_dir: Path, top_k: int, tkey: str) -> Path:
    """Where the index of ``work_dir``'s logs lives: keyed by their content, ``top_k`` and the
    target's key ("any": every target)."""
    wl, rec = db_file(work_dir, WORKLOAD_FILE), db_file(work_dir, RECORD_FILE)
    if wl is None or rec is None:
        raise StoreError(f"{work_dir}: not a MetaSchedule work_dir")
    key = f"v{INDEX_VERSION}-{sha256_of(wl, rec)[:20]}-{top_k}-{tkey.replace('/', '_')}"
    return cache_dir() / "index" / f"{work_dir.name}-{key}.json.gz"


def _write_index_cache(work_dir: str, top_k: int, tkey: str, path: str) -> None:
    """Index ``work_dir`` into its cache file ``path`` (a worker's job: nothing is returned)."""
    ws, rep = _index_work_dir(Path(work_dir), None, top_k, None if tkey == "any" else tkey)
    _save_index(Path(path), ws, rep)


def _save_index(path: Path, ws: list[DonorWorkload], rep: LoadReport) -> None:
    data = {"workloads": [{"network": w.network, "source": w.source, "kernel": _kernel_json(w.kernel),
                           "workload_json": (json.loads(w.workload_json) if isinstance(w.workload_json, str)
                                             else w.workload_json),
                           "records": [r.to_json() for r in w.records]} for w in ws],
            "report": asdict(rep)}
    atomic_write_bytes(path, gzip.compress(json.dumps(data).encode(), compresslevel=3))


def _cached_index(work_dir: Path, top_k: int, target, use_cache: bool, path: Path
                  ) -> tuple[list[DonorWorkload], LoadReport]:
    """``work_dir``'s index, read from its cache file ``path`` or made (and the file written)."""
    if use_cache and path.exists():
        try:
            with gzip.open(path, "rt") as f:
                data = json.load(f)
            ws = []
            for d in data["workloads"]:
                k = Kernel(**d["kernel"])
                recs = [DonorRecord(**r) for r in d["records"]]
                ws.append(DonorWorkload(d["network"], k, d["workload_json"], recs, d["source"]))
            # the index is keyed by content: the same logs elsewhere (a clone) are found here
            rep = LoadReport(**{**data["report"], "work_dir": str(work_dir)})
            return ws, rep
        except (OSError, ValueError, KeyError, TypeError):
            log.info("index cache %s unreadable; rebuilding", path)
    ws, rep = index_work_dir(work_dir, top_k=top_k, target=target)
    _save_index(path, ws, rep)
    return ws, rep


def _kernel_json(k: Kernel) -> dict:
    d = k.to_json()
    d.pop("shape", None)
    return d


def scheduled(workload: DonorWorkload, record: DonorRecord):
    """The record's program: its own workload scheduled by its trace (an IRModule)."""
    from tvm import s_tir

    sch = s_tir.Schedule(workload.module())
    s_tir.Trace.apply_json_to_schedule(record.trace_json, sch)
    return sch.mod


def materialize(workload: DonorWorkload, record: DonorRecord):
    """(donor IRModule, its s_tir.Trace) from the stored JSON."""
    from tvm import s_tir

    mod = workload.module()
    sch = s_tir.Schedule(mod)
    s_tir.Trace.apply_json_to_schedule(record.trace_json, sch)
    return mod, sch.trace


# --------------------------------------------------------------------------------------------
# Adding a user's logs


def add_work_dir(src: str | Path, name: str | None = None, dest_root: Path | None = None
                 ) -> tuple[Path, LoadReport]:
    """Copy a MetaSchedule work_dir into the user's donor store (gzipped), after validating it."""
    src = Path(src)
    if not src.is_dir():
        raise StoreError(f"{src}: not a directory")
    shipped = locations.shipped_donors()
    if shipped is not None and (shipped / (name or src.name)).exists():
        # the two folders' records would share ids, and the user's would pass for shipped ones
        raise StoreError(f"{name or src.name}: a shipped donor set has that name; give another (--name)")
    ws, rep = index_work_dir(src, network=name or src.name)
    if not ws:
        raise StoreError(f"{src}: no usable records ({dict(rep.skipped) or 'empty database'})")
    dest = (dest_root or user_donor_dir()) / (name or src.name)
    dest.mkdir(parents=True, exist_ok=True)
    # the workload and record files index each other: two adds (or an add and a reader) must
    # never see one file of one version beside the other of another
    with file_lock(dest):
        for fname in (WORKLOAD_FILE, RECORD_FILE):
            s = db_file(src, fname)
            with open(s, "rb") as f:
                data = f.read()
            if s.suffix != ".gz":
                data = gzip.compress(data)
            atomic_write_bytes(dest / (fname + ".gz"), data)
        for extra in (TRIALS_FILE, MANIFEST_FILE):
            if (src / extra).exists():
                atomic_write_bytes(dest / extra, (src / extra).read_bytes())
        if not (dest / MANIFEST_FILE).exists():
            atomic_write_json(dest / MANIFEST_FILE, {
                "model": name or src.name, "source": str(src.resolve()),
                "provenance": {"cpu": "unknown (added logs)", "added_on_cpu": host_cpu_model()}})
    return dest, rep


def listing(work_dirs: list[Path] | None = None) -> tuple[DonorStore, list[dict[str, Any]]]:
    """The store of ``work_dirs`` (default: :func:`default_work_dirs`) and, per work_dir, what
    `ttrank donors list` shows: its manifest's summary and what was indexed."""
    dirs = work_dirs if work_dirs is not None else default_work_dirs()
    if not dirs:
        raise StoreError("the donor store is empty: no work_dir under datasets/donors/ "
                         "and none added (ttrank donors add DIR)")
    store = DonorStore.load(dirs)
    rows = []
    for d, rep in zip(dirs, store.reports):
        s = network_summary(d)
        lat = s.get("model_latency_ms") or {}
        rows.append({**s, "network": rep.network, "folder": d.name, "kernels": rep.workloads,
                     "records": rep.kept,
                     "lines": rep.records, "skipped": rep.skipped,
                     "untuned_ms": lat.get("untuned"), "tuned_ms": lat.get("tuned"),
                     "onnxruntime_ms": lat.get("onnxruntime")})
    return store, rows


def network_summary(work_dir: Path) -> dict[str, Any]:
    """What `ttrank donors list` shows for one work_dir, from its manifest."""
    m = read_manifest(work_dir)
    prov = m.get("provenance", {})
    return {"network": work_dir.name, "trials": m.get("trials_done"),
            "trials_target": m.get("trials_target"), "complete": m.get("complete"),
            "search_seconds": m.get("search_seconds"), "estimated_ms": m.get("estimated_ms"),
            "model_latency_ms": m.get("model_latency_ms"),
            "cpu": f"{prov.get('cpu')} ({prov.get('mcpu')})" if prov.get("mcpu") else prov.get("cpu"),
            "threads": prov.get("threads"), "tvm": prov.get("tvm"), "layout": m.get("layout", "nchw")}
