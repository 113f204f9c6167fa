"""The second ranking stage: MetaSchedule's own program features, and a cost model pre-trained
on every program the donor tuning runs measured.

A donor run keeps only its best few records per kernel in the store, but its tuning log holds
every trial it measured: tens of thousands of (program, latency) pairs over hundreds of
workloads, at no extra cost. :class:`CostModel` learns from them how close a program comes to
the best one found for its workload (MetaSchedule's ``PerStoreFeature``, reduced to max and mean
over buffer stores). Ranking (:mod:`ttrank.ranking`) applies it to the ranker's shortlist of
each kernel, after the donor schedules are transferred onto it, and blends the two scores; the
blend weight and the shortlist length come from the leave-one-network-out evaluation
(``ttrank.training``), which keeps the stage only where it helps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from joblib import Parallel, delayed

from . import locations, zoo
from .errors import RankerError, TTRankError
from .kernels import extract
from .layouts import PACKED_LAYOUTS
from .ranker import BoosterModel
from .target import cpu_tensor_intrinsics, host_cores, make_target, target_key
from .transfer import transfer
from .util import cache_dir, file_lock, fill_caches, orphan_safe, sha256_of
from .workdir import FAILED_SECS, RECORD_FILE, WORKLOAD_FILE, db_file, network_of, open_database

log = logging.getLogger("ttrank")

PROGRAM_FEATURE_VERSION = 1
N_PSF = 164  # PerStoreFeature's width per buffer store (TVM 0.27)
WIDTH = 2 * N_PSF


def cost_model_path(ranker_path: str | Path) -> Path:
    """Where a ranker's cost model lives: beside it (models/ranker.json -> models/ranker.costmodel.json)."""
    p = Path(ranker_path)
    return p.with_name(p.stem + ".costmodel.json")




def default_cost_model() -> Path:
    """The shipped ranker's cost model (see :mod:`ttrank.locations`)."""
    return cost_model_path(locations.shipped_ranker())


class Featurizer:
    """Program vectors of scheduled PrimFuncs for one target (the extractor is reused)."""

    def __init__(self, target):
        from tvm.s_tir import meta_schedule as ms

        self.target = target
        self._extractor = ms.feature_extractor.PerStoreFeature(extract_workload=False)
        with cpu_tensor_intrinsics(target):
            self._context = ms.TuneContext(target=target)

    def of_candidates(self, candidates: list) -> np.ndarray:
        """``MeasureCandidate`` list -> (n, WIDTH) array; NaN rows for programs it cannot read."""
        if not candidates:
            return np.zeros((0, WIDTH), dtype=np.float32)
        try:
            feats = self._extractor.extract_from(self._context, candidates)
        except Exception as e:  # one bad program must not lose the batch: go one by one
            if len(candidates) == 1:
                log.debug("program features failed: %s", e)
                return np.full((1, WIDTH), np.nan, dtype=np.float32)
            return np.concatenate([self.of_candidates([c]) for c in candidates])
        return np.stack([_reduce(f.numpy()) for f in feats])

    def of_module(self, mod) -> np.ndarray:
        """The vector of one scheduled module (a transferred candidate's ``mod``)."""
        from tvm import s_tir
        from tvm.s_tir import meta_schedule as ms
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        func = mod[list(mod.functions)[0]]
        return self.of_candidates([ms.MeasureCandidate(s_tir.Schedule(mod), ArgInfo.from_prim_func(func))])[0]


def _reduce(f: np.ndarray) -> np.ndarray:
    if f.size == 0:
        return np.zeros(WIDTH, dtype=np.float32)
    return np.concatenate([f.max(axis=0), f.mean(axis=0)]).astype(np.float32)


@dataclass
class RecordSet:
    """Every measured trial of one donor run: program vectors, latencies, workload ids."""

    network: str
    X: np.ndarray
    latency_s: np.ndarray
    workload: np.ndarray

    def labels(self) -> np.ndarray:
        """Relative throughput: the workload's best latency / the trial's; failed trials 0."""
        return relative_throughput(self.latency_s, self.workload)


def relative_throughput(latency_s: np.ndarray, workload: np.ndarray) -> np.ndarray:
    y = np.zeros(len(latency_s), dtype=np.float32)
    for w in np.unique(workload):
        idx = np.where(workload == w)[0]
        ok = idx[latency_s[idx] < FAILED_SECS]
        if len(ok):
            y[ok] = latency_s[ok].min() / latency_s[ok]
    return y


