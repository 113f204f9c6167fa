"""Ranking: score every compatible donor schedule of a kernel, optionally reorder the top by the
second stage (the program cost model of :mod:`ttrank.programs`), decide how many candidates to
measure (:class:`FixedK`, :class:`AdaptiveK`) and pick the shortlist. Nothing here measures."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .donors import DonorRecord, DonorStore, DonorWorkload
from .features import FEATURE_NAMES
from .kernels import Kernel
from .programs import WIDTH, CostModel, Featurizer, blend, cost_model_without, default_cost_model
from .ranker import Ranker
from .target import vector_class
from .transfer import Transferred, transfer

# seconds one kernel's second stage, and then its picks, may each spend transferring. A conv's 20
# transfers take 2-6 s; a fused element-wise kernel of a few dozen blocks (an unrolled LSTM's
# first step) took 7 s for each (MetaSchedule's anchor-trace replay), most of them rejected or
# the same program: 130-160 s for one kernel holding 0.4% of the model
RERANK_BUDGET_S = 10.0


@dataclass
class Candidate:
    """A donor record ranked for a target kernel: its scores and features, nothing applied."""

    kernel: Kernel
    donor: DonorWorkload
    record: DonorRecord
    score: float  # the ranker's
    row: np.ndarray | None = field(default=None, repr=False)  # its features, as the ranker read them
    cost_score: float | None = None  # the program cost model's (second stage, shortlist only)
    cost_scored: bool = False  # the second stage scored it (cost_score None: its transfer failed)

    @property
    def features(self) -> dict[str, float] | None:
        """The ranker's features of the pair, by name."""
        return None if self.row is None else dict(zip(FEATURE_NAMES, map(float, self.row)))


@dataclass
class SecondStage:
    """The ranker's second stage: the top ``shortlist`` candidates are transferred, their
    programs scored by ``cost_model``, and reordered by ``weight`` x ranker + the rest x cost.
    ``shortlist`` 0: the donors keep the ranker's order, and the cost model orders only what has
    no ranker score (a small design space's draws)."""

    weight: float
    shortlist: int
    cost_model: CostModel
    featurizer: Featurizer

    @classmethod
    def of(cls, ranker: Ranker, store: DonorStore, target,
           exclude_networks=frozenset()) -> SecondStage | None:
        """The stage the ranker's evaluation chose (shortlist 0 where it reorders no donors),
        None without a cost model. Leave-one-out runs get a cost model that never saw the
        excluded networks' tuning logs."""
        st = ranker.metadata.get("stage2") or {}
        if not st.get("cost_model"):
            return None
        # a network the store does not hold (a user's model under --leave-one-out) changes
        # nothing: the shipped model, not a minute's refit
        exclude_networks = set(exclude_networks) & set(store.networks)
        if exclude_networks:
            cm = cost_model_without(exclude_networks, [Path(r.work_dir) for r in store.reports], target)
        else:
            path = Path(ranker.path).with_name(st["cost_model"]) if ranker.path else default_cost_model()
            cm = CostModel.load(path)
        return cls(float(st["weight"]), int(st["shortlist"]) if st.get("enabled") else 0, cm, Featurizer(target))


