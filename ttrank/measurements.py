"""The measurement table: one JSON line per (kernel, donor schedule) measured on a CPU.

``datasets/measurements/<network>.jsonl`` (``ttrank collect``) and recommend's own tables
(``--data-dir``) share this format; :func:`row` builds every line, and the ranker's training
data (:mod:`ttrank.collect`) reads them back. Beside each table, ``kernels/<network>.json``
describes its kernels (:func:`write_kernels`): a row's features need its kernel.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import TTRankError
from .kernels import Kernel
from .util import atomic_write_json, file_lock

UNTUNED = "untuned"  # the record id of a kernel's own, untuned, schedule


def row(network: str, kernel, status: str, latency_s: float | None, reason: str, provenance: dict,
        transferred=None, *, untuned_s: float | None = None, scores: tuple | None = None,
        pool: str | None = None, target_key: str | None = None, devices: list | None = None,
        build_s: float | None = None, foreign: dict | None = None) -> dict:
    """One line of the table: the untuned kernel when ``transferred`` is None, else a
    transferred donor schedule (a :class:`ttrank.transfer.Transferred`). ``scores``:
    (ranker score, cost-model score) when a ranking chose it; ``pool``: which sample the
    collector drew it from; ``target_key``: the target the run compiled for; ``devices``: on
    a fleet, the device that ran each timed pass (:class:`ttrank.fleet.FleetRunner`);
    ``build_s``: its build's seconds (compile and output check), where measuring time went;
    ``foreign``: the cores other work kept busy while it ran (:class:`ttrank.measure.CpuShare`)."""
    r = {"network": network, "kernel": kernel.name, "workload": kernel.workload_hash,
         "class": kernel.workload_class}
    if transferred is None:
        r.update({"record": UNTUNED, "status": status, "latency_s": latency_s,
                  "reason": reason[:300], "provenance": provenance})
    else:
        t = transferred
        r.update({"record": t.record.id, "donor_network": t.donor.network,
                  "donor_kernel": t.donor.kernel.name, "donor_rank": t.record.rank,
                  "record_hash": t.record.trace_hash, "status": status, "reason": reason[:300],
                  "latency_s": latency_s, "untuned_s": untuned_s, "method": t.method,
                  "adapt": t.adapt, "tile_changes": len(t.tile_changes)})
        if t.thread_split:  # the program measured is the donor's schedule with its rows split
            r["thread_split"] = t.thread_split
        if scores is not None:
            r["score"], r["cost_score"] = scores
        r["provenance"] = provenance
        if pool is not None:
            r["pool"] = pool
    if target_key is not None:
        r["target_key"] = target_key
    if devices:
        r["devices"] = list(devices)
    if build_s is not None:
        r["build_s"] = round(build_s, 3)
    if foreign is not None:
        r["foreign_load"] = foreign
    return r


# a row measured while other work kept this many cores busy (or other virtual machines took them)
# is not kept as a label, nor reused: on a 2-core znver5 whose rows were collected at a load of
# 3.5-4.2, one candidate measured 3.3 ms in one network's table and 0.49 ms in another's.
# $TTRANK_DISTURBED_CORES sets another limit (inf: keep every row, as the tests do)
DISTURBED_CORES = 0.5


def disturbed_limit() -> float:
    """The cores of other work from which a row counts as disturbed: $TTRANK_DISTURBED_CORES,
    else :data:`DISTURBED_CORES`."""
    raw = os.environ.get("TTRANK_DISTURBED_CORES")
    if not raw:
        return DISTURBED_CORES
    try:
        return float(raw)
    except ValueError:
        raise TTRankError(f"TTRANK_DISTURBED_CORES={raw!r} is not a number of cores") from None


def disturbed(r: dict, cores: float | None = None) -> bool:
    """Whether a row was measured while other work took ``cores`` (default
    :func:`disturbed_limit`) or more of the machine (rows from before the measurer sampled it
    are taken as undisturbed)."""
    f = r.get("foreign_load") or {}
    return (f.get("others") or 0.0) + (f.get("steal") or 0.0) >= (disturbed_limit() if cores is None else cores)


def key(r: dict) -> tuple[str, str]:
    """(workload, record); a record transferred another way than ttrank's gets its own key."""
    adapt = r.get("adapt") or "ttrank"
    return r["workload"], r["record"] if adapt == "ttrank" else f"{r['record']}@{adapt}"


def machine_of(prov: dict) -> tuple:
    """What a latency depends on besides the program: the CPU, the runtime's threads, and
    whether each run began with cold caches (recommend's protocol) or warm (MetaSchedule's)."""
    return prov.get("mcpu"), prov.get("cores"), prov.get("threads"), bool(prov.get("cache_flush"))


def is_current(r: dict, record) -> bool:
    """Whether a row measured the schedule that ``record`` (a DonorRecord, or None) holds now
    (rows from before hashes were kept are taken as current)."""
    h = r.get("record_hash")
    return h is None or record is None or h == record.trace_hash


def same_cpu(r: dict, prov: dict) -> bool:
    return machine_of(r.get("provenance") or {}) == machine_of(prov)


def compact_provenance(prov: dict) -> dict:
    """The provenance every row carries: the machine, TVM, the date and the load (over RPC,
    the devices' key, triple and names)."""
    return {k: prov[k] for k in ("cpu", "mcpu", "cores", "threads", "caches", "tvm", "date", "load_1m",
                                 "device_key", "device_triple", "devices") if k in prov}


def kernels_of(path: Path) -> dict[str, Kernel]:
    data = json.loads(path.read_text())
    out = {}
    for d in data:
        d = dict(d)
        d.pop("shape", None)
        out[d["workload_hash"]] = Kernel(**d)
    return out


def write_kernels(path: Path, kernels: list[Kernel]) -> None:
    """Add ``kernels`` to a table's kernel file. Kernels already there stay: the table's older
    rows may be of another import of the network (exact or fast math, an older TVM), and their
    features need them."""
    with file_lock(path):
        old = kernels_of(path) if path.exists() else {}
        new = {k.workload_hash: k for k in kernels}
        atomic_write_json(path, [k.to_json() for k in new.values()]
                          + [k.to_json() for h, k in old.items() if h not in new])
