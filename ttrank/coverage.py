"""Coverage: which kernels of a model the donor store has schedules for, and where the time
left without one goes (what ``recommend`` then tunes itself)."""

from __future__ import annotations

from dataclasses import dataclass

from .donors import DonorStore
from .errors import ModelLoadError
from .frontend import LoadedModel
from .kernels import Kernel, model_kernels
from .layouts import PACKED_CONV, PACKED_DEPTHWISE, count_unpacked_convs


@dataclass
class CoverageRow:
    """One kernel: how many donor schedules can be transferred onto it."""

    name: str
    workload_class: str
    weight: int
    flops: float
    candidates: int
    donor_networks: list[str]
    flop_share: float  # of the model's FLOPs (weight included)

    @property
    def covered(self) -> bool:
        return self.candidates > 0

    def to_json(self) -> dict:
        return dict(self.__dict__, covered=self.covered)


def coverage(kernels: list[Kernel], store: DonorStore,
             exclude_networks: set[str] | frozenset = frozenset()) -> list[CoverageRow]:
    """Per kernel, the compatible donor schedules, before anything is measured."""
    total = sum(k.flops * k.weight for k in kernels) or 1.0
    rows = []
    for k in kernels:
        pairs = store.compatible(k, set(exclude_networks))
        rows.append(CoverageRow(k.name, k.workload_class, k.weight, k.flops, len(pairs),
                                sorted({w.network for w, _ in pairs}),
                                k.flops * k.weight / total))
    return rows


@dataclass
class TuningPlan:
    """Kernels ``recommend`` tunes itself in one search, and the share of the budget it gets:
    ``kernel``, the largest, and ``siblings``, the model's other uncovered kernels of its
    workload class (GroupNorm's statistics at each resolution of a U-Net), whose searches
    share that budget."""

    kernel: Kernel
    share: float  # of the model's estimated time once the chosen schedules are in
    seconds: float
    trials: int  # per kernel
    siblings: tuple[Kernel, ...] = ()

    @property
    def kernels(self) -> list[Kernel]:
        return [self.kernel, *self.siblings]


def choose_layout(model: LoadedModel, store: DonorStore, target,
                  exclude_networks: set[str] | frozenset = frozenset(),
                  max_unpacked: float = 0.1) -> tuple[LoadedModel, str]:
    """``--layout auto``: ``model`` (as imported, NCHW) with packed convs (nchwc) when the store
    has packed schedules for every packed conv it then has, and the convs the packing cannot
    reach hold at most ``max_unpacked`` of the conv FLOPs; with its dense convs packed and its
    depthwise ones NCHW (nchwc-dense) when only the packed depthwise convs lack packed donors;
    else as it is; and why, in a few words.

    Packed convs are other kernels than NCHW ones: a packed conv no donor covers would be left
    at TVM's default schedule (or tuned from scratch), where NCHW donors cover it as imported.
    On znver5, schedules transferred from the packed ResNet-18 set took ResNet-50 from 1.93x to
    1.32x onnxruntime's latency and VGG16 from 1.64x to 1.11x (bench/results/recommend_zoo.md).
    """
    convs = count_unpacked_convs(model.mod)
    if not convs:  # a transformer, say: nothing to pack, and no second extraction
        return model, "no conv to pack"
    packed_donors = [w for w in store.workloads
                     if PACKED_CONV in w.kernel.anchor_op and w.network not in exclude_networks]
    if not packed_donors:
        return model, "no packed-conv donors in the store"
    packed_model, bare, why = _packed(model, "nchwc", store, target, exclude_networks, max_unpacked)
    if bare and all(PACKED_DEPTHWISE in k.anchor_op for k in bare):
        # depthwise convs are a small part of the work, and NCHW donors cover them: the dense
        # convs packed, the depthwise ones as imported, beat all of them NCHW (see LAYOUTS)
        dense, dense_bare, dense_why = _packed(model, "nchwc-dense", store, target, exclude_networks,
                                               max_unpacked)
        if dense is not None and not dense_bare:
            return dense, f"{dense_why}; its {len(bare)} depthwise convs, with no packed donor, stay NCHW"
    return (packed_model, why) if packed_model is not None and not bare else (model, why)