def rank_kernel(kernel: Kernel, store: DonorStore, ranker: Ranker,
                exclude_networks=frozenset(), cpu: dict | None = None) -> list[Candidate]:
    """Every compatible donor schedule for ``kernel``, scored and sorted best first, for the
    CPU ``cpu`` describes (:func:`ttrank.target.cpu_description`; None: unknown). Records of
    this very kernel (or its anchor op) tuned on that CPU with its threads (:func:`tuned_here`)
    lead, the kernel's own first, fastest first. A CPU with an own ranker (:meth:`Ranker.fit_own`)
    gets it blended in."""
    pairs = store.compatible(kernel, set(exclude_networks))
    if not pairs:
        return []
    rows = store.pair_rows(kernel, pairs, cpu)
    scores = ranker.predict(rows, (cpu or {}).get("mcpu"))  # with the CPU's own ranker, if it has one
    cands = [Candidate(kernel, w, r, float(s), x) for (w, r), s, x in zip(pairs, scores, rows)]
    cands.sort(key=lambda c: -c.score)
    # a donor that tuned this very kernel (or its anchor op, under another epilogue) on this CPU
    # with these threads has measured it here: that outranks any prediction. ResNet-50's
    # 200-trial run holds ResNet-18's stride-1 512x7x7 conv; the ranker put three records of the
    # stride-2 conv of the same extents first, which ran 4.2 ms on it against 1.9-2.1 ms for
    # the records of the same conv, with or without the residual add
    here = sorted((c for c in cands if tuned_here(c, kernel, cpu)),
                  key=lambda c: (c.donor.kernel.workload_hash != kernel.workload_hash, c.record.latency_s))
    first = here[:MEASURED_HERE_FIRST]
    return first + [c for c in cands if not any(c is f for f in first)]


MEASURED_HERE_FIRST = 2  # such records go first (more would crowd out the ranker's other picks)


def same_anchor(a: Kernel, b: Kernel) -> bool:
    """The same anchor computation (op, loop extents, attributes such as the stride, and data
    input), whatever the epilogue fused after it."""
    return (a.anchor_op == b.anchor_op and a.extents == b.extents and a.attrs == b.attrs
            and a.input_shapes[:1] == b.input_shapes[:1])


def tuned_here(c: Candidate, kernel: Kernel, cpu: dict | None) -> bool:
    """Whether ``c``'s donor is ``kernel`` itself (the same workload) or its anchor computation
    (:func:`same_anchor`), tuned on the CPU ``cpu`` describes with its runtime threads (donor
    sets from before threads were recorded used one)."""
    if not cpu or not cpu.get("mcpu") or not math.isfinite(c.record.latency_s):
        return False
    if c.donor.kernel.workload_hash != kernel.workload_hash and not same_anchor(c.donor.kernel, kernel):
        return False
    prov = c.record.provenance or {}
    threads = cpu.get("threads")
    return prov.get("mcpu") == cpu["mcpu"] and (threads is None or prov.get("threads", 1) == threads)


def rerank(kernel: Kernel, cands: list[Candidate], stage: SecondStage, target,
           budget_s: float = RERANK_BUDGET_S) -> tuple[list[Candidate], dict[str, Transferred]]:
    """Transfer the shortlist onto ``kernel``, score the programs with the cost model and
    reorder the shortlist by the blend. Returns (candidates, transferred by record id).
    Once ``budget_s`` is spent (after two transfers), the shortlist ends where it got to: the
    rest keep the ranker's order, behind it. A candidate an earlier call scored (a second
    shortlist of the kernel) keeps its score and is not transferred again."""
    short = cands[:stage.shortlist]
    if len(short) < 2:
        return cands, {}
    done: dict[str, Transferred] = {}
    t0 = time.time()
    new, vecs = [], []
    for c in short:
        if c.cost_scored:  # an earlier shortlist of this kernel scored it
            continue
        if len(done) >= 2 and time.time() - t0 > budget_s:
            break
        t = done[c.record.id] = transfer(c.record, kernel, c.donor, target)
        new.append(c)
        vecs.append(stage.featurizer.of_module(t.mod) if t.ok else np.full(WIDTH, np.nan, dtype=np.float32))
    if new:
        X = np.stack(vecs)
        for c, v, bad in zip(new, stage.cost_model.predict(X), np.isnan(X).any(axis=1)):
            c.cost_score, c.cost_scored = (None if bad else float(v)), True
    short = [c for c in short if c.cost_scored]
    cost = np.array([np.nan if c.cost_score is None else c.cost_score for c in short], dtype=np.float64)
    rest = [c for c in cands if not any(c is x for x in short)]
    order = np.argsort(-blend(np.array([c.score for c in short]), cost, stage.weight), kind="stable")
    return [short[i] for i in order] + rest, done


