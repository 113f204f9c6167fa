"""One-step adaptation to the host CPU (``ttrank adapt``): a bounded, resumable budget spent
where it buys the most on a CPU the shipped data has not seen.

1. **Native tuning** of the kernels `recommend` meets most: every tunable kernel of the zoo's
   networks, weighted by its share of its network's time (each network counts once) and summed
   over the networks that have it. The most share per second of tuning (:func:`trial_seconds`:
   a slow kernel's trials cost more) is tuned first, with ttrank's resumable `tune` into
   the user's donor store (:func:`ttrank.donors.native_dir`), so `recommend` transfers
   them like any other donor, and a rerun continues where the last one stopped.
   Each search starts from what transfer already reaches: the ranker's top :data:`SEEDS`
   donor schedules for the kernel are measured here first (rows of this CPU's tables too) and
   seed its first population (:class:`ttrank.tune.SeededDatabase`). Unseeded, 64 native trials
   lost to the best transferred schedule on 15 of 20 kernels (znver2, CPU held out).
2. **Cross-measurements on this CPU**: `collect` on the same networks, a few candidates per
   kernel, into the user's measurement tables.
3. **Retraining** the ranker on the shipped tables plus this CPU's rows, into the user's ranker
   (:func:`ttrank.locations.user_ranker`), which :meth:`Ranker.load` prefers from then on.
   Once this CPU's tables hold :data:`ttrank.ranker.OWN_MIN_ROWS` rows (over several runs),
   the refit also gives it a ranker of its own rows, which ``recommend`` blends in here.

A kernel's time share comes from its own network's donor run where the store has it (tuned
latency x count), else from its FLOPs at the network's measured rate.

Two plans spend the tuning time (``plan_by``):

- ``kernels`` (the default): the most share per tuning second first, each kernel for itself;
- ``families``: one kernel per transfer family (:func:`transfer_family`: the same anchor op,
  window, stride and output size) before any family's second, the families with the most summed
  share per tuning second first. It is meant for deep searches: a schedule tuned deep on this CPU
  transfers to its family's other kernels (rocketlake: MnasNet's depthwise 3x3 convs went from
  1.37x onnxruntime's time to 0.87x with other networks' 256-trial depthwise donors of that CPU),
  and over the shipped curves 256 trials ran a kernel in 0.70x (convs) and 0.59x (depthwise) of
  its best after 64, where 128 bought 0.89x and 0.92x.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import locations, zoo
from .collect import best_measured, collect, fastest_transferred
from .donors import DonorStore, native_dir, native_sets
from .errors import TTRankError
from .kernels import Kernel, extract, model_kernels
from .measure import Measurer
from .ranker import Ranker
from .target import host_mcpu, provenance, target_key
from .training import default_measurement_dirs, train
from .tune import Seed, count_trials, tune
from .util import atomic_write_json, cache_dir, file_lock

log = logging.getLogger(__name__)

# the CNNs, detectors and segmenters users deploy most; transformers are a few big matmuls
DEFAULT_NETWORKS = ["resnet50", "resnet18", "mobilenetv2", "efficientnetb0", "yolo", "mobilenetv3",
                    "resnext50", "googlenet", "mnasnet1_0", "unet", "dbnet", "deeplabv3", "vgg16",
                    "bert", "vit_tiny"]

# trials per natively tuned kernel. 128 was tried (znver2, 60 min): the packed search sometimes
# finds its fast region after the first batch of 64 (kernel_gap: 3x3 conv 2.65 -> 1.79 ms on znver3),
# but over the 8 kernels that got both batches the second 64 trials bought 1.11x (geometric mean of the
# best-so-far: 1.36x and 1.42x on two, nothing on five) at twice the time a kernel (up to 5 min
# for a 40 ms conv), and ResNet-18's and ResNet-50's kernels were never reached. Depth is for the
# donors tuned once for everyone (bench/tune_donors.py), breadth for the user's hour.
TRIALS = 64
# transferred schedules measured per kernel to seed its native search
SEEDS = 4
PLANS = ("kernels", "families")


def transfer_family(k: Kernel) -> str:
    """The kernels a schedule of ``k`` tuned on this CPU transfers to best: the same anchor op and
    loop nest, and for a convolution the same window and stride, and output rows in the same
    size class (56 and more, 14 to 55, under 14), as tiles that suit 112x112 do not suit 7x7."""
    base = f"{k.anchor_op} {k.iter_kinds}"
    if "conv" not in k.anchor_op or len(k.input_shapes) < 2 or len(k.output_shape) < 4:
        return base
    nhwc = "nhwc" in k.anchor_op.lower()
    h_axis, win = (1, slice(0, 2)) if nhwc else (2, slice(2, 4))  # NHWC/HWIO; NCHW[c]/OIHW[io]
    data, weight, out = k.input_shapes[0], k.input_shapes[1], k.output_shape
    kh, kw = weight[win]
    rows = out[h_axis]
    stride = round(data[h_axis] / rows) if rows else 0
    size = "large" if rows >= 56 else "mid" if rows >= 14 else "small"
    return f"{base} {kh}x{kw} s{stride} {size}"


@dataclass
class PlannedKernel:
    """One workload to tune natively, and why: its summed share of the networks' time."""

    workload_hash: str
    network: str  # the network it is tuned in (where its share is largest)
    task: str  # its task name in that network
    workload_class: str
    share: float  # summed over networks, each network's kernels summing to 1
    networks: list[str] = field(default_factory=list)
    seconds: float = 0.0  # one call's estimated time (its donor run's best, else by FLOPs)
    family: str = ""  # its transfer family (:func:`transfer_family`)

    def gain_per_second(self, trials: int = TRIALS) -> float:
        """Its share per second of tuning it: what the budget buys by tuning this kernel,
        if native tuning speeds every kernel up alike (nothing known says otherwise)."""
        return self.share / (trials * trial_seconds(self.seconds))


