"""recommend's search time (issue #20): measure what is uncertain, no duplicate work, the donor
store from one index, and the anytime curve in the report."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from ttrank import donors, frontend, zoo
from ttrank.kernels import extract
from ttrank.ranker import Ranker
from ttrank.ranking import rank_kernel, shortlist


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


def test_the_store_index_follows_the_logs(donor_dir, tmp_path):
    """A log that changes (a `donors add`, a retune) is a new index: stat, not content."""
    import shutil

    work = tmp_path / "tiny_resnet"
    shutil.copytree(donor_dir, work)
    before = donors.store_index_path([work])
    rec = next(p for p in work.iterdir() if p.name.startswith("database_tuning_record"))
    rec.write_bytes(rec.read_bytes())  # the same content, written again
    assert donors.store_index_path([work]) != before
    assert donors.store_index_path([work], top_k=3) != donors.store_index_path([work])