@dataclass
class Pick:
    """A shortlisted candidate: transferred onto the kernel, or already measured (``row``, a
    line of the measurement table from an earlier run; then not transferred here). A schedule
    picked otherwise than by ranking (a benchmark's baseline) has no ``candidate``."""

    candidate: Candidate | None
    transferred: Transferred | None = None
    row: dict | None = None
    same_program: list[str] = field(default_factory=list)  # later candidates' record ids whose
    # transfer gave this very program: measured once, as this pick
    beside: bool = False  # measured besides the ranker's k (shortlist's ``also``)


def native_candidate(cands: list[Candidate], mcpu: str | None, triple: str = "") -> Candidate | None:
    """The best-ranked candidate tuned on this very CPU (``mcpu``); failing that, the
    best-ranked one tuned on a CPU of its vector class (:func:`ttrank.target.vector_class`): on
    an AVX2 CPU, schedules tuned on another AVX2 CPU, which a ranker that learned on AVX-512
    CPUs' rows may rank low."""
    if not mcpu:
        return None
    here = next((c for c in cands if (c.record.provenance or {}).get("mcpu") == mcpu), None)
    mine = vector_class(mcpu, triple)
    if here is not None or mine is None:
        return here
    return next((c for c in cands if vector_class((c.record.provenance or {}).get("mcpu") or "") == mine), None)


def shortlist(kernel: Kernel, cands: list[Candidate], k: int, target, stage: SecondStage | None = None,
              known: Callable[[Candidate], dict | None] | None = None,
              rejected: list | None = None, also: Sequence[Candidate] = (),
              budget_s: float = RERANK_BUDGET_S, taken: Sequence[Pick] = ()) -> list[Pick]:
    """The first ``k`` candidates, in rank order (reordered by ``stage`` if given), that apply to
    ``kernel``: transfers go in rank order until ``k`` succeed (a rejection costs little).
    A candidate whose transfer gives the same program as an earlier pick (structural hash) is
    noted on that pick (``same_program``) and the next one is taken: one program, one build and
    one measurement. ``known(candidate)`` returns the measurement row of a candidate measured
    before (it counts, and is not transferred again); ``rejected`` collects (record id, reason)
    of failed transfers (and those in it are not tried again). ``also``: candidates measured
    besides the ``k`` when they miss them (:func:`native_candidate`). Transfers stop once ``budget_s`` is spent (after two), as in
    :func:`rerank`: where each costs seconds, failing or repeating a program, going down a long
    list cost minutes. ``taken``: picks made before (a first shortlist's); the next ``k`` after
    them are returned, their candidates not transferred again and their programs not repeated."""
    pre: dict[str, Transferred] = {}
    if stage is not None:
        cands, pre = rerank(kernel, cands, stage, target, budget_s)
    picks: list[Pick] = []
    programs: dict[str, Pick] = {  # program hash -> the pick that measures it
        p.transferred.program_hash(): p for p in taken if p.transferred is not None}
    skip = {i for p in taken if p.candidate is not None for i in (p.candidate.record.id, *p.same_program)}
    skip |= {rid for rid, _ in rejected or ()}  # a transfer that failed fails again
    t0, tried = time.time(), 0
    for c in cands:
        if c.record.id in skip:
            continue
        if len(picks) >= k or (tried >= 2 and time.time() - t0 > budget_s):
            break
        row = known(c) if known is not None else None
        if row is not None:
            picks.append(Pick(c, row=row))
            continue
        t = pre.get(c.record.id)
        if t is None:
            t, tried = transfer(c.record, kernel, c.donor, target), tried + 1
        if not t.ok:
            if rejected is not None:
                rejected.append((c.record.id, t.reason))
            continue
        h = t.program_hash()
        if h in programs:
            programs[h].same_program.append(c.record.id)
            continue
        picks.append(programs.setdefault(h, Pick(c, t)))
    for a in also:
        if all(p.candidate is not a and a.record.id not in p.same_program for p in picks):
            extra = shortlist(kernel, [a], 1, target, None, known, rejected)
            h = extra[0].transferred.program_hash() if extra and extra[0].transferred else None
            if h is not None and h in programs:  # the same program as a pick: measured once
                programs[h].same_program.append(a.record.id)
                continue
            for p in extra:
                p.beside = True
                if p.transferred is not None:
                    programs[p.transferred.program_hash()] = p
            picks += extra
    return picks


