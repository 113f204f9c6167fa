"""Rebuild the ranker from measurement tables: choose the objective by leave-one-network-out
evaluation, fit on everything, save with metadata."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from .collect import Dataset, build_dataset
from .donors import DonorStore
from .evaluate import baseline_scores, choose_top_k, evaluate, leave_one_network_out
from .ranker import DEFAULT_MODEL, OBJECTIVES, Ranker
from .util import cache_dir

log = logging.getLogger("ttrank")
DATASET_MEASUREMENTS = Path(__file__).resolve().parent.parent / "datasets" / "measurements"


def default_measurement_dirs() -> list[Path]:
    """The shipped cross-measurements, then the user's own recommend runs."""
    return [d for d in (DATASET_MEASUREMENTS, cache_dir() / "data" / "measurements") if d.exists()]


def data_hash(ds: Dataset) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ds.X).tobytes())
    h.update(np.ascontiguousarray(ds.y).tobytes())
    h.update(np.asarray(ds.groups, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def train(measurement_dirs: list[Path] | None = None, store: DonorStore | None = None,
          out: str | Path = DEFAULT_MODEL, objectives: tuple[str, ...] = OBJECTIVES,
          n_estimators: int = 300) -> dict:
    """Train and save the ranker; returns the evaluation report."""
    from .errors import TTRankError
    from .target import provenance

    store = store or DonorStore.load()
    dirs = measurement_dirs if measurement_dirs is not None else default_measurement_dirs()
    ds = build_dataset(dirs, store)
    if not ds.groups:
        raise TTRankError("no training data: no measurement table with at least two measured "
                          "candidates per kernel (collect some: ttrank collect NETWORK)")
    report: dict = {"rows": int(len(ds.y)), "groups": len(ds.groups), "networks": ds.networks,
                    "objectives": {}}
    best_obj, best_top1 = objectives[0], -1.0
    if len(ds.networks) >= 2:
        for obj in objectives:
            res = leave_one_network_out(ds, lambda: Ranker(objective=obj, n_estimators=n_estimators))
            report["objectives"][obj] = {"average": res["average"], "networks": res["networks"]}
            top1 = res["average"].get("top1", 0.0)
            if top1 > best_top1:
                best_obj, best_top1 = obj, top1
        for kind in ("random", "nearest_shape", "donor_gflops"):
            sc = baseline_scores(ds, kind)
            report.setdefault("baselines", {})[kind] = evaluate(ds, sc)
    report["objective"] = best_obj
    loo = report["objectives"].get(best_obj, {}).get("average") or {}
    # at most 5: measuring more per kernel would break recommend's 3-minute budget on 2 cores
    report["top_k"] = choose_top_k(loo, max_k=5)
    ranker = Ranker(objective=best_obj, n_estimators=n_estimators).fit(ds.X, ds.y, ds.groups)
    prov = provenance()
    ranker.save(out, training_data_hash=data_hash(ds), training_rows=int(len(ds.y)),
                training_groups=len(ds.groups), training_networks=ds.networks,
                top_k=report["top_k"],
                cpu=prov["cpu"], mcpu=prov["mcpu"], tvm=prov["tvm"], date=prov["date"],
                evaluation={k: v for k, v in report.items() if k != "objectives"} |
                {"leave_one_network_out": report["objectives"].get(best_obj, {}).get("average")})
    report["model"] = str(out)
    return report


def ranker_without(network: str, base: Ranker, store: DonorStore | None = None,
                   measurement_dirs: list[Path] | None = None) -> Ranker:
    """``base`` refitted without ``network``: none of its kernels, nor rows whose donor is it.

    For honest leave-one-out runs; ``base`` itself is returned if it never saw ``network``.
    """
    if network not in base.metadata.get("training_networks", []):
        return base
    store = store or DonorStore.load()
    dirs = measurement_dirs if measurement_dirs is not None else default_measurement_dirs()
    ds = build_dataset(dirs, store)
    keep, groups, start = [], [], 0
    for g in ds.groups:
        rows = [i for i in range(start, start + g) if ds.meta[i]["network"] != network
                and ds.meta[i].get("donor_network") != network]
        if rows:
            keep += rows
            groups.append(len(rows))
        start += g
    r = Ranker(**base.get_params()).fit(ds.X[keep], ds.y[keep], groups)
    r.metadata = {**base.metadata, "training_networks": [n for n in ds.networks if n != network],
                  "left_out": network}
    return r
