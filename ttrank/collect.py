"""The cross-measurement dataset: donor schedules of other networks, measured on each kernel.

One append-only JSON-lines table per target network, ``<dir>/<network>.jsonl``, one row per
(target kernel, donor record) plus one ``untuned`` row per kernel, and the target's kernel
descriptions in ``<dir>/kernels/<network>.json`` so features can be recomputed without TVM
extraction. Rows already present are never measured again, so a run resumes anywhere.

Sampling: per kernel, every compatible donor kernel of the other networks contributes its
best ``records_per_donor`` records; when that exceeds ``max_per_kernel``, the best record of
each donor kernel is kept first (ordered by a seeded shuffle) and the rest filled at random.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import measurements, zoo
from .donors import DonorRecord, DonorStore, DonorWorkload
from .errors import TTRankError
from .features import FEATURE_NAMES, vector
from .kernels import Kernel, model_kernels
from .measurements import (UNTUNED, compact_provenance, kernels_of, machine_of, same_cpu,
                           write_kernels)
from .measurements import key as measurement_key
from .ranker import Ranker, relevance
from .ranking import rank_kernel
from .target import CPU_KEYS, cpu_description, provenance
from .transfer import Transferred, transfer
from .util import STOP_REQUESTED, append_jsonl, read_jsonl, stop_at_safe_points
from .workdir import NATIVE_PREFIX

log = logging.getLogger("ttrank")


# candidates per kernel per pass of collect: every kernel gets a group of this many (the ranker
# learns from the order within a group) before any kernel gets more
PASS = 4


@dataclass
class CollectStats:
    network: str
    kernels: int = 0
    measured: int = 0
    skipped_existing: int = 0
    valid: int = 0
    rejected: int = 0
    wrong: int = 0
    stopped_by_budget: bool = False


def paper_pairs(kernel: Kernel, store: DonorStore, donor_network: str | None
                ) -> list[tuple[DonorWorkload, DonorRecord]]:
    """The paper's candidates: the best record of every kernel of the one paired donor network
    whose fused-op class is exactly the target's (any shape)."""
    if not donor_network:
        return []
    return [(w, r) for w, r in store.compatible(kernel)
            if w.network == donor_network and r.rank == 0
            and w.kernel.workload_class == kernel.workload_class]


def load_rows(path: Path) -> list[dict]:
    return list(read_jsonl(path))


def sample_pairs(kernel: Kernel, pairs: list[tuple[DonorWorkload, DonorRecord]],
                 max_per_kernel: int, records_per_donor: int, seed: int = 0
                 ) -> list[tuple[DonorWorkload, DonorRecord]]:
    pairs = [(w, r) for w, r in pairs if r.rank < records_per_donor]
    if len(pairs) <= max_per_kernel:
        return pairs
    rng = random.Random(f"{seed}-{kernel.workload_hash}")
    best = [(w, r) for w, r in pairs if r.rank == 0]
    rest = [(w, r) for w, r in pairs if r.rank > 0]
    rng.shuffle(best)
    rng.shuffle(rest)
    return (best + rest)[:max_per_kernel]


def transfer_pairs(kernel: Kernel, pairs: list[tuple[DonorWorkload, DonorRecord]], target,
                   adapt: str = "ttrank") -> list:
    return [transfer(r, kernel, w, target, adapt=adapt) for w, r in pairs]


def candidate_rows(kernel: Kernel, cands: list, results: list, network: str,
                   untuned_s: float | None, prov: dict) -> list[dict]:
    """One row per transferred candidate; ``results`` are the measurements of those that
    applied (``c.ok``), in order."""
    res_of = {id(c): m for c, m in zip([c for c in cands if c.ok], results)}
    rows = []
    for c in cands:
        m = res_of.get(id(c))
        if m is None:
            status, lat, reason = "rejected", None, c.reason
        elif m.ok:
            status, lat, reason = "ok", m.latency_s, ""
        else:
            status, lat, reason = m.status, None, m.error
        # a fleet: which devices ran it
        rows.append(measurements.row(network, kernel, status, lat, reason, prov, c, untuned_s=untuned_s,
                                     pool="paper" if c.adapt == "tvm" else "ranked",
                                     devices=m.devices if m is not None else None,
                                     foreign=m.foreign_json if m is not None else None))
    return rows