def _packed(model: LoadedModel, layout: str, store: DonorStore, target, exclude_networks,
            max_unpacked: float) -> tuple[LoadedModel | None, list[Kernel], str]:
    """``model`` in a packed ``layout``, its packed kernels without a donor, and a few words on
    it; None when the packing cannot rewrite it, or leaves over ``max_unpacked`` of the conv
    FLOPs unpacked."""
    convs = count_unpacked_convs(model.mod)
    try:
        packed_model = model.in_layout(layout, target)
    except ModelLoadError as e:  # the packing pass cannot rewrite this graph: as exported
        return None, [], f"its convs cannot be packed ({e})"
    left = count_unpacked_convs(packed_model.mod)
    kernels = model_kernels(packed_model, target)  # cached: recommend extracts them once
    # each conv left unpacked sits between transforms of its data to and from NCHW; what they
    # cost follows the work left there. ResNeXt-50, with 7 of its 53 convs (the small-group 3x3s,
    # 2% of the conv FLOPs) left unpacked, ran 51.6 ms packed against 69.5 ms NCHW
    # (onnxruntime 48.9 ms, timed side by side on znver4)
    conv_flops = sum(k.flops * k.weight for k in kernels if "conv" in k.anchor_op)
    unpacked = sum(k.flops * k.weight for k in kernels
                   if "conv" in k.anchor_op and PACKED_CONV not in k.anchor_op)
    if left and unpacked > max_unpacked * conv_flops:
        return None, [], (f"{left} of its {convs} convs (grouped, transposed, 1-D), "
                          f"{unpacked / max(conv_flops, 1.0):.0%} of the conv FLOPs, have no packed form")
    packed = [k for k in kernels if PACKED_CONV in k.anchor_op]
    if not packed:
        return None, [], "no conv to pack"
    bare = [k for k in packed if not store.compatible(k, set(exclude_networks))]
    if bare:
        return packed_model, bare, f"no packed donor for {len(bare)} of its {len(packed)} packed convs"
    return packed_model, [], f"packed donors cover all {len(packed)} packed convs"