def kernel_seconds(kernels: list[Kernel], known_s: dict[str, float]) -> dict[str, float]:
    """Each kernel's time for one call: its known latency (``workload_hash -> s``) where there
    is one, else its FLOPs at the rate the known kernels ran at (kept within what 2 to 64 cores
    reach, so that a known pooling kernel's low rate does not make every conv look slow)."""
    flops = sum(k.flops * k.weight for k in kernels if k.workload_hash in known_s)
    secs = sum(known_s[k.workload_hash] * k.weight for k in kernels if k.workload_hash in known_s)
    rate = min(max(flops / secs, 2e10), 2e12) if flops > 0 and secs > 0 else 1e11  # FLOP/s
    return {k.workload_hash: known_s.get(k.workload_hash, k.flops / rate) for k in kernels}


def time_shares(kernels: list[Kernel], known_s: dict[str, float]) -> dict[str, float]:
    """Each kernel's share of its network's time, from :func:`kernel_seconds`."""
    secs = kernel_seconds(kernels, known_s)
    est = {k.workload_hash: k.weight * secs[k.workload_hash] for k in kernels}
    total = sum(est.values()) or 1.0
    return {h: t / total for h, t in est.items()}


def plan(networks: list[str], target, store: DonorStore,
         kernels_of: Callable[[str], list[Kernel]] | None = None,
         layout: str = "nchw") -> list[PlannedKernel]:
    """The tunable kernels of ``networks`` (their convs in ``layout``), the most share per
    second of tuning first (:meth:`PlannedKernel.gain_per_second`)."""
    kernels_of = kernels_of or (lambda net: [
        k for k in extract(zoo.load(f"zoo:{net}", layout=layout, target=target).mod, target)
        if k.tunable])
    best: dict[tuple[str, str], float] = {}  # (network, workload) -> its donor run's best
    for w in store.workloads:
        if w.records:
            best[(w.network, w.kernel.workload_hash)] = w.best_s
    out: dict[str, PlannedKernel] = {}
    top: dict[str, float] = {}  # the largest single-network share of each workload
    for net in networks:
        ks = kernels_of(net)
        known = {k.workload_hash: best[(net, k.workload_hash)] for k in ks if (net, k.workload_hash) in best}
        shares, secs = time_shares(ks, known), kernel_seconds(ks, known)
        for k in ks:
            s = shares[k.workload_hash]
            p = out.setdefault(k.workload_hash, PlannedKernel(k.workload_hash, net, k.name,
                                                              k.workload_class, 0.0,
                                                              family=transfer_family(k)))
            p.share += s
            if net not in p.networks:
                p.networks.append(net)
            if s > top.get(k.workload_hash, -1.0):
                top[k.workload_hash] = s
                p.network, p.task, p.seconds = net, k.name, secs[k.workload_hash]
    return sorted(out.values(), key=lambda p: -p.gain_per_second())