def import_tables(src: str | Path, dst: str | Path) -> dict[str, int]:
    """Add the rows of measurement tables measured elsewhere (``src``: an ``adapt`` cache's
    ``data/measurements``, another checkout's ``datasets/measurements``) to the tables in ``dst``.

    A row already in ``dst`` (same kernel, schedule and machine) is not added again, so an import
    can be repeated; kernel descriptions are merged. Returns the rows added per network.
    """
    src, dst = Path(src), Path(dst)
    tables = sorted(src.glob("*.jsonl"))
    if not tables:
        raise TTRankError(f"{src}: no measurement tables (*.jsonl) to import")

    def ident(r: dict) -> tuple:
        return measurement_key(r), machine_of(r.get("provenance") or {})

    added = {}
    for table in tables:
        kfile = src / "kernels" / f"{table.stem}.json"
        if not kfile.exists():  # rows without their kernels' descriptions have no features
            log.warning("%s: no kernels/%s.json beside it; not imported", table, table.stem)
            continue
        seen = {ident(r) for r in read_jsonl(dst / table.name)}
        new = []
        for r in read_jsonl(table):
            if "workload" in r and "record" in r and ident(r) not in seen:
                seen.add(ident(r))
                new.append(r)
        if new:
            write_kernels(dst / "kernels" / kfile.name, list(kernels_of(kfile).values()))
            append_jsonl(dst / table.name, new)
        added[table.stem] = len(new)
    return added


def collect(network: str, model, store: DonorStore, out_dir: str | Path, target, measurer,
            max_per_kernel: int = 40, records_per_donor: int = 2, budget_s: float | None = None,
            seed: int = 0, batch: int = 16, exclude_self: bool = True,
            paper_donor: str | None = None, ranker: Ranker | None = None,
            only: set[str] | None = None,
            on_progress: Callable[[CollectStats, int], None] | None = None) -> CollectStats:
    """Measure sampled donor schedules of the other networks on every tunable kernel.

    With ``paper_donor``, also the paper's baseline: that network's exact-class schedules with
    their tile sizes left to TVM (``adapt="tvm"``), in rows of their own (``pool: "paper"``).
    With ``ranker``, a kernel's candidates are that ranker's top ``max_per_kernel`` for this
    CPU instead of a sample (what `adapt` measures to seed a kernel's native search).
    ``only``: the kernels to measure, by workload hash (None: every tunable one).
    """
    out_dir = Path(out_dir)
    table = out_dir / f"{network}.jsonl"
    kernels = [k for k in model_kernels(model, target) if k.tunable]
    write_kernels(out_dir / "kernels" / f"{network}.json", kernels)
    if only is not None:
        kernels = [k for k in kernels if k.workload_hash in only]
    spec = getattr(measurer, "spec", None)
    # the measuring machine's CPU: over RPC, what the devices report, never the host's
    prov = compact_provenance(spec.provenance(target) if spec is not None else provenance(target))
    if spec is not None:  # how each latency was taken
        prov["runner"] = spec.protocol()
    # rows measured on another CPU (or thread count) do not count as done: this one gets its own;
    # nor do rows measured while other work kept the machine busy
    stored = (_as_stored(r, store) for r in load_rows(table))
    mine = [r for r in stored if r is not None and same_cpu(r, prov) and not measurements.disturbed(r)]
    done = {measurement_key(r) for r in mine}
    untuned = {r["workload"]: r["latency_s"] for r in mine if r["record"] == UNTUNED}
    stats = CollectStats(network, len(kernels))
    t0 = time.time()
    exclude = {network} if exclude_self else set()
    cpu = cpu_description(prov)  # what the ranker's CPU features read
    baseline = measurer.baseline()
    jobs: list[list[tuple[int, Kernel, list]]] = []  # batches handed out, not yet measured

    def over_budget() -> bool:
        if budget_s is not None and time.time() - t0 > budget_s:
            stats.stopped_by_budget = True
        return stats.stopped_by_budget or STOP_REQUESTED.is_set()  # or a Ctrl-C (util)

    def batches():
        """Each kernel's untuned baseline, then passes over the kernels: a pass gives every kernel
        its next :data:`PASS` candidates, so a budget covers every kernel (each a group the ranker
        learns from) before it deepens any; batches of about ``batch`` candidates, transferred
        here, built by the measurer ahead of the batch that runs."""
        todos = []
        for i, k in enumerate(kernels):
            if over_budget():
                break
            if k.workload_hash not in untuned:
                m = baseline.measure([k.mod])[0]
                untuned[k.workload_hash] = m.latency_s
                append_jsonl(table, measurements.row(network, k, m.status, m.latency_s, m.error, prov,
                                                     foreign=m.foreign_json))
            if ranker is not None:
                pairs = [(c.donor, c.record) for c in rank_kernel(k, store, ranker, exclude, cpu)[:max_per_kernel]]
            else:
                pairs = sample_pairs(k, store.compatible(k, exclude), max_per_kernel, records_per_donor, seed)
            todo = [(w, r, "ttrank") for w, r in pairs if (k.workload_hash, r.id) not in done]
            paper = [] if paper_donor == network else paper_pairs(k, store, paper_donor)
            todo += [(w, r, "tvm") for w, r in paper if (k.workload_hash, f"{r.id}@tvm") not in done]
            stats.skipped_existing += len(pairs) + len(paper) - len(todo)
            todos.append((i, k, todo))
        job: list[tuple[int, Kernel, list]] = []
        for s in range(0, max((len(t) for _, _, t in todos), default=0), PASS):
            for i, k, todo in todos:
                if not todo[s:s + PASS]:
                    continue
                if over_budget():
                    return
                cands = []
                for adapt in ("ttrank", "tvm"):
                    part = [(w, r) for w, r, a in todo[s:s + PASS] if a == adapt]
                    cands += transfer_pairs(k, part, target, adapt) if part else []
                job.append((i, k, cands))
                if sum(len(c) for _, _, c in job) >= batch:
                    yield start(job)
                    job = []
        if job and not over_budget():
            yield start(job)

    def start(job: list[tuple[int, Kernel, list]]) -> tuple[list, list]:
        jobs.append(job)
        valid = [(k, c) for _, k, cands in job for c in cands if c.ok]
        return [c.mod for _, c in valid], [(k.mod, k.workload_hash) for k, _ in valid]

    for results in measurer.measure_stream(batches()):
        job = jobs.pop(0)
        for i, k, cands in job:
            n = sum(1 for c in cands if c.ok)
            rows = candidate_rows(k, cands, results[:n], network, untuned[k.workload_hash], prov)
            results = results[n:]
            append_jsonl(table, rows)
            for r in rows:
                done.add(measurement_key(r))
                stats.measured += 1
                stats.valid += r["status"] == "ok"
                stats.wrong += r["status"] == "wrong_result"
                stats.rejected += r["status"] not in ("ok", "wrong_result")
            if on_progress:
                on_progress(stats, i)
    return stats