def _record_set_path(work_dir: Path, target) -> Path:
    """Where :func:`record_set` caches a work_dir's set: named by the log's content."""
    import tvm  # its version is part of the name

    files = [db_file(work_dir, WORKLOAD_FILE), db_file(work_dir, RECORD_FILE)]
    if None in files:
        raise RankerError(f"{work_dir}: not a MetaSchedule work_dir")
    # "own machine": sets cached before the fallback in record_set held no trials on a new CPU
    key = hashlib.sha256(json.dumps([sha256_of(*files), PROGRAM_FEATURE_VERSION, tvm.__version__,
                                     target_key(target), "own machine"]).encode()).hexdigest()[:20]
    return cache_dir() / "program_features" / "records" / f"{work_dir.name}-{key}.npz"


def _cache_record_set(work_dir: str, target_spec: dict, path: str) -> None:
    """:func:`record_set` in a worker process (a Target does not cross processes: its dict does)."""
    _record_set(Path(work_dir), make_target(target_spec), Path(path))


def record_sets(work_dirs: Iterable[str | Path], target) -> list[RecordSet]:
    """:func:`record_set` of each work_dir; those not cached yet are extracted on every core
    (one work_dir per worker: minutes each for the zoo's larger logs)."""
    # each path hashes its logs (megabytes): once per work_dir
    paths = {Path(d): _record_set_path(Path(d), target) for d in work_dirs}
    todo = fill_caches(paths, _cache_record_set, json.loads(str(target)))
    featurizer = Featurizer(target) if todo else None  # one for the sets left to this process
    return [_record_set(d, target, p, featurizer) for d, p in paths.items()]


def record_set(work_dir: str | Path, target, featurizer: Featurizer | None = None) -> RecordSet:
    """The trials of a donor work_dir as a :class:`RecordSet` (those tuned for ``target``, or
    if none, for the log's own machine); cached by the log's content, since extraction takes
    about 0.02 s per trial."""
    return _record_set(Path(work_dir), target, _record_set_path(Path(work_dir), target), featurizer)