# Seconds a native tuning trial costs on 2 cores, building and running the candidate: a least-
# squares fit (median error 32%) over the 229 tasks of 32 to 256 trials in the two-thread donor
# sets tuned on znver1 to znver5, NCHW and packed (datasets/donors/*@*-t2-*/trials.jsonl): 0.4 s
# a trial for a 0.2 ms matmul, 3.2 s for a 42 ms conv, whose candidates' median runs 5-8x its best.
TRIAL_BUILD_S = 0.9
TRIAL_RUN_PER_KERNEL_S = 30.0


def trial_seconds(kernel_s: float) -> float:
    """Seconds one tuning trial of a kernel that runs in ``kernel_s`` at best costs."""
    return TRIAL_BUILD_S + TRIAL_RUN_PER_KERNEL_S * kernel_s


def by_family(todo: list[PlannedKernel], trials: int) -> list[PlannedKernel]:
    """``todo`` in rounds: every family's kernel with the most share per tuning second, then every
    family's second, ...; in a round, the families whose summed share buys the most per second of
    tuning that kernel first."""
    members: dict[str, list[PlannedKernel]] = {}
    for p in todo:
        members.setdefault(p.family, []).append(p)
    ranked = []
    for ps in members.values():
        share = sum(p.share for p in ps)
        ps.sort(key=lambda p: -p.gain_per_second(trials))
        ranked += [(j, -share / (trials * trial_seconds(p.seconds)), p) for j, p in enumerate(ps)]
    return [p for _, _, p in sorted(ranked, key=lambda t: t[:2])]


def tuning_batch(todo: list[PlannedKernel], budget_s: float, trials: int,
                 plan_by: str = "kernels") -> list[tuple[str, list[str]]]:
    """The kernels of ``todo`` that ``budget_s`` can tune, in ``plan_by``'s order (the most share
    per tuning second first, or :func:`by_family`; at least one), as (network, its tasks) in the
    order of each network's first kernel: the budget goes where it buys the most across the zoo,
    not to every kernel of the first networks, nor to a few slow convs a cheap matmul's worth of
    share could have bought."""
    out: dict[str, list[str]] = {}
    spent = 0.0
    order = by_family(todo, trials) if plan_by == "families" else sorted(
        todo, key=lambda p: -p.gain_per_second(trials))
    for p in order:
        cost = trials * trial_seconds(p.seconds)
        if out and spent + cost > budget_s:
            continue  # a cheaper kernel further down may still fit
        spent += cost
        out.setdefault(p.network, []).append(p.task)
    return list(out.items())


def state_path(target, layout: str = "nchw") -> Path:
    name = target_key(target).replace("/", "_") + ("" if layout == "nchw" else f"@{layout}")
    return cache_dir() / "adapt" / f"{name}.json"


