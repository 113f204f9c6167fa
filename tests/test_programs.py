"""The second ranking stage: a program cost model pre-trained on donor tuning logs, blended on
the ranker's shortlist."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ttrank import programs
from ttrank.cli import main
from ttrank.collect import Dataset, build_dataset
from ttrank.evaluate import cpu_of_rows
from ttrank.errors import RankerError
from ttrank.ranker import Ranker
from ttrank.training import choose_stage2


def test_cost_model_learns_from_a_tuning_log(donor_dir, target, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    rs = programs.record_set(donor_dir, target)
    assert rs.X.shape == (len(rs.latency_s), programs.WIDTH) and len(rs.latency_s) >= 18
    y = rs.labels()
    assert ((y >= 0) & (y <= 1)).all()
    for w in set(rs.workload):  # every workload's best trial is the reference
        assert y[rs.workload == w].max() == pytest.approx(1.0)
    again = programs.record_set(donor_dir, target)  # from the cache
    assert np.array_equal(np.nan_to_num(again.X), np.nan_to_num(rs.X))
    # on a CPU the log was not tuned on, its own machine's latencies still teach the cost model
    from ttrank.target import make_target

    other = "icelake-server" if target.attrs.get("mcpu") != "icelake-server" else "znver4"
    elsewhere = programs.record_set(donor_dir, make_target({"kind": "llvm", "mcpu": other, "num-cores": 2}))
    assert np.array_equal(elsewhere.latency_s, rs.latency_s)

    m = programs.fit_cost_model([donor_dir], target, n_estimators=60)
    pred = m.predict(rs.X)
    assert np.corrcoef(pred, y)[0, 1] > 0.5  # it learned which programs are good
    path = m.save(tmp_path / "costmodel.json", **m.metadata)
    assert np.allclose(programs.CostModel.load(path).predict(rs.X), pred)
    # a model for another program-feature schema is refused, by name
    meta = path.with_name("costmodel.meta.json")
    d = json.loads(meta.read_text())
    meta.write_text(json.dumps({**d, "program_feature_version": 0}))
    with pytest.raises(RankerError, match="program features v0"):
        programs.CostModel.load(path)


def _toy(cost_quality: str) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """Two networks, four kernels each, eight candidates per kernel; one score knows the truth."""
    rng = np.random.default_rng(0)
    meta, y, groups, truth = [], [], [], []
    for net in ("a", "b"):
        for g in range(4):
            lat = rng.uniform(1, 3, 8)
            groups.append(8)
            for x in lat:
                meta.append({"network": net, "workload": f"{net}{g}", "weight": 1, "latency_s": x})
                y.append(lat.min() / x)
                truth.append(-x)
    truth, noise = np.array(truth), rng.random(len(y))
    ranker, cost = (noise, truth) if cost_quality == "good" else (truth, noise)
    return Dataset(np.zeros((len(y), 1)), np.array(y), groups, meta), ranker, cost


def test_record_sets_not_cached_yet_are_extracted_on_every_core(donor_dir, target, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    sets = [shutil.copytree(donor_dir, tmp_path / name) for name in ("tiny_resnet", "tiny_resnet@nchw-t2-x")]
    one, two = programs.record_sets(sets, target)  # in worker processes where there are 2 cores
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "another-cache"))
    alone = programs.record_set(donor_dir, target)  # in this process
    for rs in (one, two):
        assert np.array_equal(np.nan_to_num(rs.X), np.nan_to_num(alone.X))
        assert np.array_equal(rs.latency_s, alone.latency_s) and list(rs.workload) == list(alone.workload)


def test_second_stage_is_kept_only_where_it_helps():
    ds, ranker, cost = _toy("good")
    st = choose_stage2(ds, ranker, cost)
    assert st["enabled"] and st["gain"] > 0.1 and st["weight"] < 1
    ds, ranker, cost = _toy("useless")
    st = choose_stage2(ds, ranker, cost)
    assert not st["enabled"] and st["weight"] == 1.0 and st["average"]["top1"] == pytest.approx(1.0)


def test_recommend_reorders_the_shortlist_with_the_cost_model(trained, donor_dir, tiny_cnn, target,
                                                               tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    # the test ranker with a second stage, its cost model beside it
    r = Ranker.load(trained)
    ranker = tmp_path / "models" / "ranker.json"
    ranker.parent.mkdir()
    cm_path = programs.cost_model_path(ranker)
    r.save(ranker, stage2={"enabled": True, "weight": 0.5, "shortlist": 4, "cost_model": cm_path.name})
    cm = programs.fit_cost_model([donor_dir], target, n_estimators=30)
    cm.save(cm_path, **cm.metadata)
    report = tmp_path / "report.json"
    args = ["recommend", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--ranker", str(ranker),
            "--donors", str(donor_dir), "--json", str(report), "--data-dir", str(tmp_path / "data"),
            "--top-k", "2", "--minor-share", "0", "--tune-missing", "0", "--no-progress"]
    assert main(args) == 0
    r = json.loads(report.read_text())
    assert r["max_abs_error_vs_onnxruntime"] < 1e-3
    # every shortlist of donor schedules was scored (one design-space draw has nothing to reorder;
    # late picks and a second look go past the shortlist, in the ranker's order)
    measured = [m for k in r["kernels"] if k["top_k"] > 1 and k["candidates"] > 1
                for m in k["measured"][:len(k["measured"]) - k["second_look"] - k["late_picks"]]]
    assert measured and all(m["cost_score"] is not None for m in measured)
    # a cost model from another schema: one clear error, nothing written as done
    meta = ranker.with_name("ranker.costmodel.meta.json")
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "width": 7}))
    shutil.rmtree(tmp_path / "data")
    assert main(args[:-1] + ["--no-progress", "--json", str(tmp_path / "r2.json")]) != 0
    assert not (tmp_path / "r2.json").exists()


def test_a_second_stage_that_reorders_no_donors_still_orders_the_design_space_draws(
        trained, donor_dir, tiny_cnn, target, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    # the evaluation left the donors in the ranker's order, and kept the cost model
    ranker = tmp_path / "models" / "ranker.json"
    ranker.parent.mkdir()
    cm_path = programs.cost_model_path(ranker)
    Ranker.load(trained).save(ranker, stage2={"enabled": False, "weight": 1.0, "shortlist": 0,
                                              "cost_model": cm_path.name})
    cm = programs.fit_cost_model([donor_dir], target, n_estimators=30)
    cm.save(cm_path, **cm.metadata)
    report = tmp_path / "report.json"
    assert main(["recommend", str(tiny_cnn), "-o", str(tmp_path / "cnn.so"), "--ranker", str(ranker),
                 "--donors", str(donor_dir), "--json", str(report), "--data-dir", str(tmp_path / "data"),
                 "--top-k", "2", "--minor-share", "0", "--tune-missing", "0", "--no-progress"]) == 0
    measured = [m for k in json.loads(report.read_text())["kernels"] for m in k["measured"]]
    draws = [m for m in measured if m["donor"].startswith("design-space/")]
    donors = [m for m in measured if not m["donor"].startswith("design-space/")]
    assert donors and all(m["cost_score"] is None for m in donors)  # no donor was transferred to be scored
    # the draws a kernel had to choose among were scored (a single draw has nothing to order)
    assert any(m["cost_score"] is not None for m in draws)


def test_leave_one_out_of_a_model_no_donor_came_from_keeps_the_rankers_cost_model(
        trained, donor_dir, target, tmp_path, monkeypatch):
    """`recommend my_model.onnx --leave-one-out` leaves nothing out of the store: the second stage
    is the ranker's own cost model, not a minute's refit; a donor network left out gets one."""
    from ttrank import ranking
    from ttrank.donors import DonorStore

    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    ranker = tmp_path / "ranker.json"
    cm_path = programs.cost_model_path(ranker)
    Ranker.load(trained).save(ranker, stage2={"enabled": True, "weight": 0.5, "shortlist": 4,
                                              "cost_model": cm_path.name})
    cm = programs.fit_cost_model([donor_dir], target, n_estimators=10)
    cm.save(cm_path, **cm.metadata)
    refits = []
    monkeypatch.setattr(ranking, "cost_model_without",
                        lambda nets, dirs, t: refits.append(set(nets)) or programs.CostModel.load(cm_path))
    store = DonorStore.load([donor_dir])
    assert ranking.SecondStage.of(Ranker.load(ranker), store, target, {"my_model"}) is not None
    assert refits == []
    ranking.SecondStage.of(Ranker.load(ranker), store, target, {"my_model", "tiny_resnet"})
    assert refits == [{"tiny_resnet"}]


def test_a_shortlist_whose_transfers_are_slow_stops_at_the_budget(trained, donor_dir, tiny_cnn, target,
                                                                   tmp_path, monkeypatch):
    """The second stage transfers its shortlist within a time budget: on a kernel where each
    transfer is slow (a fused element-wise kernel took 7 s each), it scores the first few and
    keeps the ranker's order for the rest; no candidate is lost."""
    import time

    from ttrank import frontend, kernels, ranking
    from ttrank.donors import DonorStore

    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    cm = programs.fit_cost_model([donor_dir], target, n_estimators=10)
    stage = ranking.SecondStage(0.5, 4, cm, programs.Featurizer(target))
    store = DonorStore.load([donor_dir])
    conv = next(k for k in kernels.extract(frontend.load(tiny_cnn).mod, target)
                if k.tunable and len(store.compatible(k)) >= 4)
    cands = ranking.rank_kernel(conv, store, Ranker.load(trained))
    slow = ranking.transfer
    monkeypatch.setattr(ranking, "transfer", lambda *a, **kw: time.sleep(0.3) or slow(*a, **kw))
    ordered, transferred = ranking.rerank(conv, cands, stage, target, budget_s=0.4)
    assert len(transferred) == 2  # two transfers, then the budget was spent
    assert sorted(c.record.id for c in ordered) == sorted(c.record.id for c in cands)
    assert [c.record.id for c in ordered[2:]] == [c.record.id for c in cands[2:]]
    picks = ranking.shortlist(conv, cands, 3, target, budget_s=0.4)
    assert len(picks) == 2  # the third transfer would have gone over the budget