def _as_stored(r: dict, store: DonorStore) -> dict | None:
    """A measurement row under the id its schedule has in ``store`` now
    (:meth:`DonorStore.measured`), or None where the store keeps that schedule no longer; an
    untuned row as it is."""
    if r.get("record") == UNTUNED:
        return r
    hit = store.measured(r)
    return None if hit is None else {**r, "record": hit[1].id}


def _fastest_per_record(network: str, hashes: set[str], out_dir: str | Path, target,
                        record_of: Callable[[dict], str | None]) -> dict[str, dict[str, float]]:
    """Rows of ``network``'s table in ``out_dir`` measured on this machine, of the kernels
    ``hashes``, each filed under ``record_of(row)`` (None: not counted): workload hash ->
    {record: its fastest latency_s}."""
    prov = compact_provenance(provenance(target))
    out: dict[str, dict[str, float]] = {}
    for r in load_rows(Path(out_dir) / f"{network}.jsonl"):
        if r.get("status") == "ok" and r.get("workload") in hashes and same_cpu(r, prov):
            rid = record_of(r)
            if rid is not None:
                best = out.setdefault(r["workload"], {})
                best[rid] = min(best.get(rid, math.inf), float(r["latency_s"]))
    return out


def fastest_transferred(network: str, hashes: set[str], out_dir: str | Path, target) -> dict[str, float]:
    """Each kernel's (workload hash) fastest donor schedule measured on this CPU, in seconds:
    rows of ``network``'s table in ``out_dir``, other than its untuned code and this CPU's own
    native records (what the native search is measured against)."""
    rows = _fastest_per_record(network, hashes, out_dir, target, lambda r: None if (
        r["record"] == UNTUNED or str(r["record"]).startswith(NATIVE_PREFIX)) else r["record"])
    return {h: min(best.values()) for h, best in rows.items()}


def best_measured(network: str, kernels: list[Kernel], store: DonorStore, out_dir: str | Path, target,
                  n: int, keep: Callable[[Transferred], bool] = lambda c: c.ok
                  ) -> dict[str, list[tuple[Transferred, float]]]:
    """Each kernel's ``n`` fastest donor schedules measured on this CPU (rows of ``network``'s
    table in ``out_dir`` with this machine's provenance and a current record), transferred
    again (those ``keep`` keeps): workload hash -> [(candidate, latency_s)], fastest first."""
    rec_of = {r.id: r for r in store.records()}
    wanted = {k.workload_hash: k for k in kernels}

    def stored_id(r: dict) -> str | None:  # the paper baseline's rows are TVM's transfers, not ttrank's
        if r["record"] == UNTUNED or str(r.get("pool", "")).startswith("paper"):
            return None
        return (_as_stored(r, store) or {}).get("record")

    rows = _fastest_per_record(network, set(wanted), out_dir, target, stored_id)
    wl_of = {r.id: w for w in store.workloads for r in w.records}
    out: dict[str, list[tuple[Transferred, float]]] = {}
    for h, best in rows.items():
        picks = []
        for rid, lat in sorted(best.items(), key=lambda x: x[1]):
            c = transfer(rec_of[rid], wanted[h], wl_of[rid], target)
            if keep(c):
                picks.append((c, lat))
            if len(picks) >= n:
                break
        out[h] = picks
    return out


