"""The benchmarks' arithmetic, on hand-made inputs (no measuring)."""

import importlib.util
from pathlib import Path

import pytest

from ttrank import paper as paper_table

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(**over) -> dict:
    """Two kernels; MetaSchedule's log reaches 2 ms and 1 ms after 100 s each."""
    ms = 1e-3
    run = {
        "version": 2, "weights": {"conv": 2, "dense": 1},
        "steps_seconds": {"conv": [10.0, 100.0], "dense": [20.0, 100.0]},
        "global_seconds": {"conv": [10.0, 100.0], "dense": [110.0, 200.0]},
        "measured": {
            "untuned": {"conv": 100 * ms, "dense": 50 * ms},
            "steps": {"conv": [5 * ms, 2 * ms], "dense": [4 * ms, 1 * ms]},
            "others": {"rank1": {"conv": 3 * ms, "dense": 1.5 * ms},
                       "rank2": {"conv": 2.5 * ms, "dense": 3 * ms},
                       "rank3": {"conv": 4 * ms},  # dense: rank 3 failed its check
                       "rank4": {"conv": 1.8 * ms, "dense": 2 * ms},
                       "rank5": {"conv": 6 * ms, "dense": 2 * ms},
                       "sample_best": {"conv": 2.2 * ms, "dense": 0.9 * ms},
                       "paper": {"conv": 20 * ms}}},  # dense: no exact-class donor kernel
        "chosen": {label: {n: {"record": f"{label}-{n}"} for n in ("conv", "dense")}
                   for label in ("rank1", "rank2", "rank3", "rank4", "rank5", "sample_best", "paper")},
        "pool": {"conv": 400, "dense": 100}, "paper_measured": {"conv": 30},
        "seconds_per_candidate": 1.0, "compile_seconds": 10.0, "ranking_seconds": 5.0,
        "log_search_seconds": 200.0, "log_trials": 128, "log_trials_per_task": 64,
        "whole_model_ms": {"ttrank_top3": 8.0, "metaschedule": 7.0, "onnxruntime": 4.0},
    }
    run.update(over)
    return run


def test_top_k_is_the_fastest_of_the_first_k_ranks():
    row = paper_table.row_of(_run())
    lat = row["latency_ms"]
    assert lat["untuned"] == pytest.approx(2 * 100 + 50)
    assert lat["metaschedule_max"] == pytest.approx(2 * 2 + 1)
    assert lat["top1"] == pytest.approx(2 * 3 + 1.5)
    assert lat["top3"] == pytest.approx(2 * 2.5 + 1.5)  # a failed rank just drops out
    assert lat["top5"] == pytest.approx(2 * 1.8 + 1.5)
    assert lat["exhaustive"] == pytest.approx(2 * 1.8 + 0.9)  # the sample found a faster dense
    assert lat["paper"] == pytest.approx(2 * 20 + 50)  # no paper schedule: the kernel stays untuned
    s_max = 250 / 5
    assert row["pct_max_speedup"]["top3"] == pytest.approx((250 / 6.5 - 1) / (s_max - 1))
    # search: k candidates per kernel (a rank that failed its check was measured all the same),
    # plus the untuned kernels, compiling and ranking; exhaustive measures the whole pool; the
    # paper all its 30 candidates
    assert row["candidates_measured"] == {"top1": 2, "top3": 6, "top5": 10, "exhaustive": 500, "paper": 30}
    assert row["search_seconds"]["top3"] == pytest.approx((6 + 2) * 1.0 + 10 + 5)
    assert row["search_seconds"]["paper"] == pytest.approx((30 + 2) * 1.0 + 10)
    assert row["ort_latency_ratio_top3"] == pytest.approx(2.0)


def test_metaschedule_time_to_match_is_a_lower_bound_when_never_reached():
    row = paper_table.row_of(_run())
    # exhaustive (4.5 ms) beats the log's best (5 ms): the whole log is only a lower bound
    assert row["metaschedule_time_ratio"]["exhaustive"]["lower_bound"] is True
    # top-1 (7.5 ms) is reached inside the log, so its ratio is a measured one
    assert row["metaschedule_time_ratio"]["top1"]["lower_bound"] is False
    assert row["metaschedule_time_ratio"]["top1"]["value"] > 0


def test_a_schedule_picked_twice_counts_its_faster_measurement():
    run = _run()
    run["chosen"]["sample_best"]["conv"] = {"record": "rank2-conv"}  # the sample's best is rank 2
    row = paper_table.row_of(run)
    assert row["latency_ms"]["top3"] == pytest.approx(2 * 2.2 + 1.5)