def plan_missing(kernels: list[Kernel], best_s: dict[str, float | None], covered: set[str],
                 budget_s: float, min_share: float = 0.01, max_trials: int = 64,
                 min_seconds: float = 20.0, full_share: float = 0.5) -> list[TuningPlan]:
    """Which kernels without a good schedule to tune natively, and for how long.

    ``best_s``: each kernel's latency with what was chosen for it (untuned if nothing was);
    ``covered``: the kernels that got a transferred schedule. The kernels left at their default
    schedule are tuned by workload class, one search per class whose share of the estimated
    model time is at least ``min_share``. What they may spend scales with what they can save:
    all of ``budget_s`` once they hold ``full_share`` of the model or more, a proportional part
    below that, split among the classes by share (the largest first, at least ``min_seconds``
    each), and a class's trials among its kernels. A kernel with no arithmetic (copies,
    resizes) needs few trials: its search space is small.
    """
    est = {k.name: k.weight * (best_s.get(k.name) or 0.0) for k in kernels}
    total = sum(est.values())
    if budget_s <= 0 or total <= 0:
        return []
    # kernels of one workload class search together: one of them alone may be under
    # min_share, or get too little time, while the class holds much of the model
    groups: dict[str, list[Kernel]] = {}
    for k in sorted((k for k in kernels if k.name not in covered and est[k.name] > 0), key=lambda k: -est[k.name]):
        groups.setdefault(k.workload_class, []).append(k)
    share_of = {c: sum(est[k.name] for k in ks) / total for c, ks in groups.items()}
    left = sorted((c for c in groups if share_of[c] >= min_share), key=lambda c: -share_of[c])
    share_left = sum(share_of[c] for c in left)
    # a 2% pooling kernel is not worth two minutes of search: at best it saves 2% of the model
    budget_s = budget_s * min(1.0, share_left / full_share)
    plans, spent = [], 0.0
    for c in left:
        lead, *siblings = groups[c]
        share = share_of[c]
        secs = max(min_seconds, budget_s * share / share_left)
        secs = min(secs, budget_s - spent)
        if secs < min_seconds:
            break
        trials = max_trials if lead.flops > 0 else max(8, max_trials // 4)
        # the search takes its kernels one after another: each gets its part of the trials,
        # or the first would spend the whole budget; in whole batches of 8 (a batch of one
        # more trial costs a generation of candidates, seconds for a big kernel)
        trials = max(8, trials // (1 + len(siblings)) // 8 * 8)
        plans.append(TuningPlan(lead, share, secs, trials, tuple(siblings)))
        spent += secs
    return plans


def plan_refine(kernels: list[Kernel], best_s: dict[str, float | None], skip: set[str],
                budget_s: float, min_share: float = 0.04, max_trials: int = 128,
                min_seconds: float = 30.0) -> list[TuningPlan]:
    """Which transferred kernels to search further natively, and for how long: the heaviest
    computing kernels (``flops`` > 0, not in ``skip``), each alone (a transferred schedule fits
    its own shape; siblings of a class would split the trials), those holding ``min_share`` of
    the estimated model time or more, the largest first, ``budget_s`` split by their shares
    with at least ``min_seconds`` each (ViT-B/32's matmuls gained 3-17% in 35-50 s searches
    from their transferred schedules; an Xception conv's 30 s search found nothing faster)."""
    est = {k.name: k.weight * (best_s.get(k.name) or 0.0) for k in kernels}
    total = sum(est.values())
    if budget_s <= 0 or total <= 0:
        return []
    heavy = sorted((k for k in kernels if k.name not in skip and k.flops > 0
                    and est[k.name] / total >= min_share), key=lambda k: -est[k.name])
    share_left = sum(est[k.name] for k in heavy) / total
    plans, spent = [], 0.0
    for k in heavy:
        share = est[k.name] / total
        secs = min(max(min_seconds, budget_s * share / share_left), budget_s - spent)
        if secs < min_seconds:
            break
        plans.append(TuningPlan(k, share, secs, max_trials))
        spent += secs
    return plans


def report_summary(report: dict) -> dict:
    """Coverage numbers of a recommend run (its ``--json`` report): how much of the untuned
    model had no candidate, and how much of the result still runs at TVM's default schedule.

    Shares of the result are of the kernels' weighted latency sum with the chosen schedules
    (the model's own latency adds glue and the VM's overhead on top)."""
    ks = report["kernels"]

    def t(k: dict) -> float:
        return k["weight"] * (k["untuned_s"] or 0.0)

    def final(k: dict) -> float:
        best = (k.get("chosen") or {}).get("latency_s") or k["untuned_s"] or 0.0
        return k["weight"] * best

    untuned_total = sum(t(k) for k in ks) or 1.0
    final_total = sum(final(k) for k in ks) or 1.0
    left = [k for k in ks if k["status"] == "untuned"]
    lat = report["model_latency_ms"]
    return {
        "kernels": len(ks),
        "kernels_without_candidate": sum(1 for k in ks if not k["candidates"]),
        "untuned_share_without_candidate": sum(t(k) for k in ks if not k["candidates"]) / untuned_total,
        "kernels_tuned_by_recommend": [k["name"] for k in ks if k["status"] in ("tuned-missing", "refined")],
        "tuning_seconds": sum((k.get("tuning") or {}).get("seconds", 0.0) for k in ks),
        "final_share_untuned_total": sum(final(k) for k in left) / final_total,
        "final_share_untuned_max": max((final(k) / final_total for k in left), default=0.0),
        "final_share_untuned_max_kernel": max(left, key=final)["name"] if left else None,
        "speedup_vs_untuned": lat["untuned"] / lat["tuned"] if lat.get("tuned") else None,
        "ort_ratio": lat["tuned"] / lat["onnxruntime"] if lat.get("onnxruntime") else None,
    }
