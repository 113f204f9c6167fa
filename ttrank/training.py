"""Rebuild the ranker from measurement tables: choose the objective by leave-one-network-out
evaluation, fit on everything, save with metadata."""

from __future__ import annotations

import hashlib
import json
import logging
from functools import partial
from pathlib import Path

import numpy as np

from . import locations
from .collect import Dataset, build_dataset, collect_networks
from .donors import DonorStore, add_work_dir
from .errors import RankerError, TTRankError
from .evaluate import (KEYS, baseline_scores, blended, by_cpu, choose_top_k, cpu_of_rows, evaluate, group_spans,
                       leave_one_network_out, network_average, own_scores, policy_curve, rows_by_network, subset)
from .features import FEATURE_GROUPS, FEATURE_VERSION
from .measure import Measurer
from .programs import CostModel, cost_model_path, fit_cost_model, loo_cost_scores, rerank_spans
from .ranker import OBJECTIVES, OWN_MIN_ROWS, OWN_WEIGHT, Ranker, families_of, own_feature_groups
from .ranking import AdaptiveK, FixedK
from .target import make_target, provenance, vector_class
from .util import cache_dir, sha256_of
from .workdir import RECORD_FILE, db_file

log = logging.getLogger("ttrank")
def training_dirs(ranker: Ranker) -> list[Path] | None:
    """The measurement dirs a ranker was trained from (those that still exist), if recorded."""
    dirs = ranker.metadata.get("measurement_dirs")
    if dirs is None:
        return None
    return [p for p in (locations.resolve(d) for d in dirs) if p.exists()]


def default_measurement_dirs() -> list[Path]:
    """The shipped cross-measurements, then the user's own recommend runs."""
    return [d for d in (locations.shipped_measurements(), cache_dir() / "data" / "measurements")
            if d is not None and d.exists()]


