"""`ttrank adapt`: native tuning of the kernels that matter, this CPU's rows, a retrained ranker."""

from __future__ import annotations

import json

import pytest

from ttrank import adapt, donors, locations
from ttrank.kernels import Kernel
from ttrank.ranker import Ranker


def test_native_donors_count_as_the_network_they_were_tuned_in():
    # so that leaving resnet18 out (evaluation) also leaves out what adapt tuned for it
    assert donors.network_of(donors.native_dir("resnet18", "znver5")) == "resnet18"
    assert donors.network_of(donors.native_dir("mnasnet1_0", "emeraldrapids")) == "mnasnet1_0"
    assert donors.network_of("/somewhere/my-model") == "my-model"
    assert donors.network_of(donors.native_dir("resnet18", "znver5", "nchwc")) == "resnet18"


def test_a_packed_layout_plan_tunes_the_packed_convs(donor_dir, target):
    plan = adapt.plan(["tiny_cnn"], target, donors.DonorStore.load([donor_dir]), layout="nchwc")
    assert any("NCHWc" in p.workload_class for p in plan)
    assert not any(p.workload_class.startswith("conv2d_nchw") for p in plan)


def test_the_plan_puts_the_kernels_with_the_largest_share_of_the_zoo_first(donor_dir, target):
    plan = adapt.plan(["tiny_cnn", "tiny_resnet"], target, donors.DonorStore.load([donor_dir]))
    shares = [p.share for p in plan]
    assert shares == sorted(shares, reverse=True)
    # each network's kernels share its time: the summed shares are one per network
    assert sum(shares) == pytest.approx(2.0)
    assert {n for p in plan for n in p.networks} == {"tiny_cnn", "tiny_resnet"}
    # every kernel is tuned in a network that has it, under its task name there
    for p in plan:
        assert p.network in p.networks and p.task and p.workload_class


def test_the_tuning_budget_goes_where_it_buys_the_most_share_per_second():
    """Not every kernel of the first networks, nor a slow conv whose trials cost as much as
    three matmuls: the kernels the budget reaches, most share per tuning second first, one tune
    per network (in the order of its first kernel)."""
    def k(net: str, task: str, share: float, seconds: float) -> adapt.PlannedKernel:
        return adapt.PlannedKernel(f"{net}/{task}", net, task, "conv2d", share, [net], seconds)

    fast, slow = 0.001, 0.05  # 1 ms and 50 ms a call
    todo = [k("vgg16", "big", 0.30, slow), k("bert", "mm1", 0.20, fast), k("bert", "mm2", 0.01, fast),
            k("resnet18", "c1", 0.15, fast), k("resnet50", "c1", 0.12, fast)]
    assert adapt.trial_seconds(slow) > 2 * adapt.trial_seconds(fast)
    assert todo[0].gain_per_second() < todo[1].gain_per_second()
    three = 3 * 64 * adapt.trial_seconds(fast)
    assert adapt.tuning_batch(todo, three, 64) == [("bert", ["mm1"]), ("resnet18", ["c1"]),
                                                     ("resnet50", ["c1"])]
    # the slow conv comes once the budget reaches it; a kernel that does not fit leaves room
    # for a cheaper one after it
    assert adapt.tuning_batch(todo, three + 64 * adapt.trial_seconds(slow), 64)[-1] == ("vgg16", ["big"])
    assert adapt.tuning_batch(todo, 4 * 64 * adapt.trial_seconds(fast), 64) == [
        ("bert", ["mm1", "mm2"]), ("resnet18", ["c1"]), ("resnet50", ["c1"])]
    # a budget short of one kernel still tunes the best buy
    assert adapt.tuning_batch(todo, 1.0, 64) == [("bert", ["mm1"])]


def _conv(name: str, data: list[int], weight: list[int], out: list[int], anchor: str = "conv2d_NCHWc"):
    return Kernel(name, anchor, anchor, "SSSSSRRRR", [], [], {}, [data, weight], out, "float32", 1e8)