def test_a_leave_one_out_refit_is_fitted_once_and_again_when_its_data_changes(
        trained, measurements, donor_dir, tmp_path, monkeypatch):
    """Every `recommend --leave-one-out` of a network refits the same ranker from the same files:
    the fit is cached, keyed by what it reads, and redone once a measurement table changes."""
    from ttrank import training
    from ttrank.donors import DonorStore

    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "measurements"
    shutil.copytree(measurements, data)
    base = Ranker.load(trained)
    store = DonorStore.load([donor_dir])
    ds = build_dataset([data], store)
    cpu = ds.meta[0]["mcpu"]
    base.fit_own(ds.X, ds.y, ds.groups, cpu_of_rows(ds), min_rows=1)  # this CPU has its own ranker
    base.metadata["training_networks"] = ["tiny_cnn", "left_out_net"]
    fits = []
    fit = Ranker.fit
    monkeypatch.setattr(Ranker, "fit", lambda self, *a, **kw: fits.append(1) or fit(self, *a, **kw))

    first = training.ranker_without("left_out_net", base, store, [data])
    again = training.ranker_without("left_out_net", base, store, [data])
    assert len(fits) == 2  # the pooled ranker and the CPU's own, once
    assert again.metadata["left_out"] == "left_out_net"
    assert again.metadata["training_networks"] == ["tiny_cnn"]
    assert again.own_cpus() == [cpu] and again.own_ranker(cpu).path.parent == again.path.parent
    X = np.random.default_rng(0).random((5, first.width), dtype=np.float32)
    np.testing.assert_allclose(first.predict(X, cpu), again.predict(X, cpu))

    table = next(data.glob("*.jsonl"))
    table.write_text(table.read_text() + table.read_text().splitlines(keepends=True)[0])
    training.ranker_without("left_out_net", base, store, [data])
    assert len(fits) == 4


