"""recommend's search time (issue #20): measure what is uncertain, no duplicate work, the donor
store from one index, and the anytime curve in the report."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

import ttrank
from ttrank import donors, frontend, ranking, util, zoo
from ttrank.collect import Dataset
from ttrank.coverage import plan_missing
from ttrank.evaluate import policy_curve
from ttrank.features import FEATURE_NAMES, vector
from ttrank.kernels import Kernel, extract
from ttrank.ranker import Ranker
from ttrank.ranking import AdaptiveK, FixedK, native_candidate, policy_of, rank_kernel, shortlist
from ttrank.target import cpu_description, provenance, vector_class
from ttrank.space import draw_seconds
from ttrank.transfer import transfer
from ttrank.tune import GENERATIONS, MIN_POPULATION, SearchSize, fit_search, tune


def test_adaptive_policy_measures_what_the_ranker_is_unsure_of():
    policy = AdaptiveK(max_k=5, gap=0.1, full_share=0.05, minor_share=0.002)
    flat = [0.90, 0.88, 0.86, 0.85, 0.84, 0.80]  # the ranker cannot tell its top five apart
    confident = [0.95, 0.60, 0.55]  # its top-1 is far ahead
    assert policy.k(flat, share=0.30) == 5  # a big kernel with a flat list: up to the bound
    assert policy.k(confident, share=0.30) == 1  # a confident ranking: its top-1
    assert policy.k(flat, share=0.01) == 1  # a small kernel (a fifth of full_share): fewer
    assert policy.k(flat, share=0.02) == 2
    assert policy.k(flat, share=0.001) == 1  # under minor_share: top-1, as before the policy
    # the bound is what the report's top_k says (1 under minor_share, as before)
    assert policy.bound(0.30) == 5 and policy.bound(0.001) == 1
    # the fixed policy is the old behaviour: k everywhere but the minor kernels
    fixed = FixedK(3, minor_share=0.002)
    assert fixed.k(confident, 0.30) == 3 and fixed.k(flat, 0.001) == 1


def test_the_policy_follows_the_ranker_and_its_calibration(trained):
    ranker = Ranker.load(trained)
    # bound: the caller's top_k, else the k the ranker's evaluation chose
    assert policy_of(ranker, top_k=4).max_k == 4
    assert isinstance(policy_of(ranker, 4, adaptive=False), FixedK)
    ranker.metadata["policy"] = {"gap": 0.2, "full_share": 0.03}  # what a calibration stored
    p = policy_of(ranker, 4)
    assert (p.gap, p.full_share) == (0.2, 0.03) and p.to_json()["policy"] == "AdaptiveK"


def _kernel(name: str, flops: float = 1e9, workload_class: str = "conv2d_transpose") -> Kernel:
    return Kernel(name, workload_class, "conv2d_nchw", "SSSSRRR", [1, 8, 8, 8, 8, 3, 3], [], {}, [], [1], "float32",
                  flops)


def test_recommend_tunes_what_no_donor_covers_for_what_it_can_save():
    """The search time for uncovered kernels scales with their share of the model: a small
    pooling kernel is left alone; two transposed convs that hold most of the model share the
    whole budget in one search."""
    convs = [_kernel(f"conv{i}") for i in range(4)]
    pool = _kernel("max_pool2d", flops=0.0, workload_class="pool")
    best = {"conv0": 0.010, "conv1": 0.010, "conv2": 0.030, "conv3": 0.049, "max_pool2d": 0.0015}
    covered = {"conv0", "conv1", "conv2", "conv3"}
    # ResNet-18's case: only a 1.5% pooling kernel lacks a schedule; at best tuning saves 1.5%
    assert plan_missing([*convs, pool], best, covered, budget_s=120) == []
    best["max_pool2d"] = 0.0005
    # a DB-style head: two transposed convs without donors hold 79% of the model
    (plan,) = plan_missing([*convs, pool], best, {"conv0", "conv1"}, budget_s=120)
    assert [k.name for k in plan.kernels] == ["conv3", "conv2"]  # the largest leads
    assert plan.seconds == pytest.approx(120)  # over full_share: the whole budget
    assert plan.trials == 32  # a kernel after another: each its part of the trials
    # half the share, half the budget; and a flag of 0 turns it off
    half = plan_missing([*convs, pool], {**best, "conv3": 0.016}, {"conv0", "conv1", "conv2"}, 120)
    assert len(half) == 1 and 30 < half[0].seconds < 60
    assert plan_missing([*convs, pool], best, {"conv0", "conv1"}, budget_s=0) == []


def test_a_class_of_small_uncovered_kernels_is_tuned_in_one_search():
    """A U-Net's GroupNorm statistics at six resolutions: none is a tenth of the model, so each
    alone would get too little of the budget to search; together they get one search."""
    convs = [_kernel(f"conv{i}", workload_class="conv2d") for i in range(3)]
    norms = [_kernel(f"variance{i}", flops=1e6, workload_class="reduce+sqrt") for i in range(6)]
    best = {"conv0": 0.3, "conv1": 0.3, "conv2": 0.3, **{f"variance{i}": 0.006 + 0.004 * i for i in range(6)}}
    (plan,) = plan_missing([*convs, *norms], best, {"conv0", "conv1", "conv2"}, budget_s=120)
    assert plan.kernel.name == "variance5" and len(plan.siblings) == 5
    assert plan.seconds >= 20 and plan.trials == 8  # one batch each


def test_policy_curve_trades_candidates_for_quality():
    """Two kernels of one network: the ranker is sure of the first (and right), unsure of the
    second (and its top-1 is wrong): the adaptive policy measures the second's top two only."""
    lat = [1.0, 2.0, 3.0, 1.1, 1.0, 5.0]
    meta = [{"network": "n", "workload": w, "record": str(i), "latency_s": x, "weight": 1, "untuned_s": 10.0}
            for i, (w, x) in enumerate(zip("aaabbb", lat))]
    ds = Dataset(np.zeros((6, 1), np.float32), np.ones(6, np.float32), [3, 3], meta)
    scores = np.array([0.9, 0.3, 0.2, 0.80, 0.79, 0.1])
    curve = policy_curve(ds, scores, {"top1": FixedK(1), "top3": FixedK(3),
                                      "adaptive": AdaptiveK(3, gap=0.05, full_share=0.01)})
    assert curve["top1"]["quality"] < curve["adaptive"]["quality"] == curve["top3"]["quality"] == 1.0
    assert curve["adaptive"]["candidates"] == 1.5 and curve["top3"]["candidates"] == 3


