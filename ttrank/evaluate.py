"""Ranking metrics and leave-one-network-out evaluation.

top-k score (TenSet): for each target kernel, best latency among all measured candidates
divided by the best latency among the model's top-k; averaged with kernel weights x best
latency (the kernel's share of the model's time). NDCG@5 uses the relevances in [0, 1].
A candidate whose transfer was rejected is no pick: recommend skips it before measuring.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable

import numpy as np
from joblib import Parallel, delayed

from .collect import Dataset
from .features import FEATURE_NAMES
from .ranker import families_of, family_ranker_families, own_ranker_cpus
from .ranking import FixedK
from .transfer import REJECTED
from .target import host_cores
from .util import orphan_safe


def group_spans(ds: Dataset) -> list[tuple[int, int]]:
    """(first row, end) of each kernel group of the dataset, in order."""
    out, start = [], 0
    for g in ds.groups:
        out.append((start, start + g))
        start += g
    return out


def candidates(ds: Dataset, a: int, b: int) -> tuple[list[int], list[float | None]]:
    """The rows of group ``[a, b)`` that a ranking can pick, and their latencies (None: failed
    or wrong). A candidate whose transfer is rejected is never measured: recommend takes the
    next one in rank order (:func:`ttrank.ranking.shortlist`), so it is no pick here either."""
    picks = [i for i in range(a, b) if ds.meta[i].get("status") != REJECTED]
    return picks, [ds.meta[i]["latency_s"] if ds.y[i] > 0 else None for i in picks]


KS = tuple(range(1, 11))
KEYS = ("top1", "top3", "top5", "ndcg5", "within5")


def group_metrics(lat: list[float | None], scores: np.ndarray, ks=KS) -> dict[str, float]:
    best = min((x for x in lat if x), default=None)
    order = np.argsort(-np.asarray(scores), kind="stable")
    out = {}
    for k in ks:
        top = [lat[i] for i in order[:k] if lat[i]]
        out[f"top{k}"] = (best / min(top)) if (best and top) else 0.0
    rel = np.array([best / x if (best and x) else 0.0 for x in lat])
    gains = rel[order[:5]]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    ideal = sorted(rel, reverse=True)[:5]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    out["ndcg5"] = dcg / idcg if idcg > 0 else 0.0
    out["within5"] = float(bool(best) and bool(lat[order[0]]) and lat[order[0]] <= 1.05 * best)
    return out


def evaluate(ds: Dataset, scores: np.ndarray, rows: list[int] | None = None) -> dict[str, float]:
    """Weighted metrics over the groups (optionally only groups whose rows are in ``rows``)."""
    keep = set(rows) if rows is not None else None
    acc: dict[str, float] = defaultdict(float)
    total_w = 0.0
    for a, b in group_spans(ds):
        if keep is not None and a not in keep:
            continue
        picks, lat = candidates(ds, a, b)
        best = min((x for x in lat if x), default=None)
        if best is None:
            continue
        w = ds.meta[a]["weight"] * best
        for key, v in group_metrics(lat, scores[picks]).items():
            acc[key] += w * v
        total_w += w
    return {k: v / total_w for k, v in acc.items()} if total_w else {}


def baseline_scores(ds: Dataset, kind: str, seed: int = 0) -> np.ndarray:
    """Scores of the non-learned baselines on the same candidates."""
    idx = {n: i for i, n in enumerate(FEATURE_NAMES)}
    X = ds.X
    if kind == "random":
        return np.random.default_rng(seed).random(len(X))
    if kind == "nearest_shape":
        # the donor whose extents are closest (log-ratio L1), the donor's best record first
        return -(X[:, idx["r_ratio_l1"]] + 0.01 * X[:, idx["r_donor_rank"]])
    if kind == "donor_gflops":
        return X[:, idx["r_donor_gflops"]]
    raise ValueError(kind)


PAPER_PAIRING = {"resnet18": "resnet50", "resnet50": "googlenet", "alexnet": "vgg16",
                 "vgg16": "googlenet", "mobilenetv2": "efficientnetb4", "googlenet": "resnet50",
                 "mnasnet1_0": "googlenet", "efficientnetb0": "efficientnetb4",
                 "efficientnetb4": "efficientnetb0", "bert": "mobilebert", "mobilebert": "bert"}


def held_out_scores(ds: Dataset, make_model: Callable[[], object], groups: np.ndarray,
                     drop_own_donors: bool = False) -> tuple[np.ndarray, dict[str, list[int]]]:
    """Scores of every row from a model that never saw its group (scikit-learn's
    ``LeaveOneGroupOut`` over ``groups``), and each group's rows. With ``drop_own_donors``, rows
    whose donor schedules come from the held-out group (a network) are not trained on either."""
    # xgboost imports scikit-learn anyway; at the top it would cost every command 1.4 s of CPU
    from sklearn.model_selection import LeaveOneGroupOut

    scores = np.zeros(len(ds.y), dtype=np.float32)
    held: dict[str, list[int]] = {}
    if len(set(groups)) < 2:
        return scores, held
    folds = []
    for train, test in LeaveOneGroupOut().split(ds.X, groups=groups):  # groups in sorted order
        name = str(groups[test[0]])
        if drop_own_donors:
            train = [i for i in train if ds.meta[i].get("donor_network") != name]
        folds.append((name, list(train), test))
    # one fold per core (each fit is single-threaded, so the scores do not depend on n_jobs)
    fitted = Parallel(n_jobs=host_cores())(
        delayed(orphan_safe(_fit_predict))(make_model, ds.X[train], ds.y[train], _regroup(ds, train), ds.X[test])
        for _, train, test in folds)
    for (name, _, test), pred in zip(folds, fitted):
        scores[test] = pred
        held[name] = list(test)
    return scores, held


def _fit_predict(make_model: Callable[[], object], X, y, groups: list[int], X_test) -> np.ndarray:
    return make_model().fit(X, y, groups).predict(X_test)


def _averaged(per_group: dict[str, dict[str, float]]) -> dict[str, float]:
    keys = KEYS + tuple(f"top{k}" for k in KS if f"top{k}" not in KEYS)
    vals = [m for m in per_group.values() if m]
    return {k: float(np.mean([m[k] for m in vals])) for k in keys} if vals else {}


def leave_one_network_out(ds: Dataset, make_model: Callable[[], object]) -> dict:
    """Train on all networks but T, score T's candidates; T's own schedules are never candidates
    (the collector excludes them) nor training rows (T's groups are held out)."""
    nets = np.array([m["network"] for m in ds.meta])
    scores, held = held_out_scores(ds, make_model, nets, drop_own_donors=True)
    per_net = {net: evaluate(ds, scores, rows) for net, rows in held.items()}
    return {"networks": per_net, "average": _averaged(per_net), "scores": scores, "held": held}


def rows_by_network(ds: Dataset) -> dict[str, list[int]]:
    """Each network's rows, as :func:`leave_one_network_out` holds them out."""
    held: dict[str, list[int]] = defaultdict(list)
    for i, m in enumerate(ds.meta):
        held[m["network"]].append(i)
    return dict(sorted(held.items()))


def network_average(ds: Dataset, scores: np.ndarray) -> dict[str, float]:
    """Held-out ``scores`` (every network's from a model that never saw it) averaged over the
    networks, as :func:`leave_one_network_out` averages them."""
    return _averaged({n: evaluate(ds, scores, rows) for n, rows in rows_by_network(ds).items()})


def own_scores(ds: Dataset, make_own: Callable[[], object], make_family: Callable[[], object] | None,
               min_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-network-out scores of the rankers :meth:`ttrank.ranker.Ranker.fit_own` fits
    beside the pooled one: each CPU's own (``make_own()`` learns that CPU's rows of the other
    networks alone; for the CPUs with at least ``min_rows`` rows) and each CPU family's
    (``make_family()`` learns the family's rows; :func:`ttrank.ranker.family_ranker_families`).
    Returns (own, family) scores, NaN on the rows of a CPU or family without one."""
    cpus = cpu_of_rows(ds)
    fams = families_of(cpus)
    own, family = np.full(len(ds.y), np.nan), np.full(len(ds.y), np.nan)
    for cpu in own_ranker_cpus(cpus, min_rows):
        rows = np.flatnonzero(cpus == cpu)
        own[rows] = leave_one_network_out(subset(ds, rows), make_own)["scores"]
    for fam in family_ranker_families(cpus, min_rows) if make_family is not None else ():
        rows = np.flatnonzero(fams == fam)
        family[rows] = leave_one_network_out(subset(ds, rows), make_family)["scores"]
    return own, family


def blended(pooled: np.ndarray, weight: float, *others: np.ndarray) -> np.ndarray:
    """``pooled`` scores with ``others`` (NaN on rows without that ranker) blended in as
    :meth:`ttrank.ranker.Ranker.predict` does: each at ``weight`` against the pooled ``1 - weight``."""
    stack = np.vstack([np.asarray(o, dtype=np.float64) for o in others])
    n = (~np.isnan(stack)).sum(axis=0)
    pooled = np.asarray(pooled, dtype=np.float64)
    return ((1 - weight) * pooled + weight * np.nansum(stack, axis=0)) / ((1 - weight) + weight * n)


def by_cpu(ds: Dataset, scores: np.ndarray, held: dict[str, list[int]]) -> dict[str, dict]:
    """Held-out scores (``held``: each network's rows) evaluated on each CPU's rows apart:
    per CPU, the average over the networks it has rows of."""
    cpus = cpu_of_rows(ds)
    out = {}
    for cpu in sorted(set(cpus)):
        mine = set(np.flatnonzero(cpus == cpu).tolist())
        per_net = {net: evaluate(ds, scores, [i for i in rows if i in mine])
                   for net, rows in held.items() if any(i in mine for i in rows)}
        out[str(cpu)] = {"average": _averaged(per_net), "networks": per_net, "rows": len(mine)}
    return out


def subset(ds: Dataset, rows: list[int]) -> Dataset:
    """The dataset's ``rows`` (whole kernel groups, in order) as a dataset of their own."""
    rows = list(rows)
    return Dataset(ds.X[rows], ds.y[rows], _regroup(ds, rows), [ds.meta[i] for i in rows])


def cpu_of_rows(ds: Dataset) -> np.ndarray:
    """Each row's measuring CPU (LLVM's name; "unknown" where the row does not say)."""
    return np.array([m.get("mcpu") or "unknown" for m in ds.meta])


def per_cpu(ds: Dataset, make_model: Callable[[], object], pooled: bool = False) -> dict[str, dict]:
    """Leave one network out, scored on each CPU's rows: how well the ranker ranks for a CPU on
    a network it never saw.

    By default it learns from that CPU's rows alone. ``pooled`` trains it as the shipped ranker
    is trained, on every CPU's rows of the other networks (the held-out network's rows, and rows
    whose donor it is, stay out on every CPU)."""
    if pooled:
        res = leave_one_network_out(ds, make_model)
        return by_cpu(ds, res["scores"], res["held"])
    cpus = cpu_of_rows(ds)
    out = {}
    for cpu in sorted(set(cpus)):
        res = leave_one_network_out(subset(ds, np.flatnonzero(cpus == cpu)), make_model)
        out[str(cpu)] = {"average": res["average"], "networks": res["networks"],
                         "rows": int((cpus == cpu).sum())}
    return out


def leave_one_cpu_out(ds: Dataset, make_model: Callable[[], object]) -> dict:
    """Train on every CPU but C, score C's candidates: how the ranker does on a CPU it never saw
    (from the CPU features alone). Empty ``cpus`` with fewer than two CPUs in the data."""
    cpus = cpu_of_rows(ds)
    scores, held = held_out_scores(ds, make_model, cpus)
    by_cpu = {cpu: evaluate(ds, scores, rows) for cpu, rows in held.items()}
    return {"cpus": by_cpu, "average": _averaged(by_cpu), "have": sorted(set(map(str, cpus)))}


def repeat_agreement(ds: Dataset, min_common: int = 3) -> dict[str, dict]:
    """How well one measurement of a CPU's candidates predicts another: per CPU, every pair of
    kernel groups that measured the same workload on it (two networks share a conv) and at
    least ``min_common`` of the same candidates. ``median_abs_log_ratio``: the same candidate's
    two latencies apart (median over candidates); ``top1``/``top3``: candidates ordered by one
    group's latencies, scored on the other's as :func:`group_metrics` scores a ranker (each
    pair both ways). A ranker learns from such labels and is scored on them: this is the
    top-1 that knowing the first measurement exactly would reach."""
    seen: dict[tuple[str, str], list[dict[str, float | None]]] = defaultdict(list)
    for a, b in group_spans(ds):
        picks, lat = candidates(ds, a, b)
        meta = ds.meta[a]
        seen[(meta.get("mcpu") or "unknown", meta["workload"])].append(
            {ds.meta[i]["record"]: x for i, x in zip(picks, lat)})
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (cpu, _), groups in seen.items():
        for i, first in enumerate(groups):
            for j, second in enumerate(groups):
                common = [r for r in first if i != j and r in second and first[r] and second[r]]
                if len(common) < min_common:
                    continue
                m = group_metrics([second[r] for r in common], -np.array([first[r] for r in common]), ks=(1, 3))
                out = acc[cpu]
                out["top1"].append(m["top1"])
                out["top3"].append(m["top3"])
                out["log_ratio"] += [abs(math.log(first[r] / second[r])) for r in common]
                out["common"].append(len(common))
    return {cpu: {"pairs": len(v["top1"]), "candidates_per_pair": float(np.mean(v["common"])),
                  "median_abs_log_ratio": float(np.median(v["log_ratio"])),
                  "top1": float(np.mean(v["top1"])), "top3": float(np.mean(v["top3"]))}
            for cpu, v in sorted(acc.items())}


def choose_top_k(average: dict[str, float], goal: float = 0.97, min_gain: float = 0.005,
                 max_k: int = KS[-1]) -> int:
    """The default k for measuring: the smallest k whose leave-one-out top-k score reaches
    ``goal``; failing that, the smallest k after which one more candidate adds < ``min_gain``."""
    curve = [average.get(f"top{k}") for k in range(1, max_k + 1)]
    if not curve or curve[0] is None:
        return 3
    for k, v in enumerate(curve, 1):
        if v is not None and v >= goal:
            return k
    for k in range(1, max_k):
        if curve[k] is None or curve[k] - curve[k - 1] < min_gain:
            return k
    return max_k


def _regroup(ds: Dataset, rows: list[int]) -> list[int]:
    groups, last, n = [], None, 0
    spans = {a: b for a, b in group_spans(ds)}
    starts = sorted(spans)
    for i in rows:
        g = starts[bisect.bisect_right(starts, i) - 1]
        if g != last:
            if n:
                groups.append(n)
            last, n = g, 0
        n += 1
    if n:
        groups.append(n)
    return groups


def policy_curve(ds: Dataset, scores: np.ndarray, policies: dict[str, FixedK]) -> dict[str, dict]:
    """Quality against candidates measured, per measuring policy, on (out-of-fold) ``scores``:
    ``quality`` is the weighted top-k score with each kernel's k from the policy,
    ``candidates`` the mean k per kernel. A kernel's share is its weight x untuned latency over
    its network's (weight x best latency where the table has no untuned time)."""
    spans = []
    net_total: dict[str, float] = defaultdict(float)
    for a, b in group_spans(ds):
        picks, lat = candidates(ds, a, b)
        best = min((x for x in lat if x), default=None)
        if best is None:
            continue
        m = ds.meta[a]
        cost = m["weight"] * (m.get("untuned_s") or best)
        net_total[m["network"]] += cost
        spans.append((picks, lat, best, cost))
    out = {}
    for name, policy in policies.items():
        acc = total_w = n_k = 0.0
        for picks, lat, best, cost in spans:
            a = picks[0]
            s = np.asarray(scores[picks])
            order = np.argsort(-s, kind="stable")
            share = cost / net_total[ds.meta[a]["network"]]
            k = policy.k(s[order], share)
            top = [lat[i] for i in order[:k] if lat[i]]
            w = ds.meta[a]["weight"] * best
            acc += w * (best / min(top) if top else 0.0)
            total_w += w
            n_k += k
        out[name] = {"quality": acc / total_w if total_w else 0.0,
                     "candidates": n_k / len(spans) if spans else 0.0, "policy": policy.to_json()}
    return out