def data_hash(ds: Dataset) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ds.X).tobytes())
    h.update(np.ascontiguousarray(ds.y).tobytes())
    h.update(np.asarray(ds.groups, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def data_cpus_of(ds: Dataset) -> dict[str, int]:
    """Rows per CPU (mcpu) the labels were measured on, most first."""
    from collections import Counter

    return dict(Counter(m.get("mcpu") or "unknown" for m in ds.meta).most_common())


def data_vector_classes(ds: Dataset) -> set[tuple[float, float]]:
    """The vector classes (:func:`ttrank.target.vector_class`) of the CPUs that measured the rows."""
    return {c for c in (vector_class(m) for m in data_cpus_of(ds)) if c is not None}


def candidate_configs(objectives: tuple[str, ...] = OBJECTIVES) -> list[dict]:
    """Ranker settings the evaluation chooses among: each objective, with every feature group,
    without the adapted-tile features and without the CPU's (each kept only where
    leave-one-out says it helps: on one CPU's data the CPU features are nearly constant)."""
    sets = [FEATURE_GROUPS, *(tuple(g for g in FEATURE_GROUPS if g != drop) for drop in ("a", "c"))]
    return [{"objective": o, "feature_groups": g} for o in objectives for g in sets]


def config_label(cfg: dict) -> str:
    return f"{cfg['objective']} [{''.join(cfg['feature_groups'])}]"


def select_config(ds: Dataset, configs: list[dict], n_estimators: int = 300,
                  seeds: tuple[int, ...] = (0, 1, 2)) -> tuple[dict, dict[str, dict]]:
    """Leave-one-network-out for every config, averaged over ``seeds`` (one seed's split of
    columns and rows moves small-data scores by a few points); the best by mean of top-1 and
    top-3, the two targets. On rows of several CPUs the goal is the mean over the CPUs of each
    CPU's own average (:func:`ttrank.evaluate.by_cpu`): the targets are per CPU, and a CPU with
    many networks' rows would otherwise outvote one with few. Returns (best config, results
    keyed by :func:`config_label`)."""
    results: dict[str, dict] = {}
    for cfg in configs:
        runs = [leave_one_network_out(ds, lambda s=s: Ranker(n_estimators=n_estimators, seed=s, **cfg))
                for s in seeds]
        nets = sorted(set().union(*(r["networks"] for r in runs)))
        keys = runs[0]["average"].keys()
        cpus = [by_cpu(ds, r["scores"], r["held"]) for r in runs]
        results[config_label(cfg)] = {
            "params": {**cfg, "feature_groups": list(cfg["feature_groups"])},
            "average": {k: float(np.mean([r["average"][k] for r in runs])) for k in keys},
            "spread": {k: float(np.std([r["average"][k] for r in runs])) for k in KEYS if k in keys},
            "networks": {n: {k: float(np.mean([r["networks"][n][k] for r in runs]))
                             for k in runs[0]["networks"][n]} for n in nets if runs[0]["networks"].get(n)},
            "cpus": {c: {k: float(np.mean([per[c]["average"].get(k, 0.0) for per in cpus])) for k in KEYS}
                     for c in cpus[0]},
            "scores": runs[0]["scores"]}

    def both(a: dict) -> float:
        return (a.get("top1", 0.0) + a.get("top3", 0.0)) / 2

    def goal(label):
        per_cpu = results[label]["cpus"]
        if len(per_cpu) > 1:
            return float(np.mean([both(a) for a in per_cpu.values()]))
        return both(results[label]["average"])

    best = max(results, key=goal) if results else config_label(configs[0])
    return next(c for c in configs if config_label(c) == best), results


STAGE2_WEIGHTS = (0.3, 0.5, 0.7)
# each shortlisted candidate is transferred before measuring (0.1-0.3 s): past about 12 per
# kernel the second stage would cost recommend more time than it saves
STAGE2_SHORTLISTS = (5, 8, 12)


def choose_stage2(ds: Dataset, ranker_scores: np.ndarray, cost_scores: np.ndarray,
                  weights: tuple[float, ...] = STAGE2_WEIGHTS,
                  shortlists: tuple[int, ...] = STAGE2_SHORTLISTS) -> dict:
    """Leave-one-network-out: does reordering the ranker's shortlist with the program cost model
    help, and with which blend weight and shortlist length? Enabled only if it beats the ranker
    alone on the mean of top-1 and top-3 by at least half a point."""
    spans = group_spans(ds)
    average = partial(network_average, ds)

    def goal(a: dict) -> float:
        return (a.get("top1", 0.0) + a.get("top3", 0.0)) / 2

    table = {"ranker alone": {"weight": 1.0, "shortlist": 0, "average": average(ranker_scores)}}
    for n in shortlists:
        for w in weights:
            table[f"w{w} n{n}"] = {"weight": w, "shortlist": n,
                                   "average": average(rerank_spans(spans, ranker_scores, cost_scores, w, n))}
    top = max(goal(v["average"]) for v in table.values())
    # the shortest shortlist within half a point of the best: it costs recommend the least time
    best = min((k for k, v in table.items() if goal(v["average"]) >= top - 0.005),
               key=lambda k: (table[k]["shortlist"] if k != "ranker alone" else -1, -goal(table[k]["average"])))
    gain = goal(table[best]["average"]) - goal(table["ranker alone"]["average"])
    out = {**table[best], "enabled": best != "ranker alone" and gain >= 0.005, "gain": gain, "table": table}
    if not out["enabled"]:
        out.update(table["ranker alone"], enabled=False)
    return out


def train(measurement_dirs: list[Path] | None = None, store: DonorStore | None = None,
          out: str | Path | None = None, objectives: tuple[str, ...] = OBJECTIVES,
          n_estimators: int = 300, ds: Dataset | None = None, programs: bool = True,
          target=None, like: Ranker | None = None, evaluate_like: bool = False) -> dict:
    """Train and save the ranker; returns the evaluation report. ``ds``: the dataset, if the
    caller already built it from the same dirs and store. ``programs``: also evaluate the second
    stage (:mod:`ttrank.programs`), which reorders the donors' shortlist only if that helps, and
    save its cost model beside the ranker (it orders design-space draws either way).
    ``out``: the ranker file (default: the shipped one, :func:`ttrank.locations.shipped_ranker`).
    ``like``: refit with that ranker's settings (config, k, second stage and its cost model)
    instead of choosing them again by leave-one-out: a minute instead of a quarter of an hour,
    for a bounded budget such as ``adapt``'s. With ``evaluate_like``, only the configuration is
    copied: its leave-one-network-out on this data chooses the second stage, k and AdaptiveK's
    gap again (a second stage chosen on other rows can cost more than it gains)."""
    out = Path(out) if out is not None else locations.shipped_ranker()
    dirs = measurement_dirs if measurement_dirs is not None else default_measurement_dirs()
    if ds is None:
        store = store or DonorStore.load()
        ds = build_dataset(dirs, store)
    if not ds.groups:
        raise TTRankError("no training data: no measurement table with at least two measured "
                          "candidates per kernel (collect some: ttrank collect NETWORK)")
    report: dict = {"rows": int(len(ds.y)), "groups": len(ds.groups), "networks": ds.networks,
                    "configs": {}}
    configs = candidate_configs(objectives)
    if like is not None and not evaluate_like:
        return _refit_like(like, ds, dirs, out, report)
    if like is not None:
        params = like_params(like, ds)
        n_estimators = params.pop("n_estimators")
        configs = [params]
        report["refit_like"] = _copied(like)
    best = configs[0]
    if len(ds.networks) >= 2:
        best, results = select_config(ds, configs, n_estimators)
        report["configs"] = {k: {kk: v for kk, v in r.items() if kk != "scores"} for k, r in results.items()}
        for kind in ("random", "nearest_shape", "donor_gflops"):
            sc = baseline_scores(ds, kind)
            report.setdefault("baselines", {})[kind] = evaluate(ds, sc)
    report["config"] = config_label(best)
    report["objective"] = best["objective"]
    loo = report["configs"].get(report["config"], {}).get("average") or {}
    # chosen again on this data, like k and the policy (a refit without evaluation copies them)
    own = {**own_spec(like), "family_for": []}
    scores = None
    if len(ds.networks) >= 2:
        # what recommend ranks with: the pooled ranker, with each CPU's own and family's rankers
        # blended in where it has them
        scores, report["own"] = evaluate_own(ds, results[report["config"]]["scores"], best, n_estimators,
                                             own["min_rows"], own["weight"])
        own["family_for"] = report["own"]["family_for"]
        loo = network_average(ds, scores)
    report["leave_one_network_out"] = loo or None
    stage2 = None
    if programs and len(ds.networks) >= 2:
        target = target if target is not None else make_target()
        store = store or DonorStore.load()  # loading it takes seconds: only when needed
        work_dirs = [Path(r.work_dir) for r in store.reports]
        cost = loo_cost_scores(ds, store, target, work_dirs)
        stage2 = choose_stage2(ds, scores, cost)
        report["stage2"] = {k: v for k, v in stage2.items() if k != "table"}
        report["stage2_table"] = {k: v["average"] for k, v in stage2["table"].items()}
        if stage2["enabled"]:
            loo = stage2["average"]
        # kept even where reordering the donors' shortlist does not help: the cost model alone
        # orders a small design space's draws, which have no ranker score
        cm = fit_cost_model(work_dirs, target)
        cm_path = cost_model_path(out)
        cm.save(cm_path, **cm.metadata)
        report["stage2"]["cost_model"] = cm_path.name
    # at most 5: measuring more per kernel would break recommend's 3-minute budget on 2 cores
    report["top_k"] = choose_top_k(loo, max_k=5)
    if len(ds.networks) >= 2:
        report["policy"] = calibrate_policy(ds, scores, report["top_k"])
    ranker = _fit(Ranker(n_estimators=n_estimators, **best), ds, own)
    _save(ranker, out, ds, dirs, report)
    return report


def own_spec(ranker: Ranker | None) -> dict:
    """The own and family rankers' rule (``min_rows``, ``weight``, ``family_for``) of
    ``ranker``, else the defaults (no CPU blends its family in)."""
    spec = (ranker.metadata.get("own") if ranker is not None else None) or {}
    return {"min_rows": int(spec.get("min_rows", OWN_MIN_ROWS)), "weight": float(spec.get("weight", OWN_WEIGHT)),
            "family_for": list(spec.get("family_for") or [])}


def evaluate_own(ds: Dataset, pooled: np.ndarray, config: dict, n_estimators: int, min_rows: int,
                 weight: float) -> tuple[np.ndarray, dict]:
    """The pooled configuration's leave-one-network-out ``pooled`` scores with each CPU's own
    ranker blended in, and its family's where that helps it (:func:`ttrank.evaluate.own_scores`):
    a CPU blends its family's ranker in when that raises its mean of top-1 and top-3, the goal
    :func:`select_config` chooses by. Returns the scores and, per CPU, the evaluations."""
    groups = own_feature_groups(config["feature_groups"])
    own, family = own_scores(ds, lambda: Ranker(n_estimators=n_estimators, **{**config, "feature_groups": groups}),
                             lambda: Ranker(n_estimators=n_estimators, **config), min_rows)
    held = rows_by_network(ds)
    cpus = cpu_of_rows(ds)
    plain, with_family = blended(pooled, weight, own), blended(pooled, weight, own, family)
    before, without, withf = (by_cpu(ds, sc, held) for sc in (pooled, plain, with_family))

    def goal(a: dict) -> float:
        return (a["average"].get("top1", 0.0) + a["average"].get("top3", 0.0)) / 2

    family_for = sorted(c for c in without if not np.isnan(family[cpus == c]).all()
                        and goal(withf[c]) > goal(without[c]))
    scores = np.where(np.isin(cpus, family_for), with_family, plain)
    after = by_cpu(ds, scores, held)
    own_cpus = sorted(set(cpus[~np.isnan(own)].tolist()))
    per_cpu = {c: {"rows": after[c]["rows"], "own": c in own_cpus, "family": c in family_for,
                   **{f"{k}_pooled": before[c]["average"].get(k) for k in ("top1", "top3")},
                   **{f"{k}_no_family": without[c]["average"].get(k) for k in ("top1", "top3")},
                   **{f"{k}_family": withf[c]["average"].get(k) for k in ("top1", "top3")},
                   **{k: after[c]["average"].get(k) for k in ("top1", "top3")}} for c in after}
    return scores, {"min_rows": min_rows, "weight": weight, "cpus": own_cpus,
                    "families": sorted(set(families_of(cpus)[~np.isnan(family)].tolist())),
                    "family_for": family_for, "per_cpu": per_cpu}


def _fit(ranker: Ranker, ds: Dataset, own: dict | None) -> Ranker:
    """``ranker`` fitted on ``ds``, with the own rankers ``own`` asks for (:func:`own_spec`;
    None: none)."""
    ranker.fit(ds.X, ds.y, ds.groups)
    return ranker if own is None else ranker.fit_own(ds.X, ds.y, ds.groups, cpu_of_rows(ds), **own)


# AdaptiveK's score gaps to calibrate over: the scores' scale depends on the objective (a
# regression's estimate relative throughput; rank:ndcg's top two differ by ~0.3 at the median)
POLICY_GAPS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


def calibrate_policy(ds: Dataset, scores: np.ndarray, top_k: int, full_share: float = 0.01,
                     tolerance: float = 0.002) -> dict:
    """``AdaptiveK``'s score gap for a ranker, from its leave-one-network-out ``scores``: the
    smallest gap whose quality is within ``tolerance`` of measuring ``top_k`` everywhere (the
    gap that keeps the quality with the fewest candidates). A gap fixed for one objective's
    scores measures too few candidates for another's: on the same data, gap 0.4 keeps 0.965 of
    the quality with a regression ranker, and 0.923 with a rank:ndcg one."""
    policies: dict = {"fixed": FixedK(top_k)}
    policies.update({g: AdaptiveK(top_k, gap=g, full_share=full_share) for g in POLICY_GAPS})
    curve = policy_curve(ds, scores, policies)
    goal = curve["fixed"]["quality"] - tolerance
    gap = next((g for g in POLICY_GAPS if curve[g]["quality"] >= goal),
               max(POLICY_GAPS, key=lambda g: curve[g]["quality"]))
    return {"gap": gap, "full_share": full_share, "quality": curve[gap]["quality"],
            "candidates": curve[gap]["candidates"], "fixed_quality": curve["fixed"]["quality"],
            "fixed_candidates": curve["fixed"]["candidates"]}


def like_params(like: Ranker, ds: Dataset) -> dict:
    """The configuration the evaluation chose for ``like`` (objective, feature groups, number of
    trees), to refit on ``ds``. The trees' other settings are :class:`Ranker`'s defaults, as
    :func:`train` uses them (bench/ranker_levers.py measures them). One exception: rows of CPUs
    of different vector classes (AVX2 and AVX-512) are learned with the CPU features (``c``).
    Without them the classes' labels contradict each other: with znver1's 353 AVX2 rows added,
    emeraldrapids' pooled leave-one-out top-1 fell from 0.832 to 0.756 without them, and was
    0.840 with them."""
    params = {k: v for k, v in like.get_params().items() if k in ("objective", "feature_groups", "n_estimators")}
    if "c" not in params["feature_groups"] and len(data_vector_classes(ds)) > 1:
        params["feature_groups"] = (*params["feature_groups"], "c")
    return params


def _copied(like: Ranker) -> dict:
    """Which ranker a refit copied, by content (its path is one machine's)."""
    return {k: like.metadata.get(k) for k in ("date", "model_sha256", "training_rows")}


def _refit_like(like: Ranker, ds: Dataset, dirs: list[Path], out: Path, report: dict) -> dict:
    """:func:`train` with the configuration the evaluation chose for ``like``
    (:func:`like_params`): no evaluation, the same second stage."""
    params = like_params(like, ds)
    report.update(config=config_label(params), objective=params["objective"], refit_like=_copied(like),
                  top_k=like.metadata.get("top_k") or 3, leave_one_network_out=None,
                  policy=like.metadata.get("policy"))
    stage2 = like.metadata.get("stage2")
    if stage2 and stage2.get("cost_model") and like.path is not None:
        # the cost model learned the donors' tuning logs, not the measurements: it carries over
        cm = CostModel.load(Path(like.path).with_name(stage2["cost_model"]))
        cm.save(cost_model_path(out), **cm.metadata)
        report["stage2"] = {**stage2, "cost_model": cost_model_path(out).name}
    ranker = _fit(Ranker(**params), ds, own_spec(like))
    _save(ranker, out, ds, dirs, report)
    return report


def _save(ranker: Ranker, out: Path, ds: Dataset, dirs: list[Path], report: dict) -> None:
    prov = provenance()
    # the ranker carries the CPU its labels were measured on, not the one it was fitted on
    data_cpus = data_cpus_of(ds)
    cpu_models = sorted({m.get("cpu") or "unknown" for m in ds.meta})
    ranker.save(out, training_data_hash=data_hash(ds), training_rows=int(len(ds.y)),
                training_groups=len(ds.groups), training_networks=ds.networks,
                measurement_dirs=[locations.portable(d) for d in dirs], threads=prov.get("threads"),
                top_k=report["top_k"], stage2=report.get("stage2"), policy=report.get("policy"),
                cpu=", ".join(cpu_models), mcpu=", ".join(data_cpus), data_cpus=data_cpus,
                fitted_on={"cpu": prov["cpu"], "mcpu": prov["mcpu"]}, tvm=prov["tvm"], date=prov["date"],
                evaluation={k: v for k, v in report.items() if k != "configs"})
    report["model"] = str(out)


def ranker_without(network: str, base: Ranker, store: DonorStore | None = None,
                   measurement_dirs: list[Path] | None = None) -> Ranker:
    """``base`` refitted without ``network``: none of its kernels, nor rows whose donor is it.

    For honest leave-one-out runs; ``base`` itself is returned if it never saw ``network``.
    """
    if network not in base.metadata.get("training_networks", []):
        return base
    store = store or DonorStore.load()
    # the data the ranker was trained from, so the refit differs from it by the network alone
    dirs = measurement_dirs if measurement_dirs is not None else (
        training_dirs(base) or default_measurement_dirs())
    # cached: every leave-one-out run of a network fits the same model from the same files
    path = _refit_path(network, base, dirs, store)
    try:
        return Ranker.load(path)
    except RankerError:
        pass
    ds = build_dataset(dirs, store)
    keep = [i for i, m in enumerate(ds.meta) if m["network"] != network and m.get("donor_network") != network]
    r = Ranker(**base.get_params())
    r.metadata = {**{k: v for k, v in base.metadata.items() if k != "own"},
                  "training_networks": [n for n in ds.networks if n != network], "left_out": network}
    # the CPUs' own rankers never see the network either
    _fit(r, subset(ds, keep), own_spec(base) if base.own_cpus() else None)
    r.save(path)
    return r


def _refit_path(network: str, base: Ranker, dirs: list[Path], store: DonorStore) -> Path:
    """Where :func:`ranker_without` keeps its fit: named by everything the fit reads (the base
    ranker and its parameters, the measurement tables, the donor records)."""
    files = sorted(p for d in dirs for p in Path(d).rglob("*") if p.is_file())
    files += [p for p in (db_file(Path(r.work_dir), RECORD_FILE) for r in store.reports) if p is not None]
    key = hashlib.sha256(json.dumps([network, base.metadata.get("model_sha256"), base.get_params(),
                                     FEATURE_VERSION, [str(p) for p in files], sha256_of(*files)],
                                    default=str).encode()).hexdigest()[:20]
    return cache_dir() / "rankers" / f"without-{network}-{key}.json"


def learn_logs(logs: list[str | Path], networks: list[str], target, budget_s: float,
               max_per_kernel: int, on_note=None) -> list[str]:
    """Ingest MetaSchedule work_dirs as donors (the user's store), then cross-measure their
    schedules on ``networks`` into the user's measurement tables, where :func:`train` finds
    them. Returns the new donor networks; ``on_note`` receives a line per step."""
    note = on_note or (lambda line: None)
    names = []
    for d in logs:
        dest, rep = add_work_dir(d)
        names.append(dest.name)
        note(f"ingested {d} as donor network {dest.name!r}: {rep.workloads} kernels, {rep.kept} records")
    store = DonorStore.load(target=target)
    new = store.without({w.network for w in store.workloads} - set(names))
    measurer = Measurer(target)
    try:
        for net, st in collect_networks(networks, new, cache_dir() / "data" / "measurements", target,
                                        measurer, budget_s, max_per_kernel=max_per_kernel):
            note(f"{net}: measured {st.measured} new pairs ({st.valid} valid)")
    finally:
        measurer.close()
    return names