def test_a_transfer_family_is_the_op_its_window_stride_and_output_size():
    # ResNet-18's 3x3 convs at 56x56 and its strided one into 28x28, packed (NCHW16c, OIHW16i16o)
    c56 = _conv("c56", [1, 4, 56, 56, 16], [4, 4, 3, 3, 16, 16], [1, 4, 56, 56, 16])
    c56b = _conv("c56b", [1, 8, 56, 56, 16], [8, 8, 3, 3, 16, 16], [1, 8, 56, 56, 16])
    s2 = _conv("s2", [1, 4, 56, 56, 16], [8, 4, 3, 3, 16, 16], [1, 8, 28, 28, 16])
    p1 = _conv("p1", [1, 4, 56, 56, 16], [4, 4, 1, 1, 16, 16], [1, 4, 56, 56, 16])
    c7 = _conv("c7", [1, 32, 7, 7, 16], [32, 32, 3, 3, 16, 16], [1, 32, 7, 7, 16])
    nhwc = _conv("nhwc", [1, 56, 56, 64], [3, 3, 64, 64], [1, 56, 56, 64], anchor="conv2d_nhwc")
    fam = adapt.transfer_family
    assert fam(c56) == fam(c56b)  # channels apart, one family
    assert len({fam(c56), fam(s2), fam(p1), fam(c7)}) == 4
    assert fam(c56).endswith("3x3 s1 large") and fam(s2).endswith("3x3 s2 mid")
    assert fam(nhwc).endswith("3x3 s1 large")
    dense = Kernel("mm", "matmul", "matmul", "SSR", [], [], {}, [[1, 768], [768, 768]], [1, 768], "float32", 1e6)
    assert fam(dense) == "matmul SSR"


def test_the_family_plan_tunes_one_kernel_of_each_family_before_any_seconds():
    """Deep searches are few: the first go to one kernel of each family, whose schedule then
    transfers to the rest of it, the families with the most share per tuning second first."""
    def k(net: str, task: str, share: float, family: str) -> adapt.PlannedKernel:
        return adapt.PlannedKernel(f"{net}/{task}", net, task, "conv2d", share, [net], 0.001, family)

    todo = [k("resnet18", "a", 0.30, "3x3"), k("resnet50", "b", 0.25, "3x3"), k("vgg16", "c", 0.20, "3x3"),
            k("mobilenetv2", "d", 0.15, "1x1"), k("mnasnet1_0", "e", 0.05, "dw"), k("yolo", "f", 0.04, "1x1")]
    one = 256 * adapt.trial_seconds(0.001)
    assert adapt.tuning_batch(todo, 3 * one, 256, "families") == [
        ("resnet18", ["a"]), ("mobilenetv2", ["d"]), ("mnasnet1_0", ["e"])]
    # each family's second only after every family's first; by share, the kernels plan would not
    assert adapt.tuning_batch(todo, 4 * one, 256, "families")[-1] == ("resnet50", ["b"])
    assert adapt.tuning_batch(todo, 3 * one, 256) == [("resnet18", ["a"]), ("resnet50", ["b"]), ("vgg16", ["c"])]


def test_the_report_says_how_often_native_search_beat_transfer():
    rep = adapt.AdaptReport("znver5", 3600.0, tuned=[
        {"task": "a", "native_s": 1.0e-3, "transferred_s": 2.0e-3},
        {"task": "b", "native_s": 2.0e-3, "transferred_s": 1.0e-3},
        {"task": "c", "native_s": 1.0e-3, "transferred_s": 4.0e-3},
        {"task": "d", "native_s": 1.0e-3, "transferred_s": None}])  # nothing transferred measured
    won, compared, ratio = rep.native_vs_transferred()
    assert (won, compared) == (2, 3) and ratio == pytest.approx((0.5 * 2.0 * 0.25) ** (1 / 3))
    assert adapt.AdaptReport("znver5", 60.0).native_vs_transferred() is None