def collect_networks(networks: list[str], store: DonorStore, out_dir: str | Path, target, measurer,
                     budget_s: float | None = None, paper_donor_of: dict[str, str] | None = None,
                     layout: str = "nchw", **kw) -> Iterator[tuple[str, CollectStats]]:
    """:func:`collect` on each zoo network in turn, within one budget for all (None: no limit);
    yields (network, its stats) and stops early, before a network, once the budget is spent.
    ``paper_donor_of``: network -> its paper baseline's donor network (:func:`collect`).
    ``layout``: the networks' conv layout (packed convs take the packed donors' schedules)."""
    deadline = time.time() + budget_s if budget_s is not None else None
    # a Ctrl-C stops after the batch being measured (its rows are kept), then raises here
    with stop_at_safe_points():
        for net in networks:
            left = deadline - time.time() if deadline is not None else None
            if left is not None and left <= 0:
                return
            model = zoo.load(f"zoo:{net}", layout=layout, target=target)
            stats = collect(net, model, store, out_dir, target, measurer, budget_s=left,
                            paper_donor=(paper_donor_of or {}).get(net), **kw)
            if STOP_REQUESTED.is_set():
                raise KeyboardInterrupt
            yield net, stats


# --------------------------------------------------------------------------------------------
# training data


@dataclass
class Dataset:
    X: "object"  # np.ndarray [n, features]
    y: "object"  # relevance per row
    groups: list[int]
    meta: list[dict]  # per row: network, workload, record, latency_s, status, ...

    @property
    def networks(self) -> list[str]:
        return sorted({m["network"] for m in self.meta})


def build_dataset(dirs: list[Path], store: DonorStore, min_group: int = 2) -> Dataset:
    """Rows of every measurement table in ``dirs``, grouped by target kernel, with features.

    A row whose schedule is no longer among the store's records is dropped (its features need
    it); one whose record changed rank follows it (:meth:`ttrank.donors.DonorStore.measured`).
    """
    cpus: dict[str, dict] = {}

    def cpu_of(prov: dict) -> dict:
        """The row's CPU facts (for the ``c_`` features), worked out once per machine."""
        key = json.dumps({k: prov.get(k) for k in CPU_KEYS}, sort_keys=True)
        if key not in cpus:
            cpus[key] = cpu_description(prov)
        return cpus[key]

    X, y, groups, meta = [], [], [], []
    for d in dirs:
        for table in sorted(Path(d).glob("*.jsonl")):
            kfile = Path(d) / "kernels" / f"{table.stem}.json"
            if not kfile.exists():
                continue
            kernels = kernels_of(kfile)
            # one group per kernel and CPU: latencies from different CPUs never share a ranking;
            # each row with the workload and record it measured
            by_kernel: dict[tuple[str, tuple], dict[str, tuple[dict, tuple]]] = {}
            for row in read_jsonl(table):
                if row.get("record") == UNTUNED or row["workload"] not in kernels \
                        or (row.get("adapt") or "ttrank") != "ttrank" or measurements.disturbed(row):
                    continue
                hit = store.measured(row)
                if hit is None:
                    continue
                cpu = machine_of(row.get("provenance") or {})
                by_kernel.setdefault((row["workload"], cpu), {})[hit[1].id] = (row, hit)  # last wins
            for (wh, _cpu), rows in by_kernel.items():
                usable = list(rows.values())
                if len(usable) < min_group:
                    continue
                k = kernels[wh]
                lat = [r["latency_s"] if r["status"] == "ok" else None for r, _ in usable]
                if not any(lat):
                    continue
                rel = relevance(lat)
                for (r, (w, rec)), rv in zip(usable, rel):
                    X.append(vector(store.pair_features(k, w, rec, cpu=cpu_of(r.get("provenance") or {}))))
                    y.append(rv)
                    meta.append({"network": r["network"], "workload": wh, "record": rec.id,
                                 "latency_s": r["latency_s"], "status": r["status"],
                                 "weight": k.weight,
                                 "donor_network": r.get("donor_network"),
                                 "untuned_s": r.get("untuned_s"),
                                 "mcpu": (r.get("provenance") or {}).get("mcpu"),
                                 "cpu": (r.get("provenance") or {}).get("cpu")})
                groups.append(len(usable))

    return Dataset(np.asarray(X, dtype=np.float32).reshape(-1, len(FEATURE_NAMES)),
                   np.asarray(y, dtype=np.float32), groups, meta)