def test_candidates_that_transfer_to_one_program_are_measured_once(trained, donor_dir, tiny_cnn, target):
    store = donors.DonorStore.load([donor_dir])
    kernel = next(k for k in extract(frontend.load(tiny_cnn).mod, target) if k.anchor_op == "conv2d_nchw")
    best = rank_kernel(kernel, store, Ranker.load(trained))[0]
    # the same schedule offered twice (as two donors' identical schedules would be)
    twin = dataclasses.replace(best, record=dataclasses.replace(best.record, id=best.record.id + "-twin"))
    picks = shortlist(kernel, [best, twin], 2, target)
    assert len(picks) == 1 and picks[0].same_program == [twin.record.id]
    # a whole shortlist holds distinct programs
    picks = shortlist(kernel, rank_kernel(kernel, store, Ranker.load(trained)), 5, target)
    hashes = [p.transferred.program_hash() for p in picks]
    assert len(hashes) == len(set(hashes))


def test_a_second_shortlist_goes_on_after_the_first(trained, donor_dir, tiny_cnn, target, monkeypatch):
    """recommend's second look asks for the candidates after the picks it measured: those picks,
    their programs and the transfers that failed are not tried again."""
    store = donors.DonorStore.load([donor_dir])
    kernel = next(k for k in extract(frontend.load(tiny_cnn).mod, target) if k.anchor_op == "conv2d_nchw")
    ranked = rank_kernel(kernel, store, Ranker.load(trained))
    twin = dataclasses.replace(ranked[0], record=dataclasses.replace(ranked[0].record, id="twin-of-the-first"))
    broken = dataclasses.replace(ranked[1], record=dataclasses.replace(ranked[1].record, id="broken",
                                                                       trace_json={"not": "a trace"}))
    cands = [broken, ranked[0], *ranked[1:], twin]
    rejected: list = []
    first = shortlist(kernel, cands, 1, target, rejected=rejected)
    assert [p.candidate for p in first] == [ranked[0]] and [r for r, _ in rejected] == ["broken"]
    tried = []
    monkeypatch.setattr(ranking, "transfer", lambda rec, *a: tried.append(rec.id) or transfer(rec, *a))
    nxt = [p.candidate.record.id for p in shortlist(kernel, cands, len(cands), target, rejected=rejected,
                                                    taken=first)]
    assert nxt and nxt == [c.record.id for c in ranked[1:] if c.record.id in nxt]  # in rank order
    assert not {ranked[0].record.id, "broken"} & set(tried)
    assert [r for r, _ in rejected].count("broken") == 1
    # the twin's transfer gives the first pick's program: noted on it, not measured again
    assert "twin-of-the-first" in first[0].same_program and "twin-of-the-first" not in nxt