def _record_set(work_dir: Path, target, path: Path, featurizer: Featurizer | None = None) -> RecordSet:
    """:func:`record_set`, its cache file ``path`` known."""
    import tvm_ffi  # TVM loads slowly: only when features are extracted

    if path.exists():
        z = np.load(path, allow_pickle=False)
        return RecordSet(work_dir.name, z["X"], z["latency_s"], z["workload"])
    featurizer = featurizer or Featurizer(target)
    records = open_database(work_dir).get_all_tuning_records()
    keys = [_record_target_key(r.target) for r in records]
    # one machine's latencies per log: this target's if the log has any, else those of the
    # machine it was tuned on (its most common target). Relative throughput carries over
    # between CPUs far better than no cost model at all on a host the donors never saw.
    want = target_key(target)
    if want not in keys and keys:
        want = max(set(keys), key=keys.count)
    X, lat, wl = [], [], []
    for r, k in zip(records, keys):
        if k != want:
            continue
        secs = [float(s) for s in (r.run_secs or [])]
        X.append(featurizer.of_candidates([r.as_measure_candidate()])[0])
        lat.append(min(secs) if secs else 10 * FAILED_SECS)
        wl.append(f"{tvm_ffi.structural_hash(r.workload.mod) & 0xFFFFFFFFFFFFFFFF:016x}")
    rs = RecordSet(work_dir.name, np.asarray(X, dtype=np.float32).reshape(-1, WIDTH),
                   np.asarray(lat, dtype=np.float64), np.asarray(wl, dtype=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, X=rs.X, latency_s=rs.latency_s, workload=rs.workload)
    tmp.replace(path)
    return rs


class CostModel(BoosterModel):
    """XGBoost regression from a program vector to its relative throughput on its workload.

    Only the order within one target kernel matters, so the label is per workload (best / own
    latency), as in MetaSchedule's own cost model.
    """

    def __init__(self, n_estimators: int = 300, max_depth: int = 8, learning_rate: float = 0.1,
                 subsample: float = 0.8, colsample_bytree: float = 0.8, seed: int = 0, n_jobs: int = 1):
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.subsample = subsample
        self.colsample_bytree = colsample_bytree
        self.seed = seed
        self.n_jobs = n_jobs
        self.booster = None
        self.metadata: dict[str, Any] = {}

    @staticmethod
    def _x(X: np.ndarray) -> np.ndarray:
        # counts and byte sizes span orders of magnitude; NaN (unreadable program) stays missing
        X = np.asarray(X, dtype=np.float32).reshape(-1, WIDTH)
        return np.sign(X) * np.log1p(np.abs(X))

    def fit(self, X: np.ndarray, y: np.ndarray) -> CostModel:
        import xgboost as xgb

        params = {"objective": "reg:squarederror", "max_depth": self.max_depth, "eta": self.learning_rate,
                  "subsample": self.subsample, "colsample_bytree": self.colsample_bytree,
                  "seed": self.seed, "nthread": self.n_jobs, "tree_method": "hist", "verbosity": 0}
        d = xgb.DMatrix(self._x(X), label=np.asarray(y, dtype=np.float32))
        self.booster = xgb.train(params, d, num_boost_round=self.n_estimators)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        if self.booster is None:
            raise RankerError("the cost model is not fitted")
        X = self._x(X)
        if not len(X):
            return np.zeros(0, dtype=np.float32)
        return self.booster.predict(xgb.DMatrix(X))

    def save(self, path: str | Path, **metadata) -> Path:
        return self._write(path, "cost model", {**self.metadata, **metadata,
                                                "program_feature_version": PROGRAM_FEATURE_VERSION,
                                                "width": WIDTH, "params": self.get_params()})

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """Load a cost model; refuse one written for other program features."""
        path = Path(path) if path else default_cost_model()

        def check(meta: dict) -> str | None:
            if meta.get("program_feature_version") != PROGRAM_FEATURE_VERSION or meta.get("width") != WIDTH:
                return (f"{path} was trained on program features v{meta.get('program_feature_version')} "
                        f"({meta.get('width')} wide); this ttrank computes v{PROGRAM_FEATURE_VERSION} "
                        f"({WIDTH} wide): retrain it (python train.py)")
            return None

        return cls._read(path, "cost model", "python train.py writes one", check)


def fit_cost_model(work_dirs: Iterable[str | Path], target, exclude_networks: Iterable[str] = (),
                   **params) -> CostModel:
    """A cost model on every trial of ``work_dirs`` but those of ``exclude_networks``."""
    # a network's other donor sets (packed, native) are its schedules too
    sets = record_sets([d for d in work_dirs if network_of(d) not in set(exclude_networks)], target)
    sets = [s for s in sets if len(s.latency_s)]
    if not sets:
        raise RankerError("no donor tuning records to train a cost model on")
    X = np.concatenate([s.X for s in sets])
    y = np.concatenate([s.labels() for s in sets])
    m = CostModel(**params).fit(X, y)
    m.metadata = {"networks": sorted(s.network for s in sets), "trials": int(len(y))}
    return m


def cost_model_without(networks: Iterable[str], work_dirs: list[str | Path], target) -> CostModel:
    """:func:`fit_cost_model` leaving ``networks`` out, cached (a fit takes about a minute)."""
    networks = sorted(set(networks))
    logs = [p for p in (db_file(Path(d), RECORD_FILE) for d in work_dirs) if p is not None]
    key = hashlib.sha256(json.dumps([networks, sha256_of(*logs), PROGRAM_FEATURE_VERSION,
                                     target_key(target), CostModel().get_params()]).encode()).hexdigest()[:20]
    path = cache_dir() / "program_features" / "models" / f"without-{'-'.join(networks) or 'none'}-{key}.json"
    try:
        return CostModel.load(path)
    except RankerError:
        pass
    m = fit_cost_model(work_dirs, target, exclude_networks=networks)
    m.save(path, **m.metadata)
    return m


def zscore(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    sd = v.std()
    return (v - v.mean()) / sd if sd > 0 else np.zeros_like(v)


def blend(ranker_scores: np.ndarray, cost_scores: np.ndarray, weight: float) -> np.ndarray:
    """One kernel's shortlist: ``weight`` x the ranker's z-score + the rest x the cost model's.
    Unreadable programs (NaN) count as the shortlist's worst."""
    c = np.asarray(cost_scores, dtype=np.float64)
    c = np.where(np.isnan(c), np.nanmin(c) if np.isfinite(c).any() else 0.0, c)
    return weight * zscore(ranker_scores) + (1.0 - weight) * zscore(c)


def rerank_spans(spans: list[tuple[int, int]], ranker_scores: np.ndarray, cost_scores: np.ndarray,
                 weight: float, shortlist: int) -> np.ndarray:
    """What :func:`ttrank.ranking.rerank` does, on a dataset's groups: each group's ``shortlist``
    best by the ranker reordered by :func:`blend`, every shortlisted candidate above every other."""
    out = np.asarray(ranker_scores, dtype=np.float64).copy()
    for a, b in spans:
        order = np.argsort(-out[a:b], kind="stable")
        short = order[:shortlist] + a
        rest = order[shortlist:] + a
        new = blend(out[short], cost_scores[short], weight)
        if len(rest):
            new += out[rest].max() + 1.0 - new.min()
        out[short] = new
    return out


def _record_target_key(target) -> str:
    """:func:`ttrank.target.target_key` of a tuning record's Target object."""
    return target_key({str(k): str(v) for k, v in target.export().items()})


def _candidates_path(network: str, target) -> Path:
    """Where :func:`candidate_vectors` keeps a network's candidates' vectors for ``target``: one
    file that grows with the tables (a new row transfers only its own candidate)."""
    import tvm  # its version is part of the name

    key = hashlib.sha1(json.dumps([target_key(target), PROGRAM_FEATURE_VERSION, tvm.__version__]).encode())
    return cache_dir() / "program_features" / "candidates" / f"{network}-{key.hexdigest()[:12]}.npz"


def _read_candidates(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """A candidates cache file as {(workload hash, record id): vector}; a NaN vector is a
    candidate that has no program to read (its transfer was rejected, or its kernel is not
    among those its network gives for this target)."""
    if not path.exists():
        return {}
    z = np.load(path, allow_pickle=False)
    return {tuple(k.split("|", 1)): v for k, v in zip(z["keys"], z["X"])}


def _network_vectors(network: str, pairs: list[tuple[str, str, Any, Any]], target_spec: dict) -> \
        dict[tuple[str, str], np.ndarray] | None:
    """Vectors of one zoo network's candidates ``pairs`` ((workload hash, record id, donor
    workload, donor record)), each transferred onto the network's kernel again; None when the
    network cannot be rebuilt (rows of a user's own model)."""
    target = make_target(target_spec)
    wanted = {wh for wh, *_ in pairs}
    try:
        # the tables hold rows of both imports (exact math before it became the default)
        kernels = {k.workload_hash: k for fast in (False, True)
                   for k in extract(zoo.load(f"zoo:{network}", fast_math=fast).mod, target)}
        for layout in PACKED_LAYOUTS:  # rows of the packed-conv layouts too
            if not wanted <= kernels.keys():
                kernels.update((k.workload_hash, k) for k in extract(
                    zoo.load(f"zoo:{network}", layout=layout, target=target).mod, target))
    except TTRankError as e:
        log.info("no program features for %s: %s", network, e)
        return None
    featurizer = Featurizer(target)
    out = {}
    none = np.full(WIDTH, np.nan, np.float32)
    for wh, rid, w, r in pairs:
        c = transfer(r, kernels[wh], w, target) if wh in kernels else None
        out[(wh, rid)] = featurizer.of_module(c.mod) if c is not None and c.ok else none
    return out


def candidate_vectors(ds, store, target) -> np.ndarray:
    """Program vectors of a dataset's candidates, each transferred onto its target kernel again
    (about 0.1-0.3 s each, one network per core; cached per network and target, so rows added
    to the tables later cost only their own transfers). NaN where there is no program."""
    rec_of = store.by_record_id()
    out = np.full((len(ds.meta), WIDTH), np.nan, dtype=np.float32)
    rows_of: dict[str, list[int]] = {}
    for i, m in enumerate(ds.meta):
        rows_of.setdefault(m["network"], []).append(i)
    known, todo = {}, {}
    for net, rows in rows_of.items():
        known[net] = _read_candidates(_candidates_path(net, target))
        keys = sorted({(ds.meta[i]["workload"], ds.meta[i]["record"]) for i in rows} - known[net].keys())
        pairs = [(wh, rid, *rec_of[rid]) for wh, rid in keys if rid in rec_of]
        if pairs:
            todo[net] = pairs
    if todo:
        nets = sorted(todo, key=lambda n: -len(todo[n]))  # the longest first: the cores end together
        log.info("program features of %d candidates of %d networks", sum(map(len, todo.values())), len(nets))
        spec = json.loads(str(target))
        found = Parallel(n_jobs=min(host_cores(), len(nets)))(
            delayed(orphan_safe(_network_vectors))(n, todo[n], spec) for n in nets)
        for net, vec in zip(nets, found):
            if vec is None:
                continue
            path = _candidates_path(net, target)
            with file_lock(path):  # another process may have added candidates meanwhile
                known[net] = {**_read_candidates(path), **vec}
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.stem + f".{os.getpid()}.tmp.npz")
                np.savez_compressed(tmp, keys=np.array([f"{a}|{b}" for a, b in known[net]], dtype=str),
                                    X=np.stack(list(known[net].values())))
                tmp.replace(path)
    for net, rows in rows_of.items():
        for i in rows:
            v = known[net].get((ds.meta[i]["workload"], ds.meta[i]["record"]))
            if v is not None:
                out[i] = v
    return out


def loo_cost_scores(ds, store, target, work_dirs: list[Path]) -> np.ndarray:
    """Each row's cost-model score from a model that never saw the row's own network."""
    X = candidate_vectors(ds, store, target)
    out = np.zeros(len(ds.meta), dtype=np.float64)
    for net in ds.networks:
        rows = [i for i, m in enumerate(ds.meta) if m["network"] == net]
        out[rows] = cost_model_without([net], work_dirs, target).predict(X[rows])
    out[np.isnan(X).any(axis=1)] = np.nan  # programs that could not be read
    return out