@dataclass
class AdaptReport:
    """What one `adapt` run did (also written to :func:`state_path`)."""

    mcpu: str
    budget_s: float
    planned: int = 0
    tuned_kernels: int = 0
    tuned_trials: int = 0
    tune_seconds: float = 0.0
    seeds_measured: int = 0  # part of tuning: the transferred schedules measured to seed it
    seed_seconds: float = 0.0
    collected: int = 0
    collect_seconds: float = 0.0
    train_seconds: float = 0.0
    ranker: str | None = None
    seconds: float = 0.0
    complete: bool = False
    networks_tuned: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    # per kernel tuned: network, task, family, trials, native_s (the search's best) and
    # transferred_s (the fastest donor schedule measured here for it): what the tuning bought
    tuned: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def native_vs_transferred(self) -> tuple[int, int, float] | None:
        """(kernels whose native best beat the fastest transferred schedule measured here, kernels
        with both, the geometric mean of native / transferred), or None with none to compare."""
        pairs = [(t["native_s"], t["transferred_s"]) for t in self.tuned
                 if t.get("native_s") and t.get("transferred_s")]
        if not pairs:
            return None
        ratio = math.exp(sum(math.log(n / t) for n, t in pairs) / len(pairs))
        return sum(n < t for n, t in pairs), len(pairs), ratio