def test_a_donor_that_tuned_this_very_kernel_here_is_measured_first(donor_dir, trained, target):
    """tiny_resnet's own tuning run measured its conv on this CPU with these threads: ranking that
    conv puts the run's two fastest records of it first, ahead of any prediction; for another CPU
    the ranker's order stands."""
    from ttrank import kernels, ranking
    from ttrank.donors import DonorStore
    from ttrank.target import provenance, target_cpu
    from ttrank.zoo import load

    store = DonorStore.load([donor_dir])
    conv = next(k for k in kernels.extract(load("zoo:tiny_resnet").mod, target)
                if k.name == "fused_conv2d1_add1_relu1")
    here = target_cpu(target)
    assert here["threads"] == provenance(target)["threads"]
    ranker = Ranker.load(trained)
    cands = ranking.rank_kernel(conv, store, ranker, cpu=here)
    exact = sorted((c for c in cands if c.donor.kernel.workload_hash == conv.workload_hash),
                   key=lambda c: c.record.latency_s)
    assert len(exact) >= 2 and [c.record.id for c in cands[:2]] == [c.record.id for c in exact[:2]]
    elsewhere = ranking.rank_kernel(conv, store, ranker, cpu={**here, "mcpu": "another-cpu"})
    assert [c.score for c in elsewhere] == sorted((c.score for c in elsewhere), reverse=True)
    assert sorted(c.record.id for c in elsewhere) == sorted(c.record.id for c in cands)
    # the same conv under another epilogue (the residual add) gets the same two first
    sibling = next(k for k in kernels.extract(load("zoo:tiny_resnet").mod, target)
                   if k.workload_hash != conv.workload_hash and ranking.same_anchor(k, conv))
    assert [c.record.id for c in ranking.rank_kernel(sibling, store, ranker, cpu=here)[:2]] == \
        [c.record.id for c in exact[:2]]


def test_program_vectors_of_rows_added_later_cost_only_their_own_transfers(target, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    transferred = []

    def network_vectors(network, pairs, target_spec):  # stands in for the transfers
        transferred.extend(rid for _, rid, _, _ in pairs)
        return {(wh, rid): np.full(programs.WIDTH, len(transferred), np.float32) for wh, rid, _, _ in pairs}

    monkeypatch.setattr(programs, "_network_vectors", network_vectors)

    class Store:
        def by_record_id(self):
            return {r: (None, None) for r in ("a/1/0", "b/2/0", "c/3/0")}

    def dataset(records):
        meta = [{"network": "resnet18", "workload": "w1", "record": r} for r in records]
        return Dataset(np.zeros((len(meta), 1)), np.ones(len(meta)), [len(meta)], meta)

    first = programs.candidate_vectors(dataset(["a/1/0", "b/2/0"]), Store(), target)
    assert transferred == ["a/1/0", "b/2/0"]
    grown = programs.candidate_vectors(dataset(["a/1/0", "b/2/0", "c/3/0", "gone/9/9"]), Store(), target)
    assert transferred == ["a/1/0", "b/2/0", "c/3/0"]  # the new row alone; a record not in the store none
    assert np.array_equal(grown[:2], first) and grown[2, 0] == 3 and np.isnan(grown[3]).all()