def test_runs_of_an_older_protocol_are_left_out_of_the_table(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(paper_table, "runs_dir", lambda: tmp_path)
    (tmp_path / "resnet18.json").write_text(json.dumps(_run(version=1)))
    (tmp_path / "vgg16.json").write_text(json.dumps(_run()))
    table = paper_table.build_table(["resnet18", "vgg16"])
    assert list(table["networks"]) == ["vgg16"] and table["missing"] == ["resnet18"]
    assert table["average"]["pct_max_speedup_top3"] == pytest.approx(
        table["networks"]["vgg16"]["pct_max_speedup"]["top3"])


def test_averages_are_also_taken_over_long_runs_on_this_machine(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(paper_table, "runs_dir", lambda: tmp_path)
    here = {"mcpu": "znver4", "threads": 2}
    # resnet18's MetaSchedule ran 200 trials per task here; vgg16's 64 on another CPU, 3x slower
    (tmp_path / "resnet18.json").write_text(json.dumps(_run(provenance=here, log_cpus=["znver4"], log_threads=2,
                                                             log_trials_per_task=200)))
    slow = _run()
    slow = {k: {n: [3 * t for t in ts] for n, ts in slow[k].items()} for k in ("steps_seconds", "global_seconds")}
    (tmp_path / "vgg16.json").write_text(json.dumps(_run(provenance=here, log_cpus=["emeraldrapids"], log_threads=1,
                                                          log_search_seconds=600.0, **slow)))
    table = paper_table.build_table(["resnet18", "vgg16"])
    rows, avg = table["networks"], table["average"]
    assert rows["resnet18"]["metaschedule_reference"] and not rows["vgg16"]["metaschedule_reference"]
    assert avg["networks_reference"] == ["resnet18"]
    r18, vgg = (rows[n]["metaschedule_time_ratio"]["top3"]["value"] for n in ("resnet18", "vgg16"))
    assert vgg == pytest.approx(3 * r18)
    assert avg["metaschedule_time_ratio_top3_reference"] == pytest.approx(r18)
    assert avg["metaschedule_time_ratio_top3"] == pytest.approx((r18 * vgg) ** 0.5)
    assert avg["pct_max_speedup_top3_reference"] == pytest.approx(rows["resnet18"]["pct_max_speedup"]["top3"])
    # the exhaustive ratio is a lower bound (the log never reached it)
    assert avg["metaschedule_time_ratio_exhaustive_reference_is_lower_bound"] is True
    # a long run searched on another CPU is no reference either
    (tmp_path / "resnet18.json").write_text(json.dumps(_run(provenance=here, log_cpus=["emeraldrapids"],
                                                             log_threads=2, log_trials_per_task=200)))
    assert paper_table.build_table(["resnet18"])["average"]["networks_reference"] == []


def test_host_bench_summarises_each_phase_against_onnxruntime():
    """bench/host.py's host.json: the average ttrank/onnxruntime ratio over the CNNs measured,
    and how many are faster than onnxruntime."""
    spec = importlib.util.spec_from_file_location("host_bench", BENCH / "host.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    assert "resnet18" in host.CNNS and "bert" not in host.CNNS and len(host.CNNS) == 9
    phase = {"networks": {"resnet18": {"ort_ratio": 1.5}, "vgg16": {"ort_ratio": 0.9},
                          "alexnet": {"ort_ratio": None, "error": "failed"}}}
    assert host.summary(phase) == {"ort_ratio_cnn_avg": pytest.approx(1.2), "networks_faster_than_ort": 1,
                                   "networks_measured": 2}
    assert host.summary({"networks": {}})["ort_ratio_cnn_avg"] is None


def test_recommend_bench_runs_recommend_in_the_layout_metaschedule_tuned(tmp_path):
    """Kernel sums compare only over the same kernels: an NCHWc MetaSchedule run is matched by an
    NCHWc recommend, and a run from before layouts (no layout in its manifest) by NCHW."""
    import json

    spec = importlib.util.spec_from_file_location("recommend_bench", BENCH / "recommend_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "tune_manifest.json").write_text(json.dumps({"layout": "nchwc"}))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tune_manifest.json").write_text(json.dumps({"trials_per_task": 200}))
    assert module.ms_layout(tmp_path / "packed") == "nchwc"
    assert module.ms_layout(tmp_path / "old") == "nchw"
    assert module.ms_layout(None) == "nchw"


def test_the_long_metaschedule_runs_are_donor_sets_left_out_with_their_network():
    """The paper table's 200-trial runs live in the donor store: recommend ranks their schedules
    for every other network, and leave-one-out drops a network's long run with its other sets."""
    from ttrank.bench import LONG, LONG_TRIALS, long_dir, metaschedule_dir
    from ttrank.donors import shipped_work_dirs
    from ttrank.workdir import network_of, read_manifest

    shipped = shipped_work_dirs()
    for net in LONG:
        run = long_dir(net)
        assert run in shipped and metaschedule_dir(net) == run
        assert network_of(run) == net and read_manifest(run)["trials_per_task"] >= LONG_TRIALS
    assert long_dir("vgg16") not in shipped  # no long run: where one would be tuned on this host