def adapt(target, budget_s: float, networks: list[str] | None = None, trials: int = TRIALS,
          tune_share: float = 0.6, train_reserve: float = 0.03, max_per_kernel: int = 6,
          min_share: float = 0.01, retrain: bool = True, donor_dirs: list[Path] | None = None,
          measurement_dirs: list[Path] | None = None,
          on_note: Callable[[str], None] | None = None, layout: str = "nchwc",
          seeds: int = SEEDS, plan_by: str = "kernels") -> AdaptReport:
    """Spend ``budget_s`` on this CPU: native tuning (``tune_share`` of it), cross-measurements
    (the rest, less ``train_reserve`` kept for retraining: the refit took 6-9 s in each of five
    host runs, 22 s with the deeper trees of 2026-12-07 on 22,669 rows, and a reserve of 10% left
    5 of the 60 minutes unused), then retrain the ranker.

    Kernels whose summed share is under ``min_share`` are left to transfer. Resumable: tuned
    trials and measured rows are kept, so a rerun spends its budget on what is left.
    ``donor_dirs`` (default: the store's) and ``measurement_dirs`` (default: the shipped tables
    and the user's) are what the plan weighs and the ranker learns from; this CPU's new rows
    always go to the user's tables. ``layout``: the zoo networks' conv layout, for tuning and
    measuring (nchwc, the default: packed convs, as `recommend --layout auto` packs a CNN).
    ``seeds``: transferred schedules measured per kernel to seed its search (0: unseeded).
    ``plan_by``: which kernels the tuning time goes to first (:data:`PLANS`; module docstring).
    """
    note = on_note or (lambda line: None)
    t0 = time.time()
    deadline = t0 + budget_s
    networks = networks or DEFAULT_NETWORKS
    for n in networks:
        zoo.get(n)  # an unknown name is one clear error before any work
    if plan_by not in PLANS:
        raise TTRankError(f"unknown plan {plan_by!r}: one of {', '.join(PLANS)}")
    mcpu = str(target.attrs.get("mcpu") or host_mcpu())
    rep = AdaptReport(mcpu, budget_s, provenance=provenance(target))

    def load(net: str):
        return zoo.load(f"zoo:{net}", layout=layout, target=target)

    if (before := adapted(target, layout)):
        note(f"continuing the adaptation of {before.get('mcpu', mcpu)} ({before.get('runs', 0)} run(s) "
             f"finished so far, {before.get('tuned_kernels', 0)}/{len(before.get('plan') or [])} "
             "kernels tuned)")
    with file_lock(state_path(target, layout)):  # one adaptation of a CPU at a time
        store = DonorStore.load(donor_dirs)
        previous = adapted(target, layout) or {}
        asked = {"networks": list(networks), "min_share": min_share, "layout": layout}
        if plan_by != "kernels":  # its kernels carry their families (a plan kept before they did has none)
            asked["plan_by"] = plan_by
        if previous.get("plan_for") == asked and previous.get("plan"):
            # a rerun continues the same plan: extracting 15 networks' kernels again costs minutes
            todo = [PlannedKernel(**p) for p in previous["plan"]]
        else:
            todo = [p for p in plan(networks, target, store, layout=layout) if p.share >= min_share]
            if not todo:
                raise TTRankError(f"none of {', '.join(networks)} has a kernel to tune")
            # kept before any work, so that a run killed while tuning resumes this plan
            atomic_write_json(state_path(target, layout), {**previous, "mcpu": mcpu, "plan_for": asked,
                                                   "plan": [asdict(p) for p in todo]})
        rep.planned = len(todo)
        note(f"{len(todo)} kernels carry at least {min_share:.0%} of a zoo network's time on "
             f"{len(networks)} networks; tuning natively ({trials} trials each) those that buy "
             "the most share per tuning second" + (
                 f", one of each of their {len({p.family for p in todo})} transfer families first"
                 if plan_by == "families" else ""))

        # 1. native tuning: the most share per tuning second first, as many as the time left reaches, grouped
        # by network (one tune per network and batch); then the next batch
        tune_end = t0 + tune_share * budget_s
        tuned = _tuned(todo, mcpu, layout, trials)
        left_plan = [p for p in todo if (p.network, p.task) not in tuned]
        out = cache_dir() / "data" / "measurements"
        measurer = Measurer(target)
        ranker = Ranker.load()
        try:
            while left_plan and (left := tune_end - time.time()) >= 30:
                batch = tuning_batch(left_plan, left, trials, plan_by)
                for net, tasks in batch:
                    left = tune_end - time.time()
                    if left < 30:
                        break
                    model = load(net)
                    t_seed = time.time()
                    planned = [p for p in todo if p.network == net and p.task in tasks]
                    found, measured = (measure_seeds(net, model, planned, store, ranker, out, target, measurer,
                                                     budget_s=left / 4, n=seeds) if seeds else ({}, 0))
                    rep.seeds_measured += measured
                    rep.seed_seconds = round(rep.seed_seconds + time.time() - t_seed, 1)
                    left = tune_end - time.time()
                    run = tune(model.mod, native_dir(net, mcpu, layout), trials_per_task=trials,
                               budget_minutes=left / 60, target=target, model_name=net, only=tasks,
                               layout=layout, seeds=found)
                    done = sum(tp.done for tp in run.tasks)
                    rep.tuned_trials += done
                    by_task = {p.task: p for p in planned}
                    transferred = fastest_transferred(net, {p.workload_hash for p in planned}, out, target)
                    rep.tuned += [{"network": net, "task": tp.name, "family": by_task[tp.name].family,
                                   "trials": tp.done, "native_s": tp.best_s,
                                   "transferred_s": transferred.get(by_task[tp.name].workload_hash)}
                                  for tp in run.tasks if tp.name in by_task]
                    if net not in rep.networks_tuned:
                        rep.networks_tuned.append(net)
                    note(f"{net}: {len(tasks)} kernels, {done} trials on this CPU "
                         f"(from {sum(map(len, found.values()))} seeds)")
                batched = {(net, t) for net, tasks in batch for t in tasks}
                left_plan = [p for p in left_plan if (p.network, p.task) not in batched]
            rep.tuned_kernels = len(_tuned(todo, mcpu, layout, trials))
            rep.tune_seconds = round(time.time() - t0, 1)

            # 2. cross-measurements on this CPU, split evenly over the networks
            t1 = time.time()
            collect_end = deadline - train_reserve * budget_s
            native = [d for d in (native_dir(n, mcpu, layout) for n in networks) if d.exists()]
            store = DonorStore.load(None if donor_dirs is None else [*donor_dirs, *native])  # + native
            for i, net in enumerate(networks):
                left = (collect_end - time.time()) / (len(networks) - i)
                if left < 20:
                    continue
                st = collect(net, load(net), store, out, target, measurer,
                             max_per_kernel=max_per_kernel, budget_s=left)
                rep.collected += st.measured
                note(f"{net}: {st.measured} candidates measured ({st.valid} valid)")
        finally:
            measurer.close()
        rep.collect_seconds = round(time.time() - t1, 1)

        # 3. the ranker learns this CPU's rows beside the shipped ones
        if retrain and rep.collected:
            t2 = time.time()
            dirs = default_measurement_dirs() if measurement_dirs is None else [*measurement_dirs, out]
            # the current ranker's settings, refitted: choosing them again takes a quarter of an
            # hour on 2 cores, far more than the budget's reserve
            res = train(list(dict.fromkeys(dirs)), store=store, out=locations.user_ranker(),
                        like=Ranker.load())
            rep.ranker = str(res["model"])
            rep.train_seconds = round(time.time() - t2, 1)
            note(f"ranker retrained on {res['rows']} candidates ({len(res['networks'])} networks) "
                 f"in {rep.train_seconds:.0f} s: {rep.ranker}")
        rep.seconds = round(time.time() - t0, 1)
        rep.complete = rep.tuned_kernels >= rep.planned
        atomic_write_json(state_path(target, layout), {**rep.to_json(), "runs": previous.get("runs", 0) + 1,
                                               "plan_for": asked, "plan": [asdict(p) for p in todo]})
    return rep