def test_a_schedule_tuned_on_this_cpu_is_measured_beside_the_rankers_picks(trained, donor_dir, tiny_cnn,
                                                                          target):
    store = donors.DonorStore.load([donor_dir])
    kernel = next(k for k in extract(frontend.load(tiny_cnn).mod, target) if k.anchor_op == "conv2d_nchw")
    ranked = rank_kernel(kernel, store, Ranker.load(trained))
    # the test donors were tuned here; say the ranker's favourites were tuned elsewhere
    elsewhere = [dataclasses.replace(c, record=dataclasses.replace(
        c.record, provenance={**c.record.provenance, "mcpu": "elsewhere"})) for c in ranked[:-1]]
    cands = elsewhere + ranked[-1:]
    native = native_candidate(cands, target.attrs["mcpu"])
    assert native is cands[-1]
    picks = shortlist(kernel, cands, 1, target, also=[native])
    assert [p.candidate for p in picks] == [cands[0], native]
    # already among the k: measured once
    assert len(shortlist(kernel, [native] + elsewhere, 1, target, also=[native])) == 1
    # none tuned here: the best-ranked one tuned on a CPU of this one's vector class instead
    # (on an AVX2 CPU, an AVX2 CPU's schedule; AVX-512 ones run their 16-lane loops in halves)
    here = vector_class(target.attrs["mcpu"])
    if here not in ((0.0, 256.0), (0.0, 512.0)):
        pytest.skip("the two CPU names below are x86's")
    same, other = ("haswell", "skylake-avx512") if here == (0.0, 256.0) else ("skylake-avx512", "haswell")
    assert vector_class(same) == here != vector_class(other)

    def tuned_on(c, mcpu):
        return dataclasses.replace(c, record=dataclasses.replace(c.record, provenance={**c.record.provenance,
                                                                                       "mcpu": mcpu}))

    cands = [tuned_on(c, other) for c in ranked[:-1]] + [tuned_on(ranked[-1], same)]
    assert native_candidate(cands, target.attrs["mcpu"]) is cands[-1]
    assert native_candidate(cands[:-1], target.attrs["mcpu"]) is None


def test_kernels_with_one_workload_are_one_kernel(tmp_path, target):
    """Two identical conv blocks (different weights): one kernel of weight 2, so one untuned
    measurement and one shortlist serve both (MetaSchedule's task extraction merges them)."""
    g = zoo.GraphBuilder("twin_convs", seed=0)
    x = g.input("input", [1, 8, 16, 16])
    x = g.relu(g.conv(x, 8, 8, 3, pad=1))
    x = g.relu(g.conv(x, 8, 8, 3, pad=1))
    g.output(x, [1, 8, 16, 16])
    onnx.save(g.model(), str(tmp_path / "twin.onnx"))
    kernels = extract(frontend.load(tmp_path / "twin.onnx").mod, target)
    convs = [k for k in kernels if k.anchor_op == "conv2d_nchw"]
    assert len(convs) == 1 and convs[0].weight == 2
    assert len({k.workload_hash for k in kernels}) == len(kernels)


