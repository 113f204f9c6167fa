"""The XGBoost ranker: scores candidates of one target kernel against each other."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from joblib import Parallel, delayed

from . import locations
from .errors import RankerError
from .features import FEATURE_GROUPS, FEATURE_NAMES, FEATURE_VERSION, group_columns
from .target import cpu_family, host_cores
from .util import atomic_write_bytes, atomic_write_json, orphan_safe

log = logging.getLogger(__name__)

OBJECTIVES = ("rank:ndcg", "rank:pairwise", "reg:squarederror")

# A CPU's own ranker (fitted on its rows alone) is blended with the pooled one at this weight,
# for CPUs with at least OWN_MIN_ROWS rows: bench/ranker_levers.py, leave one network out, 3
# seeds. Own rankers of thinner data (znver5's 852 rows, measured under load) lowered its picks.
# A CPU family's ranker (its CPUs' rows, with the CPU features) is blended in at the same weight,
# for the CPUs whose leave-one-network-out it improves (training.evaluate_own): with both, the
# three are averaged (3 seeds: emeraldrapids top-1 0.863 -> 0.871, where 0.5 / 0.25 / 0.25 gave 0.861).
OWN_WEIGHT = 0.5
OWN_MIN_ROWS = 2000


def own_ranker_cpus(cpus: np.ndarray, min_rows: int) -> list[str]:
    """The CPUs among ``cpus`` (each row's mcpu) that get an own ranker: named ones with at
    least ``min_rows`` rows."""
    names, counts = np.unique(np.asarray(cpus), return_counts=True)
    return [str(c) for c, n in zip(names, counts) if c and c != "unknown" and n >= min_rows]


def own_feature_groups(feature_groups: tuple[str, ...]) -> tuple[str, ...]:
    """An own ranker's feature groups: its pooled ranker's without the CPU features, which are
    constant on one CPU's rows."""
    return tuple(g for g in feature_groups if g != "c")


def families_of(cpus: np.ndarray) -> np.ndarray:
    """Each row's CPU family (:func:`ttrank.target.cpu_family`; "" where unknown)."""
    cpus = np.asarray(cpus)
    names = {c: cpu_family(str(c)) or "" for c in set(cpus.tolist()) if c and c != "unknown"}
    return np.array([names.get(c, "") for c in cpus.tolist()], dtype=object)


def family_ranker_families(cpus: np.ndarray, min_rows: int) -> dict[str, list[str]]:
    """The CPU families among ``cpus`` (each row's mcpu) that can have a family ranker, with their
    CPUs: at least two CPUs with rows (one CPU's rows are its own ranker's) and ``min_rows``
    rows together."""
    cpus = np.asarray(cpus)
    fams = families_of(cpus)
    out = {}
    for f in sorted(set(fams.tolist()) - {""}):
        members = sorted(set(cpus[fams == f].tolist()))
        if len(members) >= 2 and int((fams == f).sum()) >= min_rows:
            out[f] = members
    return out


def relevance(latencies: list[float | None]) -> np.ndarray:
    """Per group: best latency / latency in (0, 1]; failed or wrong candidates get 0."""
    ok = [x for x in latencies if x is not None and x > 0]
    best = min(ok) if ok else None
    return np.array([best / x if (best and x) else 0.0 for x in latencies], dtype=np.float32)


def data_cpus(metadata: dict) -> list[str]:
    """The CPUs (mcpu) a ranker's training labels were measured on (older files: its ``mcpu``)."""
    if metadata.get("data_cpus"):
        return list(metadata["data_cpus"])
    return [c.strip() for c in str(metadata.get("mcpu") or "").split(",") if c.strip()]


class BoosterModel:
    """An XGBoost booster, its parameters (the constructor's arguments, kept as attributes of the
    same names: the estimator protocol scikit-learn's ``get_params`` follows) and its metadata,
    saved by :func:`write_booster` beside a ``.meta.json``."""

    booster: Any = None
    # parameters added since files were first written: what a file without them was fitted with
    ABSENT_MEANS: dict[str, Any] = {}

    def get_params(self) -> dict[str, Any]:
        names = list(inspect.signature(type(self).__init__).parameters)[1:]
        return {k: getattr(self, k) for k in names}

    def _write(self, path: str | Path, what: str, meta: dict) -> Path:
        if self.booster is None:
            raise RankerError(f"cannot save an unfitted {what}")
        self.metadata = write_booster(path, self.booster, meta)
        return Path(path)

    @classmethod
    def _read(cls, path: Path, what: str, hint: str, check):
        """The model in ``path`` (see :func:`read_booster`), made with its saved parameters."""
        booster, meta = read_booster(path, what, hint, check)
        try:
            params = {**cls.ABSENT_MEANS, **meta.get("params", {})}
            m = cls(**{k: v for k, v in params.items() if k in cls().get_params()})
        except (TypeError, ValueError) as e:
            raise RankerError(f"{meta_path(path)}: unusable parameters ({e})") from None
        m.booster, m.metadata = booster, meta
        return m


class Ranker(BoosterModel):
    """An XGBoost learning-to-rank model over :data:`ttrank.features.FEATURE_NAMES`.

    Labels are per-group relevances (:func:`relevance`); groups are target kernels.
    """

    ABSENT_MEANS = {"parallel_trees": 1}

    # the tree settings: bench/ranker_levers.py's best on 22,669 rows of 7 CPUs (each CPU's
    # leave-one-network-out top-1 +0.01 to +0.03 over depth 6, one tree per round, 0.9/0.9)
    def __init__(self, objective: str = "rank:pairwise", n_estimators: int = 300,
                 max_depth: int = 8, learning_rate: float = 0.05, subsample: float = 0.8,
                 colsample_bytree: float = 0.5, min_child_weight: float = 1.0, seed: int = 0,
                 n_jobs: int = 1,
                 feature_groups: tuple[str, ...] = FEATURE_GROUPS, parallel_trees: int = 5):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}")
        self.objective = objective
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.subsample = subsample
        self.colsample_bytree = colsample_bytree
        self.min_child_weight = min_child_weight
        self.seed = seed
        # one thread by default: the data is small, and on a busy machine OpenMP threads spin
        # waiting for each other (minutes instead of seconds)
        self.n_jobs = n_jobs
        self.feature_groups = tuple(feature_groups)
        # trees grown per round, each on its own sample of rows and columns, averaged (a boosted
        # random forest): the round's step varies less with the sample
        self.parallel_trees = parallel_trees
        self._cols = group_columns(self.feature_groups)
        self.booster = None
        self.metadata: dict[str, Any] = {}
        self.path: Path | None = None  # where it was loaded from (its cost model lives beside it)
        self.own: dict[str, Ranker] = {}  # each CPU's own ranker (:meth:`fit_own`), loaded lazily

    @property
    def width(self) -> int:
        """Columns of the X this ranker takes (it uses those of its feature groups)."""
        return len(FEATURE_NAMES)

    @property
    def feature_names(self) -> list[str]:
        return [FEATURE_NAMES[i] for i in self._cols]

    def fit(self, X: np.ndarray, y: np.ndarray, groups: list[int] | np.ndarray) -> Ranker:
        """``groups``: sizes of consecutive groups in X (one group per target kernel)."""
        import xgboost as xgb

        X = np.asarray(X, dtype=np.float32)
        if X.shape[1] != self.width:
            raise RankerError(f"X has {X.shape[1]} features, schema v{FEATURE_VERSION} has "
                              f"{self.width}")
        d = xgb.DMatrix(X[:, self._cols], label=np.asarray(y, dtype=np.float32),
                        feature_names=self.feature_names)
        if self.objective.startswith("rank:"):
            d.set_group(np.asarray(groups, dtype=np.uint32))
        self.booster = xgb.train(self.xgb_params(), d, num_boost_round=self.n_estimators)
        self.own = {}  # learned from the rows it had before
        self.metadata.pop("own", None)
        return self

    def xgb_params(self) -> dict[str, Any]:
        """The parameters :meth:`fit` hands ``xgboost.train`` (besides the number of rounds)."""
        params = {"objective": self.objective, "max_depth": self.max_depth,
                  "eta": self.learning_rate, "subsample": self.subsample,
                  "colsample_bytree": self.colsample_bytree, "min_child_weight": self.min_child_weight,
                  "seed": self.seed, "nthread": self.n_jobs, "verbosity": 0}
        if self.parallel_trees > 1:
            params["num_parallel_tree"] = self.parallel_trees
        if self.objective.startswith("rank:"):
            params["lambdarank_pair_method"] = "topk" if self.objective == "rank:ndcg" else "mean"
            if self.objective == "rank:ndcg":
                params["ndcg_exp_gain"] = False  # relevances are real numbers in [0, 1]
        return params

    def fit_own(self, X: np.ndarray, y: np.ndarray, groups: list[int] | np.ndarray,
                cpus: np.ndarray, min_rows: int = OWN_MIN_ROWS, weight: float = OWN_WEIGHT,
                family_for: list[str] | tuple[str, ...] | None = ()) -> Ranker:
        """Fit each CPU's own ranker on its rows alone (``cpus``: each row's mcpu), for the CPUs
        with at least ``min_rows``, and for the CPUs ``family_for`` their family's ranker, on
        the rows of every CPU of it (:func:`family_ranker_families`). :meth:`predict` for such
        a CPU blends them in, each at ``weight`` against the pooled ranker's ``1 - weight`` (at
        0.5, the plain mean of the rankers that know the CPU). An own ranker's settings are this
        ranker's without the CPU features (constant on one CPU); a family's are this ranker's."""
        cpus = np.asarray(cpus)
        fams = families_of(cpus)
        sizes = np.asarray(groups, dtype=int)
        # a kernel group is measured on one CPU: its first row's
        starts = np.cumsum(sizes) - sizes
        own_params = {**self.get_params(), "feature_groups": own_feature_groups(self.feature_groups)}
        families = family_ranker_families(cpus, min_rows)
        family_for = sorted(c for c in family_for or () if cpu_family(c) in families)
        jobs = [(c, own_params, cpus == c) for c in own_ranker_cpus(cpus, min_rows)]
        jobs += [(f, self.get_params(), fams == f) for f in sorted({cpu_family(c) for c in family_for})]
        # one ranker per core: each fit is single-threaded (4 CPUs' fits took 40 s one after another)
        fitted = Parallel(n_jobs=min(len(jobs), host_cores()) or 1)(
            delayed(orphan_safe(_fit_ranker))(params, X[rows], y[rows], sizes[rows[starts]])
            for _, params, rows in jobs)
        self.own = {name: r for (name, _, _), r in zip(jobs, fitted)}
        self.metadata["own"] = {
            "weight": float(weight), "min_rows": int(min_rows),
            "cpus": {c: {"rows": int((cpus == c).sum())} for c, _, _ in jobs if c not in families},
            "families": {f: {"rows": int((fams == f).sum()), "cpus": families[f]}
                         for f, _, _ in jobs if f in families},
            "family_for": family_for}
        return self

    def own_cpus(self) -> list[str]:
        """The CPUs that have an own ranker to blend in."""
        return sorted((self.metadata.get("own") or {}).get("cpus") or {})

    def family_cpus(self) -> list[str]:
        """The CPUs that blend their family's ranker in."""
        return sorted((self.metadata.get("own") or {}).get("family_for") or [])

    def own_ranker(self, cpu: str | None) -> Ranker | None:
        """``cpu``'s own ranker, None if it has none."""
        return self._scoped("cpus", cpu or "")

    def family_ranker(self, cpu: str | None) -> Ranker | None:
        """The ranker of ``cpu``'s family, None unless ``cpu`` blends it in."""
        return self._scoped("families", cpu_family(cpu) or "") if cpu in self.family_cpus() else None

    def _scoped(self, section: str, name: str) -> Ranker | None:
        """The ranker of a CPU or family (``section`` of the own metadata) named ``name``,
        loaded from beside this one the first time; None if there is none."""
        spec = ((self.metadata.get("own") or {}).get(section) or {}).get(name)
        if spec is None:
            return None
        if name not in self.own:
            if self.path is None or not spec.get("file"):
                raise RankerError(f"the ranker's own model for {name} was never saved")
            f = self.path.with_name(spec["file"])
            if not f.exists() or not meta_path(f).exists():
                # copied without it: the pooled ranker alone is still a whole ranker
                log.warning("%s names %s as its own model for %s, which is missing: ranking "
                            "without it", self.path, f.name, name)
                self.metadata["own"][section].pop(name)
                return None
            own = Ranker.load(f)
            if spec.get("model_sha256") not in (None, own.metadata.get("model_sha256")):
                raise RankerError(f"{own.path} is not the own model {self.path} was saved with")
            self.own[name] = own
        return self.own[name]

    def predict(self, X: np.ndarray, cpu: str | None = None) -> np.ndarray:
        """Scores: higher means expected faster (comparable within one target kernel). ``cpu``
        (the measuring CPU's mcpu): blend in its own ranker and its family's if it has them."""
        scores = self._predict(X)
        others = [r._predict(X) for r in (self.own_ranker(cpu), self.family_ranker(cpu)) if r is not None]
        if not others:
            return scores
        w = float(self.metadata["own"]["weight"])
        # all regress the same relevance: a weighted average keeps the scale AdaptiveK's gap reads
        return ((1 - w) * scores + w * np.sum(others, axis=0)) / ((1 - w) + w * len(others))

    def _predict(self, X: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        if self.booster is None:
            raise RankerError("the ranker is not fitted")
        X = np.asarray(X, dtype=np.float32).reshape(-1, self.width)
        return self.booster.predict(xgb.DMatrix(X[:, self._cols], feature_names=self.feature_names))

    # --- persistence ------------------------------------------------------------------------
    def save(self, path: str | Path, **metadata) -> Path:
        """Write the booster (:func:`write_booster`) and a sidecar ``.meta.json``, both atomically, and
        each CPU's own ranker and each family's beside it (``<stem>.own-<mcpu or family>.json``,
        written first: the metadata that names them comes last). Own files it no longer has
        are removed."""
        path = Path(path)
        meta = {**self.metadata, **metadata}
        if meta.get("own"):
            own = dict(meta["own"])
            for section in ("cpus", "families"):
                specs = {}
                for name, spec in (own.get(section) or {}).items():
                    r = self._scoped(section, name)
                    if r is None:  # a missing file (warned about): dropped
                        continue
                    f = path.with_name(f"{path.stem}.own-{name}.json")
                    r.save(f, own_of=name)
                    specs[name] = {**spec, "file": f.name, "model_sha256": r.metadata["model_sha256"]}
                own[section] = specs
            meta["own"] = own
        out = self._write(path, "ranker", {
            "feature_version": FEATURE_VERSION, "feature_names": FEATURE_NAMES,
            "params": self.get_params(), **meta})
        self.path = path
        own = meta.get("own") or {}
        kept = {spec["file"] for section in ("cpus", "families") for spec in (own.get(section) or {}).values()}
        for stale in path.parent.glob(f"{path.stem}.own-*.json"):
            if stale.name not in kept and not stale.name.endswith(".meta.json"):
                stale.unlink(missing_ok=True)
                meta_path(stale).unlink(missing_ok=True)
        return out

    @classmethod
    def load(cls, path: str | Path | None = None) -> Ranker:
        """Load a ranker; refuse one written for another feature schema. Without ``path``: the
        user's own (``ttrank adapt``), if it fits this ttrank, else the shipped one."""
        if path is None and locations.user_ranker().exists():
            try:
                return cls.load(locations.user_ranker())
            except RankerError as e:  # e.g. trained before a feature change: the shipped one
                log.warning("%s; using the shipped ranker", e)
        path = Path(path) if path else locations.shipped_ranker()

        def check(meta: dict) -> str | None:
            version = meta.get("feature_version")
            names = meta.get("feature_names") or []
            # the schema grows by appending groups; a ranker reads only its own groups' columns
            if version != FEATURE_VERSION or not names or FEATURE_NAMES[:len(names)] != names:
                return (f"{path} was trained on feature schema v{version}; this ttrank "
                        f"computes v{FEATURE_VERSION}: retrain it (ttrank train)")
            return None

        r = cls._read(path, "ranker", "train one: python train.py, or ttrank train", check)
        r.path = path
        return r


def _fit_ranker(params: dict, X: np.ndarray, y: np.ndarray, groups: np.ndarray) -> Ranker:
    return Ranker(**params).fit(X, y, groups)


def write_booster(path: str | Path, booster, meta: dict) -> dict:
    """Write an XGBoost booster and its ``.meta.json`` sidecar, both atomically. Returns the
    metadata, with the model file's hash that :func:`read_booster` checks. The booster is in
    XGBoost's binary JSON (UBJSON), whatever the file is named: the shipped ranker loads in 0.06 s
    from it against 1.3 s from text JSON, and takes 17 MB instead of 27 (files written as text
    JSON before still load)."""
    raw = bytes(booster.save_raw(raw_format="ubj"))
    atomic_write_bytes(path, raw)
    meta = {**meta, "model_format": "ubj", "model_sha256": hashlib.sha256(raw).hexdigest()}
    atomic_write_json(meta_path(path), meta)
    return meta


def read_booster(path: Path, what: str, hint: str, check) -> tuple[Any, dict]:
    """(booster, metadata) written by :func:`write_booster`. ``check(metadata)`` returns why the
    file does not fit this ttrank (another schema), or None; every refusal is a RankerError."""
    import xgboost as xgb

    mp = meta_path(path)
    if not path.exists() or not mp.exists():
        raise RankerError(f"no {what} at {path} ({hint})")
    try:
        meta = json.loads(mp.read_text())
    except ValueError as e:
        raise RankerError(f"{mp}: corrupt {what} metadata ({e})") from None
    why = check(meta)
    if why:
        raise RankerError(why)
    raw = path.read_bytes()
    if meta.get("model_sha256") and hashlib.sha256(raw).hexdigest() != meta["model_sha256"]:
        raise RankerError(f"{path} does not match its metadata (modified or truncated)")
    try:
        booster = xgb.Booster()
        booster.load_model(bytearray(raw))
    except Exception as e:
        raise RankerError(f"{path}: not a readable XGBoost model ({str(e).splitlines()[0]})") from None
    return booster, meta


def meta_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.stem + ".meta.json")