def measure_seeds(net: str, model, planned: list[PlannedKernel], store: DonorStore, ranker: Ranker, out: Path,
                  target, measurer: Measurer, budget_s: float, n: int = SEEDS
                  ) -> tuple[dict[str, list[Seed]], int]:
    """The seeds of ``planned`` kernels' searches (workload hash -> fastest first), and how many
    candidates were measured for them: the ranker's top ``n`` donor schedules of each, any
    network's (a kernel's own network's, tuned on another CPU, is the likeliest good start),
    measured into ``out`` unless this CPU has them already; the fastest of those that can seed
    a search (:attr:`ttrank.transfer.Transferred.seedable`) do."""
    only = {p.workload_hash for p in planned}
    st = collect(net, model, store, out, target, measurer, max_per_kernel=n, budget_s=budget_s,
                 exclude_self=False, ranker=ranker, only=only)
    kernels = [k for k in model_kernels(model, target) if k.workload_hash in only]  # collect's, cached
    best = best_measured(net, kernels, store, out, target, n, keep=lambda c: c.seedable)
    return {h: [Seed(h, c.trace, lat) for c, lat in picks] for h, picks in best.items()}, st.measured


def _tuned(todo: list[PlannedKernel], mcpu: str, layout: str, trials: int) -> set[tuple[str, str]]:
    """The planned kernels, as (network, task), that have their trials on this CPU (or whose
    search space MetaSchedule exhausted), in the user's native tuning or in a shipped donor set
    of this CPU: what an earlier adaptation published is not tuned again."""
    done: set[tuple[str, str]] = set()
    for net in {p.network for p in todo}:
        for d in native_sets(net, mcpu, layout):
            done |= {(net, task) for task, t in count_trials(d).items()
                     if t["complete"] or t["done"] >= trials}
    return {(p.network, p.task) for p in todo if (p.network, p.task) in done}


def adapted(target, layout: str = "nchw") -> dict | None:
    """The last adaptation's report for ``target``'s CPU (and conv layout), or None (never
    adapted, or unreadable)."""
    try:
        return json.loads(state_path(target, layout).read_text())
    except (OSError, ValueError):
        return None