def test_the_donor_store_loads_from_one_index(donor_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    first = donors.DonorStore.load([donor_dir])
    index = donors.store_index_path([donor_dir])
    assert index.exists()
    # the next load reads the index alone: no log is parsed, nor any record's features computed
    monkeypatch.setattr(donors, "_cached_index", lambda *a: pytest.fail("a log was read"))
    monkeypatch.setattr(donors, "donor_features", lambda *a: pytest.fail("features recomputed"))
    again = donors.DonorStore.load([donor_dir])
    assert [r.id for r in again.records()] == [r.id for r in first.records()]
    assert [r.trace_json for r in again.records()] == [r.trace_json for r in first.records()]
    assert set(again.features_of_records()) == {r.id for r in first.records()}
    # the workload's TIR is parsed only when a transfer asks for it
    assert str(again.workloads[0].module()) == str(first.workloads[0].module())


def test_ranking_features_a_kernel_against_the_whole_store_as_pair_by_pair(donor_dir, tiny_cnn, target):
    """Ranking computes a kernel's rows in one pass, reusing what several pairs share (the
    target's part, a donor workload's, a loop's tiling, a CPU's): each row is still its pair's
    features alone, as training computes them."""
    store = donors.DonorStore.load([donor_dir])
    cpu = cpu_description(provenance(target))
    for kernel in extract(frontend.load(tiny_cnn).mod, target):
        pairs = store.compatible(kernel)
        if not pairs:
            continue
        rows = store.pair_rows(kernel, pairs, cpu)
        alone = [vector(store.pair_features(kernel, w, r, cpu=cpu)) for w, r in pairs]
        np.testing.assert_array_equal(rows, np.asarray(alone, dtype=np.float32))
        assert rows.shape == (len(pairs), len(FEATURE_NAMES)) and not np.isnan(rows[:, :-16]).any()


def test_the_store_index_follows_the_logs(donor_dir, tmp_path):
    """A log that changes (a `donors add`, a retune) is a new index: stat, not content."""
    work = tmp_path / "tiny_resnet"
    shutil.copytree(donor_dir, work)
    before = donors.store_index_path([work])
    rec = next(p for p in work.iterdir() if p.name.startswith("database_tuning_record"))
    rec.write_bytes(rec.read_bytes())  # the same content, written again
    assert donors.store_index_path([work]) != before
    assert donors.store_index_path([work], top_k=3) != donors.store_index_path([work])


def test_a_new_store_is_indexed_on_every_core(donor_dir, tmp_path, monkeypatch):
    """A fresh install's first run indexes its work_dirs one per worker process; the store it
    reads back is the one a single process parses."""
    dirs = [donor_dir, tmp_path / "tiny_resnet_copy"]
    shutil.copytree(donor_dir, dirs[1])
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "one_process"))
    serial = donors.DonorStore.load(dirs, use_cache=False)

    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(util, "host_cores", lambda: 2)
    monkeypatch.setattr(donors, "index_work_dir", lambda *a, **k: pytest.fail("a log was parsed here"))
    store = donors.DonorStore.load(dirs)
    assert [r.id for r in store.records()] == [r.id for r in serial.records()]
    assert [r.trace_json for r in store.records()] == [r.trace_json for r in serial.records()]
    assert [(r.network, r.kept, r.skipped) for r in store.reports] == \
        [(r.network, r.kept, r.skipped) for r in serial.reports]


def test_recommend_reports_what_more_time_would_buy(trained, donor_dir, tiny_cnn, tmp_path):
    res = ttrank.recommend(frontend.load(tiny_cnn), store=donors.DonorStore.load([donor_dir]),
                           ranker=Ranker.load(trained), top_k=3, data_dir=tmp_path / "data",
                           database_dir=tmp_path / "db", time_model=False, tune_missing=0)
    curve = res.to_json()["anytime"]
    # the estimated model latency after the untuned kernels, then after each measured batch
    assert curve[0]["phase"] == "untuned" and curve[0]["measured"] == 0
    assert curve[0]["estimated_ms"] == pytest.approx(
        1e3 * sum(k.weight * k.untuned_s for k in res.kernels), rel=1e-3)
    assert [p["seconds"] for p in curve] == sorted(p["seconds"] for p in curve)
    # it only falls while the kernels measure their own candidates; a kernel whose conv a heavier
    # one shares counts that one's fastest until it measures it itself ("siblings", last)
    own = [p for p in curve if p["phase"] != "siblings"]
    assert all(b["estimated_ms"] <= a["estimated_ms"] for a, b in zip(own, own[1:]))
    assert any(p["phase"] == "siblings" for p in curve)
    assert curve[-1]["measured"] == sum(len(k.measured) for k in res.kernels)
    assert curve[-1]["estimated_ms"] == pytest.approx(1e3 * sum(k.weight * k.best_s for k in res.kernels),
                                                      rel=1e-3)
    # each kernel measured what the policy gave it, never more than top_k, and what was
    # measured beside (a schedule tuned on this CPU), which it names
    assert res.provenance["policy"]["policy"] == "AdaptiveK"
    # (and a second look's, after its picks all lost to the untuned kernel)
    assert all(len(k.measured) <= k.k + len(k.beside) + k.second_look and k.k <= k.top_k <= 3
               for k in res.kernels if k.candidates)
    # two kernels of one conv (other epilogues): the lighter measures only the heavier's fastest
    sibling = next(k for k in res.kernels if k.sibling_of)
    lead = next(k for k in res.kernels if k.name == sibling.sibling_of)
    assert lead.weight * lead.untuned_s >= sibling.weight * sibling.untuned_s and not lead.sibling_of
    fastest = min((m for m in lead.measured if m["status"] == "ok"), key=lambda m: m["latency_s"])
    assert [m["donor"] for m in sibling.measured] == [fastest["donor"]] and sibling.k == 1
    json.dumps(res.to_json())