def test_kernels_a_shipped_set_of_this_cpu_tuned_are_not_tuned_again(tmp_path, monkeypatch):
    """An earlier adaptation published as ``NET@LAYOUT-tN-MCPU`` in datasets/donors counts as
    this CPU's native tuning; another CPU's set or layout does not."""
    monkeypatch.setenv("TTRANK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    shipped = tmp_path / "home" / "datasets" / "donors"

    def log(name: str, rows: list[tuple[str, int]]) -> None:
        (shipped / name).mkdir(parents=True)
        (shipped / name / "trials.jsonl").write_text("".join(
            json.dumps({"task": task, "latency_s": 1e-3}) + "\n" for task, n in rows for _ in range(n)))

    log("vgg16@nchwc-t2-znver1", [("conv_a", 64), ("conv_b", 10)])
    log("vgg16@nchwc-t2-znver4", [("conv_c", 64)])
    log("vgg16@nchw-t2-znver1", [("conv_d", 64)])
    todo = [adapt.PlannedKernel(t, "vgg16", t, "conv2d_NCHWc", 0.1, ["vgg16"])
            for t in ("conv_a", "conv_b", "conv_c", "conv_d")]
    assert adapt._tuned(todo, "znver1", "nchwc", 64) == {("vgg16", "conv_a")}


def test_time_shares_use_measured_latencies_and_fill_in_the_rest_by_flops(donor_dir, target):
    store = donors.DonorStore.load([donor_dir])
    ks = [w.kernel for w in store.workloads if w.records]
    known = {ks[0].workload_hash: ks[0].flops / 3e10}  # 30 GFLOP/s: this kernel is slow
    shares = adapt.time_shares(ks, known)
    assert sum(shares.values()) == pytest.approx(1.0)
    rest = [k for k in ks[1:] if k.flops > 0]
    # the others run at the same (measured) rate, so their shares follow their FLOPs
    for k in rest:
        assert shares[k.workload_hash] / shares[ks[0].workload_hash] == pytest.approx(
            k.flops * k.weight / (ks[0].flops * ks[0].weight), rel=1e-6)
    # a rate no conv runs at (a known pooling kernel's) does not make the rest look slow
    crawl = adapt.kernel_seconds(ks, {ks[0].workload_hash: ks[0].flops / 1e8})
    for k in rest:
        assert crawl[k.workload_hash] == pytest.approx(k.flops / 2e10)


@pytest.mark.slow
def test_adapt_tunes_natively_measures_and_retrains(donor_dir, measurements, target, tmp_path,
                                                    monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))  # the user's store and ranker
    kw = dict(networks=["tiny_cnn"], trials=8, tune_share=0.5, min_share=0.3, max_per_kernel=3,
              donor_dirs=[donor_dir], measurement_dirs=[measurements], layout="nchw")
    rep = adapt.adapt(target, 240, **kw)
    assert rep.planned >= 1 and rep.tuned_kernels == rep.planned and rep.collected > 0
    assert rep.seeds_measured > 0  # each search started from the ranker's picks, measured here
    # what each search bought, against the fastest transferred schedule measured here for it
    assert rep.tuned and all(t["native_s"] for t in rep.tuned) and any(t["transferred_s"] for t in rep.tuned)
    won, compared, ratio = rep.native_vs_transferred()
    assert 0 <= won <= compared <= len(rep.tuned) and ratio > 0
    native = donors.native_dir("tiny_cnn", rep.mcpu)
    assert donors.DonorStore.load([native]).networks == ["tiny_cnn"]
    # from now on the ranker that knows this CPU is the default one
    assert locations.user_ranker().exists() and Ranker.load().path == locations.user_ranker()
    # a rerun continues: nothing tuned or measured twice
    trials = (native / "trials.jsonl").read_text()
    # and follows the plan it made (kept from before the first run's tuning began)
    monkeypatch.setattr(adapt, "plan", lambda *a, **k: pytest.fail("the networks were planned again"))
    again = adapt.adapt(target, 120, **kw)
    assert (native / "trials.jsonl").read_text() == trials and again.collected == 0
    assert again.complete and adapt.adapted(target)["runs"] == 2