# --------------------------------------------------------------------------------------------
# How many candidates to measure per kernel


class FixedK:
    """``k`` candidates per kernel, 1 for kernels under ``minor_share`` of the untuned model time
    (more could not move the model's latency by more than a fraction of that share)."""

    def __init__(self, k: int, minor_share: float = 0.002):
        self.max_k = int(k)
        self.minor_share = float(minor_share)

    def bound(self, share: float) -> int:
        """The most this policy measures for a kernel with this share of the model."""
        return self.max_k if share >= self.minor_share else 1

    def k(self, scores: Sequence[float], share: float) -> int:
        """Candidates to measure, given the ranker's scores (best first) and the kernel's share."""
        return min(self.bound(share), max(1, len(scores)))

    def to_json(self) -> dict:
        return {"policy": type(self).__name__, "max_k": self.max_k, "minor_share": self.minor_share}


class AdaptiveK(FixedK):
    """Measure what is uncertain: the candidates the ranker cannot tell from its top-1 (score
    within ``gap`` of it; the scores estimate throughput relative to the best, so 0.05 is "about
    5% slower"), at most ``max_k``; a kernel under ``full_share`` of the model gets
    proportionally fewer, and one under ``minor_share`` only its top-1.

    ``gap`` and ``full_share`` were calibrated on the shipped ranker's leave-one-network-out
    scores (:func:`ttrank.evaluate.policy_curve`, ``bench/policy_curve.py``): at ``max_k`` 5
    the policy keeps a fixed top-5's quality (0.943 against 0.944) with 13% fewer candidates.
    The ranker's score gap is a weak confidence signal (its scores regress relative
    throughput); most of the saving comes from the share."""

    def __init__(self, max_k: int = 5, gap: float = 0.4, full_share: float = 0.01,
                 minor_share: float = 0.002):
        super().__init__(max_k, minor_share)
        self.gap = float(gap)
        self.full_share = float(full_share)

    def k(self, scores: Sequence[float], share: float) -> int:
        if not len(scores) or share < self.minor_share:
            return 1
        top = float(scores[0])
        contenders = sum(1 for s in scores[:self.max_k] if top - float(s) <= self.gap)
        # a kernel's latency matters in proportion to its share: a small one gets fewer tries
        cap = self.max_k if share >= self.full_share else math.ceil(self.max_k * share / self.full_share - 1e-9)
        return max(1, min(contenders, cap, self.max_k))

    def to_json(self) -> dict:
        return {**super().to_json(), "gap": self.gap, "full_share": self.full_share}


MeasurePolicy = FixedK  # the interface: bound(share), k(scores, share), to_json()


def policy_of(ranker: Ranker, top_k: int | None = None, minor_share: float = 0.002,
              adaptive: bool = True) -> FixedK:
    """The measuring policy for ``ranker``: adaptive up to ``top_k`` (default: the k its
    evaluation chose), with the parameters its calibration stored if any; ``adaptive=False``
    measures ``top_k`` everywhere (as before the policy existed)."""
    max_k = int(top_k or ranker.metadata.get("top_k") or 3)
    if not adaptive:
        return FixedK(max_k, minor_share)
    cal = ranker.metadata.get("policy") or {}
    return AdaptiveK(max_k, minor_share=minor_share,
                     **{k: float(cal[k]) for k in ("gap", "full_share") if k in cal})