def test_a_copied_store_reports_its_own_folders(donor_dir, tmp_path):
    # the per-folder index is found by content: a copy (a clone, a worktree) must still report
    # where its own logs are, since the second stage reads them from there
    donors.DonorStore.load([donor_dir])
    copy = tmp_path / "elsewhere" / donor_dir.name
    shutil.copytree(donor_dir, copy)
    store = donors.DonorStore.load([copy])
    assert [r.work_dir for r in store.reports] == [str(copy)]


def _box_decoding(tmp_path, scales: int = 3) -> Path:
    """A YOLO head's box decoding, as exporters write it: per scale, sigmoid, grid offsets
    and anchors on slices of the channels, then one concat of every scale's boxes."""
    g = zoo.GraphBuilder("decode", seed=0)
    boxes = []
    for s in range(scales):
        n = 8 >> s
        p = g.node("Sigmoid", [g.input(f"p{s}", [1, 3, n, n, 16])])
        xy = g.node("Slice", [p, *(g.const(np.array([v], np.int64)) for v in (0, 2, 4))])
        wh = g.node("Slice", [p, *(g.const(np.array([v], np.int64)) for v in (2, 4, 4))])
        rest = g.node("Slice", [p, *(g.const(np.array([v], np.int64)) for v in (4, 16, 4))])
        xy = g.node("Mul", [g.node("Add", [g.node("Mul", [xy, g.const(np.float32(2))]),
                                           g.weight((1, 1, n, n, 2), 1.0)]), g.const(np.float32(8 << s))])
        wh = g.node("Mul", [g.node("Mul", [wh, wh]), g.weight((1, 3, 1, 1, 2), 1.0)])
        box = g.node("Concat", [xy, wh, rest], axis=4)
        boxes.append(g.node("Reshape", [box, g.const(np.array([1, -1, 16], np.int64))]))
    g.output(g.node("Concat", boxes, axis=1), [1, 3 * (64 + 16 + 4), 16])
    path = tmp_path / "decode.onnx"
    onnx.save(g.model(), str(path))
    return path


def test_a_kernel_slow_to_generate_gets_a_search_its_budget_holds(tmp_path, tiny_cnn, target):
    """MetaSchedule generates a batch of candidates with no chance to stop, and a kernel that
    fuses a detection head's decoding (dozens of blocks) takes seconds a candidate: at the
    full population YOLOv5's took 340 s of a 22 s budget. Its search is sized to the budget."""
    (decode,) = [k for k in extract(frontend.load(_box_decoding(tmp_path)).mod, target) if k.flops > 0]
    conv = next(k for k in extract(frontend.load(tiny_cnn).mod, target) if k.anchor_op == "conv2d_nchw")
    assert draw_seconds(decode, target) > 3 * draw_seconds(conv, target)
    # a conv's draws are cheap: MetaSchedule's own search for a batch of 8
    assert fit_search(0.04, 14.0, 8, cores=2) == SearchSize(128, GENERATIONS)
    # a draw of seconds: fewer generations and a smaller population, or no search at all
    assert fit_search(2.7, 30.0, 8, cores=2) == SearchSize(21, 1)
    assert fit_search(2.7, 12.6, 8, cores=2) is None
    # a small search is a real one: it measures its batch
    run = tune(frontend.load(tiny_cnn).mod, tmp_path / "small", trials_per_task=8, only=[conv.name],
               target=target, trials_per_iter=8, search_size=SearchSize(MIN_POPULATION, 1))
    assert run.tasks[0].done == 8 and run.tasks[0].best_s is not None
